"""Guards that keep a run safe: bad steps (a non-finite loss or gradient norm, a loss spike), preemption (SIGTERM)
and Ctrl-C (SIGINT), and steps that never finish.

A bad step is judged inside the compiled step (`judge_step`), before its update is applied: its update is not
applied, so the state the step returns is the previous one and every checkpoint holds finite numbers. With
stop_on_nan the loop then stops at the first non-finite step (`LossCheck`), before anything after it is logged or
saved. Preemption stops happen between steps, so the newest checkpoint is always a complete, good one. The step
watchdog ends a process that is stuck (so that its peers, waiting on it in a collective, fail on the lost
heartbeat instead of waiting forever); it never touches checkpoints.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


# Exit status after a SIGTERM or SIGINT that stopped the run with a checkpoint written (sysexits' EX_TEMPFAIL:
# a temporary failure, retry): rerun the same command to resume exactly.
PREEMPTED_EXIT_STATUS = 75
# Exit status when a write to storage failed for good: a checkpoint save on every attempt of its retry policy (sysexits'
# EX_IOERR). The newest complete checkpoint is intact: rerun the same command once the storage is reachable.
STORAGE_EXIT_STATUS = 74
# Exit status after a second Ctrl-C, which ends the process at once (the shell's convention for SIGINT).
INTERRUPTED_EXIT_STATUS = 128 + signal.SIGINT

# ---------------------------------------------------------------- bad steps, judged inside the step

# The loss's running average is an exponential moving average over the finite losses: a horizon of about 100 steps,
# long against a spike, short against the loss's own descent. Spikes are judged once it has seen this many losses.
LOSS_AVERAGE_DECAY = 0.99
SPIKE_MIN_LOSSES = 10


class StepGuard(NamedTuple):
    """What the bad-step test remembers across steps: the loss's running average and how many updates it kept
    out. It lives in the optimizer state (`maxpar.training.optimizer.OptimizerState`), so a checkpoint saves it and a
    resume continues it exactly."""

    loss_sum: jax.Array           # float32: the moving average's decayed sum of finite losses (unnormalized)
    losses_seen: jax.Array        # int32: finite losses in it
    skipped_nonfinite: jax.Array  # int32: steps whose loss or gradient norm was NaN/Inf
    skipped_spikes: jax.Array     # int32: steps whose loss exceeded skip_step_on_spike_factor x the average

    @classmethod
    def fresh(cls) -> StepGuard:
        zero = jnp.zeros((), jnp.int32)
        return cls(jnp.zeros((), jnp.float32), zero, zero, zero)

    @property
    def loss_average(self) -> jax.Array:
        """The bias-corrected moving average (as Adam's moments: the early steps are not pulled towards 0)."""
        weight = 1.0 - jnp.power(jnp.float32(LOSS_AVERAGE_DECAY), self.losses_seen.astype(jnp.float32))
        return self.loss_sum / jnp.maximum(weight, 1e-30)

    @property
    def skipped(self) -> jax.Array:
        return self.skipped_nonfinite + self.skipped_spikes


class StepVerdict(NamedTuple):
    """Whether a step's update is applied, and the guard's statistics after the step."""

    apply: jax.Array    # bool: the loss and gradient norm are finite and the loss is no spike
    guard: StepGuard


def judge_step(guard: StepGuard, loss: jax.Array, grad_norm: jax.Array, spike_factor: float) -> StepVerdict:
    """Apply a step's update only if its loss and gradient norm are finite and (spike_factor > 0) its loss is at most
    spike_factor x the running average of the previous losses. A finite loss joins the average even when it is a
    spike, so that a lasting shift of the loss's level is taken in after some steps instead of skipping for ever."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    spike = jnp.zeros((), bool)
    if spike_factor > 0:
        spike = finite & (guard.losses_seen >= SPIKE_MIN_LOSSES) & (loss > spike_factor * guard.loss_average)
    seen = finite.astype(jnp.int32)
    safe_loss = jnp.where(finite, loss, 0.0).astype(jnp.float32)
    loss_sum = jnp.where(finite, LOSS_AVERAGE_DECAY * guard.loss_sum + (1 - LOSS_AVERAGE_DECAY) * safe_loss,
                         guard.loss_sum)
    return StepVerdict(apply=finite & ~spike,
                       guard=StepGuard(loss_sum=loss_sum, losses_seen=guard.losses_seen + seen,
                                       skipped_nonfinite=guard.skipped_nonfinite + (1 - seen),
                                       skipped_spikes=guard.skipped_spikes + spike.astype(jnp.int32)))


# ---------------------------------------------------------------- stopping between steps

_STOP_WORDS = {signal.SIGTERM: "preempted (SIGTERM)", signal.SIGINT: "interrupted (SIGINT)"}


class Preempted(Exception):
    """SIGTERM or SIGINT stopped the run after `step`; with checkpointing on, that step was saved synchronously."""

    def __init__(self, step: int, saved: bool, rerun: str = "rerun the same command",
                 signum: int = signal.SIGTERM):
        outcome = (f"checkpoint step {step} is written; {rerun} to resume" if saved else
                   "nothing was saved (enable_checkpointing=false)")
        super().__init__(f"{_STOP_WORDS.get(signum, 'stopped')} after step {step}: {outcome}")
        self.step, self.saved, self.signum = step, saved, signum


def second_interrupt_words(checkpointing: bool, newest: int | None) -> str:
    """What a second Ctrl-C leaves: the newest complete checkpoint, when there is one (a save it cuts short is never
    used)."""
    if not checkpointing:
        return "second interrupt: stopped at once; nothing was saved (enable_checkpointing=false)"
    if newest is None:
        return ("second interrupt: stopped at once, before any checkpoint was complete (a save cut short is never "
                "used): a rerun starts from the beginning")
    return (f"second interrupt: stopped at once; checkpoint step {newest} is intact (a save cut short is never used). "
            f"Rerun the same command to resume from it.")


class PreemptionWatch:
    """Notices SIGTERM and SIGINT (Ctrl-C) so that the loop stops between steps instead of dying mid-step.

    One process: a handler records the signal and the loop polls it. Several processes: they must
    stop at the same step, which JAX's preemption service (started with the distributed runtime, and
    notified by SIGTERM itself) agrees on; a Python SIGTERM handler would replace its notifier, so
    SIGINT is passed on to it as a SIGTERM to this process. A second Ctrl-C ends the process at
    once (exit status 130): a save it cuts short leaves only Orbax's temporary directory, which is
    never restored, so the newest complete checkpoint stays intact. A repeated SIGTERM changes
    nothing (the stop is already under way). The previous handlers are restored on exit.
    """

    def __init__(self, newest_checkpoint: Callable[[], int | None] | None = None) -> None:
        """`newest_checkpoint`: the newest complete checkpoint's step (None: none yet); not given: checkpointing
        is off. A second Ctrl-C says which step a rerun resumes from."""
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._newest_checkpoint = newest_checkpoint

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is not threading.main_thread():
            return self
        if jax.process_count() == 1:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_signal)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            newest = self._newest_checkpoint() if self._newest_checkpoint else None
            print(f"\nmaxpar: {second_interrupt_words(self._newest_checkpoint is not None, newest)}", file=sys.stderr,
                  flush=True)
            os._exit(INTERRUPTED_EXIT_STATUS)
        if self.signum is None:
            self.signum = signum
            if signum == signal.SIGINT:
                print("\nmaxpar: interrupt: stopping after this step with a checkpoint (Ctrl-C again to stop at once)",
                      file=sys.stderr, flush=True)
        if signum == signal.SIGINT and jax.process_count() > 1:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption notifier makes every process stop together

    def requested(self, step: int) -> bool:
        """Whether to stop after `step` (every process calls this at every step)."""
        if jax.process_count() == 1:
            return self.signum is not None
        from jax.experimental import multihost_utils
        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # this runtime has no preemption service
            return False


class StepsInFlight:
    """Keeps the host at most `depth` steps ahead of the device.

    JAX dispatches steps asynchronously, so an unbounded host runs many steps ahead between the syncs that
    logging makes; a stop it then notices at "this step" waits for every step already queued. Waiting for the
    step `depth` back before going on makes a stop (and a stuck-step check) follow the device within about a
    step, and costs no sync in the steady state: the device is still busy with the newer steps.
    """

    def __init__(self, depth: int = 1) -> None:
        self._depth = depth
        self._queued: collections.deque[Any] = collections.deque()

    def add(self, outputs: Any) -> None:
        """`outputs`: a step's (small) results, just dispatched; waits for those of the step `depth` back."""
        self._queued.append(outputs)
        if len(self._queued) > self._depth:
            jax.block_until_ready(self._queued.popleft())


