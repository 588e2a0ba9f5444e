"""When the training loop logs, evaluates, saves and checks losses: small every-N policies.

Kept out of the loop so that `train()` reads as a plain loop and each rule is tested on its own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from maxpar.core.config import Config


@dataclasses.dataclass(frozen=True)
class Every:
    """Due at every `period`-th step (period 0: never by count) and, if `at_last`, at step `last`."""

    period: int
    last: int
    at_last: bool = True

    def __call__(self, step: int) -> bool:
        return (self.period > 0 and step % self.period == 0) or (self.at_last and step == self.last)


NEVER = Every(period=0, last=0, at_last=False)


@dataclasses.dataclass(frozen=True)
class Due:
    """What the loop does after one step."""

    log: bool          # a metrics line (and TensorBoard scalars)
    eval: bool         # an evaluation, logged on that line
    save: bool         # a checkpoint
    save_local: bool   # a checkpoint to the local tier only (never on a step that `save` covers)
    stop: bool         # preempted: save (if checkpointing) and stop
    last: bool         # the run's last step
    check_losses: bool  # look for NaN/Inf among the losses not checked yet, before any of the above

    @property
    def read_late(self) -> bool:
        """Only logged: the step's metrics may be read after the next step is dispatched, so that writing the line
        overlaps the device's work. Evaluating, saving and stopping need this step's state, which the next step
        consumes; the last step has no next."""
        return self.log and not (self.eval or self.save or self.save_local or self.stop or self.last)


@dataclasses.dataclass(frozen=True)
class Cadence:
    log: Every
    eval: Every
    save: Every
    checkpointing: bool
    save_local: Every = NEVER

    def after(self, step: int, stop: bool = False) -> Due:
        """Due after `step`; `stop` = a preemption was requested. Every logged step also evaluates when an
        evaluation is due, and nothing is logged or saved before its losses are checked."""
        evaluate = self.eval(step)
        log = self.log(step) or evaluate
        save = self.checkpointing and (self.save(step) or stop)
        save_local = self.checkpointing and not save and self.save_local(step)
        return Due(log=log, eval=evaluate, save=save, save_local=save_local, stop=stop, last=step == self.log.last,
                   check_losses=log or save or save_local or stop)


def cadence(config: Config, *, has_eval_data: bool, checkpointing: bool) -> Cadence:
    """The loop's policies from the config: log every log_period steps; evaluate every eval_interval steps
    (0: only at the end, -1: never) when data is held out; save every checkpoint_period steps; all three at the
    last step. With a local tier, also save there every local_checkpoint_period steps that the persistent tier
    does not save (the last step always goes to the persistent tier)."""
    last = config.steps
    evaluates = has_eval_data and config.eval_interval >= 0
    return Cadence(log=Every(config.log_period, last),
                   eval=Every(config.eval_interval, last) if evaluates else NEVER,
                   save=Every(config.checkpoint_period, last) if checkpointing else NEVER,
                   checkpointing=checkpointing,
                   save_local=Every(config.local_checkpoint_period, last, at_last=False)
                   if checkpointing and config.local_checkpoint_directory else NEVER)


class StepTimer:
    """Wall seconds per step over the steps since the last `restart()`: the loop restarts it after each logged
    step's evaluation and save, so a metrics line times training steps only."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.restart()

    def restart(self) -> None:
        self._start, self._steps = self._clock(), 0

    def tick(self) -> None:
        self._steps += 1

    def per_step(self) -> float:
        return (self._clock() - self._start) / max(self._steps, 1)
