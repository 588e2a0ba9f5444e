"""The loop's every-N policies: when it logs, evaluates, saves and checks losses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from helpers import micro_config
from maxpar.training.cadence import NEVER, Every, StepTimer, cadence
from maxpar.training.guards import LossCheck


def due_steps(policy, steps: int) -> list[int]:
    return [step for step in range(1, steps + 1) if policy(step)]


def test_every_n_and_the_last_step():
    assert due_steps(Every(3, last=10), 10) == [3, 6, 9, 10]
    assert due_steps(Every(5, last=10), 10) == [5, 10]
    assert due_steps(Every(3, last=10, at_last=False), 10) == [3, 6, 9]
    assert due_steps(Every(0, last=10), 10) == [10]  # period 0: only at the end
    assert due_steps(NEVER, 10) == []


def test_loop_cadence_from_the_config():
    config = micro_config("steps=10", "log_period=4", "eval_interval=3", "checkpoint_period=5")
    when = cadence(config, has_eval_data=True, checkpointing=True)
    after = {step: when.after(step) for step in range(1, 11)}
    assert [s for s, d in after.items() if d.eval] == [3, 6, 9, 10]
    assert [s for s, d in after.items() if d.log] == [3, 4, 6, 8, 9, 10]  # an eval step is always logged
    assert [s for s, d in after.items() if d.save] == [5, 10]
    assert [s for s, d in after.items() if d.check_losses] == [3, 4, 5, 6, 8, 9, 10]  # before every log or save
    assert not any(d.stop for d in after.values())


def test_only_a_step_that_is_just_logged_is_read_late():
    config = micro_config("steps=10", "log_period=1", "eval_interval=3", "checkpoint_period=4")
    when = cadence(config, has_eval_data=True, checkpointing=True)
    assert [s for s in range(1, 11) if when.after(s).read_late] == [1, 2, 5, 7]  # not eval 3, 6, 9; save 4, 8; last
    assert not when.after(5, stop=True).read_late  # a preempted step saves (or stops) with its own state
    assert not cadence(micro_config("steps=10", "log_period=5"), has_eval_data=False,
                       checkpointing=False).after(3).read_late  # not logged at all


def test_the_local_tier_saves_the_steps_the_persistent_tier_does_not():
    config = micro_config("steps=11", "log_period=1", "checkpoint_period=6", "local_checkpoint_period=2",
                         "local_checkpoint_directory=/tmp/local")
    when = cadence(config, has_eval_data=False, checkpointing=True)
    after = {step: when.after(step) for step in range(1, 12)}
    assert [s for s, d in after.items() if d.save] == [6, 11]
    assert [s for s, d in after.items() if d.save_local] == [2, 4, 8, 10]  # 6 is persistent; the last step too
    assert not any(d.read_late for s, d in after.items() if d.save_local)  # a save needs the step's own state
    assert all(d.check_losses for d in after.values() if d.save_local)
    off = cadence(micro_config("steps=11", "local_checkpoint_period=2"), has_eval_data=False, checkpointing=True)
    assert not any(off.after(s).save_local for s in range(1, 12))  # no local_checkpoint_directory: no local tier


def test_eval_interval_zero_is_the_end_only_and_minus_one_never():
    at_end = cadence(micro_config("steps=6", "eval_interval=0"), has_eval_data=True, checkpointing=False)
    assert [s for s in range(1, 7) if at_end.after(s).eval] == [6]
    never = cadence(micro_config("steps=6", "eval_interval=-1"), has_eval_data=True, checkpointing=False)
    assert not any(never.after(s).eval for s in range(1, 7))
    no_data = cadence(micro_config("steps=6", "eval_interval=2"), has_eval_data=False, checkpointing=False)
    assert not any(no_data.after(s).eval for s in range(1, 7))


def test_a_preemption_saves_only_when_checkpointing_and_always_checks_losses():
    config = micro_config("steps=100", "log_period=50", "checkpoint_period=50")
    saving = cadence(config, has_eval_data=False, checkpointing=True).after(7, stop=True)
    assert saving.stop and saving.save and saving.check_losses and not saving.log
    not_saving = cadence(config, has_eval_data=False, checkpointing=False).after(7, stop=True)
    assert not_saving.stop and not not_saving.save and not_saving.check_losses


def test_step_timer_times_the_steps_since_its_restart():
    now = [100.0]
    timer = StepTimer(clock=lambda: now[0])
    for _ in range(4):
        timer.tick()
        now[0] += 0.5
    assert timer.per_step() == 0.5
    now[0] += 7.0  # an evaluation and a save after the logged step
    timer.restart()
    timer.tick()
    now[0] += 0.25
    assert timer.per_step() == 0.25


def test_loss_check_raises_at_the_first_nonfinite_loss_and_then_starts_afresh():
    check = LossCheck(enabled=True)
    for step, loss in ((1, 2.0), (2, math.nan), (3, math.inf)):
        check.add(step, loss)
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 2; stopped before checkpointing it \(no checkpoint was written\)"):
        check.check(manager=None)
    check.add(4, 1.5)
    check.check(manager=None)  # only step 4 is pending now: fine
    off = LossCheck(enabled=False)
    off.add(1, math.nan)
    off.check(manager=None)  # stop_on_nan=false trains on regardless


class KeptSteps:
    """The part of a checkpoint manager the stop's words read: which steps are kept, where."""

    def __init__(self, steps):
        self.steps, self.directory = steps, Path("/runs/r/checkpoints")

    def latest_step(self):
        return max(self.steps, default=None)

    def all_steps(self):
        return self.steps


def test_a_nan_after_a_jump_or_right_after_a_resume_names_a_checkpoint_from_before_the_bad_weights():
    """Finite but diverged weights fail again on any learning rate: the words point before them, not at a rerun."""
    check = LossCheck(enabled=True)  # the loss jumps at step 4 (weights of step 3's update), NaN at step 7
    for step, loss in enumerate((6.8, 6.5, 6.1, 9e5, 6.2, 6.2, math.nan), start=1):
        check.add(step, loss)
    with pytest.raises(FloatingPointError) as stop:
        check.check(KeptSteps([2, 4, 6]))
    assert ("The loss had already jumped at step 4 (9e+05 against 6.1 at its lowest before): the checkpoints since "
            "step 3 carry those weights on, so start a new run (another run_name) with a lower learning_rate from "
            "the newest checkpoint before that: load_full_state_path=/runs/r/checkpoints/2") in str(stop.value)
    resumed = LossCheck(enabled=True, start_step=6)
    resumed.add(7, math.nan)
    with pytest.raises(FloatingPointError, match=r"The first step after resuming from step 6 is already bad: .* "
                                                 r"no checkpoint from before that is kept"):
        resumed.check(KeptSteps([6]))
    for kept in ([], [1]):  # nothing kept, or kept from before the jump: a rerun resumes from sound weights
        again = LossCheck(enabled=True)
        for step, loss in ((1, 6.8), (2, 6.5), (3, 9e5), (4, math.nan)):
            again.add(step, loss)
        with pytest.raises(FloatingPointError, match="Lower learning_rate or check the data, then rerun to resume"):
            again.check(KeptSteps(kept) if kept else None)