def first_nonfinite(values: Sequence[tuple[int, float]]) -> tuple[int, float] | None:
    """(step, value) of the first NaN/Inf among (step, value) pairs read to the host."""
    return next(((step, float(value)) for step, value in values if not math.isfinite(value)), None)


# A finite loss this many times the lowest one before it marks where a run diverged (a hint in the stop's words only).
DIVERGED_FACTOR = 3.0


class Divergence(NamedTuple):
    """Where this process saw the loss jump: `step`, its `loss`, and the `lowest` loss before it."""

    step: int
    loss: float
    lowest: float


def stop_on_nonfinite(losses: Sequence[tuple[int, Any]], grad_norms: Sequence[tuple[int, Any]],
                      manager: Any, start_step: int = 0, divergence: Divergence | None = None) -> None:
    """Raise at the first step whose loss or gradient norm is NaN/Inf. That step's update was not applied
    (`judge_step`) and the loop raises before anything after it is logged or saved, so the newest checkpoint is
    one from before it: finite, and what a rerun resumes from. Finite is not always sound, though: when the loss
    jumped earlier (`divergence`) or the first step after resuming from `start_step` is already bad, the newest
    checkpoint's weights lead there whatever the learning rate, and the words name a checkpoint from before."""
    bad_loss, bad_norm = first_nonfinite(losses), first_nonfinite(grad_norms)
    if bad_loss is None and bad_norm is None:
        return
    if bad_loss is not None and (bad_norm is None or bad_loss[0] <= bad_norm[0]):
        step, what = bad_loss[0], f"loss is {bad_loss[1]}"
    else:
        step, what = bad_norm[0], f"gradient norm is {bad_norm[1]}"
    latest = manager.latest_step() if manager else None
    kept = f"the newest checkpoint, step {latest}, is intact" if latest is not None else "no checkpoint was written"
    words = f"{what} at step {step}; stopped before checkpointing it ({kept}), and its update was not applied. "
    # The first checkpoint whose weights lead to the bad losses: the one before the jump, or the one resumed from.
    tainted_from = None
    if divergence is not None and divergence.step < step:
        tainted_from = divergence.step - 1
        cause = (f"The loss had already jumped at step {divergence.step} ({divergence.loss:,.4g} against "
                 f"{divergence.lowest:.4g} at its lowest before)")
    elif start_step and step == start_step + 1:
        tainted_from, cause = start_step, f"The first step after resuming from step {start_step} is already bad"
    if tainted_from is not None and latest is not None and latest >= tainted_from:
        earlier = [s for s in manager.all_steps() if s < tainted_from]
        advice = ("start a new run (another run_name) with a lower learning_rate from the newest checkpoint before "
                  f"that: load_full_state_path={manager.directory / str(max(earlier))}" if earlier else
                  "start a new run (another run_name) with a lower learning_rate: no checkpoint from before that is "
                  "kept")
        words += f"{cause}: the checkpoints since step {tainted_from} carry those weights on, so {advice}"
    else:
        words += "Lower learning_rate or check the data, then rerun to resume"
    raise FloatingPointError(words + "; stop_on_nan=false skips such steps' updates and trains on")


