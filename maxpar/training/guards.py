"""Guards that stop a run safely: preemption (SIGTERM) and Ctrl-C (SIGINT), non-finite losses, and steps that
never finish.

Preemption and NaN stops happen between steps, so the newest checkpoint is always a complete, good
one. The step watchdog ends a process that is stuck (so that its peers, waiting on it in a
collective, fail on the lost heartbeat instead of waiting forever); it never touches checkpoints.
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
from typing import Any

import jax


# Exit status after a SIGTERM or SIGINT that stopped the run with a checkpoint written (sysexits' EX_TEMPFAIL:
# a temporary failure, retry): rerun the same command to resume exactly.
PREEMPTED_EXIT_STATUS = 75
# Exit status when a write to storage failed for good: a checkpoint save on every attempt of its retry policy (sysexits'
# EX_IOERR). The newest complete checkpoint is intact: rerun the same command once the storage is reachable.
STORAGE_EXIT_STATUS = 74
# Exit status after a second Ctrl-C, which ends the process at once (the shell's convention for SIGINT).
INTERRUPTED_EXIT_STATUS = 128 + signal.SIGINT

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


def first_nonfinite(losses: Sequence[tuple[int, Any]]) -> tuple[int, float] | None:
    """(step, loss) of the first NaN/Inf among (step, device scalar) pairs: one transfer for them all."""
    values = jax.device_get([loss for _, loss in losses])
    return next(((step, float(value)) for (step, _), value in zip(losses, values) if not math.isfinite(float(value))),
                None)


def stop_on_nonfinite(losses: Sequence[tuple[int, Any]], manager: Any) -> None:
    """Raise before a NaN/Inf state is logged as fine or checkpointed; earlier checkpoints stay as they are."""
    bad = first_nonfinite(losses)
    if bad is None:
        return
    latest = manager.latest_step() if manager else None
    kept = f"the newest checkpoint, step {latest}, is intact" if latest is not None else "no checkpoint was written"
    raise FloatingPointError(f"loss is {bad[1]} at step {bad[0]}; stopped before checkpointing it ({kept}). Lower "
                             f"learning_rate or check the data, then rerun to resume; stop_on_nan=false trains on "
                             f"regardless")


class LossCheck:
    """Losses waiting to be checked for NaN/Inf. Reading a loss waits for its step, so they are collected and
    checked together when the cadence says (before anything is logged or saved), not after every step."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._pending: list[tuple[int, Any]] = []

    def add(self, step: int, loss: Any) -> None:
        if self.enabled:
            self._pending.append((step, loss))

    def check(self, manager: Any) -> None:
        """`stop_on_nonfinite` over the pending losses, then none are pending."""
        pending, self._pending = self._pending, []
        if pending:
            stop_on_nonfinite(pending, manager)


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