class LossCheck:
    """Losses and gradient norms waiting to be checked for NaN/Inf. Reading one waits for its step, so they are
    collected and checked together when the cadence says (before anything is logged or saved), not after every
    step. It remembers the first jump of the losses it read (`Divergence`), for the stop's words."""

    def __init__(self, enabled: bool, start_step: int = 0) -> None:
        self.enabled, self.start_step = enabled, start_step
        self._losses: list[tuple[int, Any]] = []
        self._grad_norms: list[tuple[int, Any]] = []
        self._lowest = math.inf
        self.divergence: Divergence | None = None

    def add(self, step: int, loss: Any, grad_norm: Any = None) -> None:
        if self.enabled:
            self._losses.append((step, loss))
            if grad_norm is not None:
                self._grad_norms.append((step, grad_norm))

    def check(self, manager: Any) -> None:
        """`stop_on_nonfinite` over the pending values, then none are pending."""
        pending = (self._losses, self._grad_norms)
        self._losses, self._grad_norms = [], []
        fetched = jax.device_get([[value for _, value in values] for values in pending])  # one transfer for all
        losses, grad_norms = ([(step, float(v)) for (step, _), v in zip(values, got)]
                              for values, got in zip(pending, fetched))
        for step, loss in losses:
            if not math.isfinite(loss):
                break
            if self.divergence is None and loss > DIVERGED_FACTOR * self._lowest:
                self.divergence = Divergence(step, loss, self._lowest)
            self._lowest = min(self._lowest, loss)
        if losses:
            stop_on_nonfinite(losses, grad_norms, manager, self.start_step, self.divergence)


# Exit status of a process the step watchdog ended.
STUCK_EXIT_STATUS = 3


@dataclasses.dataclass(frozen=True)
class SlowStepNote:
    """A line said once when a step has run `after_s` seconds without finishing: what may come of it (an abort
    that maxpar cannot catch, say), before it comes. The run goes on."""

    after_s: float
    text: str


class StepWatchdog:
    """Ends this process when no training step finishes within `timeout_s` seconds of the previous one.

    A dead or frozen process stops heartbeating and the distributed runtime stops its peers; a
    process that is alive but stuck (a deadlock in input code, a collective that never completes)
    keeps heartbeating, and without this its peers would wait in their next collective forever.
    Armed by the first `progress()` (after compilation, which may take long); `timeout_s=0` turns it off.
    `note`, if given, is said once when a step runs past its `after_s`, whatever `timeout_s` is.
    """

    def __init__(self, timeout_s: float, note: SlowStepNote | None = None) -> None:
        self._timeout_s = timeout_s
        self._note, self._noted = note, False
        self._last: float | None = None
        self._step = 0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StepWatchdog:
        if self._timeout_s > 0 or self._note:
            self._thread = threading.Thread(target=self._watch, name="maxpar-step-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._done.set()

    def progress(self, step: int) -> None:
        """Step `step` (with its eval and save) finished: the clock starts again."""
        self._step, self._last = step, time.monotonic()

    def _poll_s(self) -> float:
        limits = [limit for limit in (self._timeout_s, self._note.after_s if self._note else 0) if limit > 0]
        return min(min(limits) / 10, 5.0)

    def _watch(self) -> None:
        while not self._done.wait(self._poll_s()):
            last = self._last
            if last is None:
                continue
            waited = time.monotonic() - last
            if self._note and not self._noted and waited > self._note.after_s:
                self._noted = True
                print(f"maxpar: step {self._step + 1} has run {waited:.0f} s without finishing; {self._note.text}",
                      file=sys.stderr, flush=True)
            if self._timeout_s > 0 and waited > self._timeout_s:
                print(f"maxpar: no training step finished in {self._timeout_s:g} s after step {self._step}; this "
                      f"process is stuck, so it stops (exit status {STUCK_EXIT_STATUS}) rather than leave the "
                      f"others waiting. Raise step_timeout_s if steps really take this long; the newest "
                      f"checkpoint is intact.", file=sys.stderr, flush=True)
                os._exit(STUCK_EXIT_STATUS)
