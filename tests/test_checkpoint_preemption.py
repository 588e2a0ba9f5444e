"""Real processes: kill -9, Ctrl-C (once or twice) and SIGTERM mid-run resume bitwise identically; a save killed
mid-write is never used."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import pytest

from helpers import (REPO, MICRO, compilation_cache_env, logged_steps, read_metrics, start_training, micro_config,
                     train_command, wait_for_step, wait_until, write_corpus)
from maxpar.io import checkpoint
from maxpar.train import setup_run, train
from maxpar.training.guards import INTERRUPTED_EXIT_STATUS, PREEMPTED_EXIT_STATUS

pytestmark = pytest.mark.slow  # training processes killed and restarted: left out of the development tier

STEPS = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The uninterrupted run the interrupted ones must match bit for bit."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    train(micro_config(*overrides(corpus)), devices=jax.devices(), run_dir=run_dir)
    return run_dir


def overrides(corpus) -> list[str]:
    """Dropout-free tiny run on 8 devices, a checkpoint every 4 steps, every step logged."""
    return ["dataset_type=text", f"dataset_path={corpus}", "per_device_batch_size=1", f"steps={STEPS}",
            "checkpoint_period=4", "enable_checkpointing=true", "max_checkpoints_to_keep=2"]


def output(log_path) -> str:
    return log_path.read_text(encoding="utf-8", errors="replace")


def stop_at_once(process, how: str, log_path) -> None:
    """End a training process with no chance to finish its step: kill -9, or Ctrl-C twice."""
    if how == "kill -9":
        process.kill()
        assert process.wait(timeout=60) == -signal.SIGKILL
    else:
        process.send_signal(signal.SIGINT)
        time.sleep(0.05)  # the first interrupt asks for a checkpointed stop; the second one cuts it short
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == INTERRUPTED_EXIT_STATUS
        assert "second interrupt: stopped at once" in output(log_path)


# How a run is stopped after a step (the signal, how its one-line message names it), in the order the test sends them.
SOFT_STOPS = ((signal.SIGTERM, r"preempted \(SIGTERM\)"), (signal.SIGINT, r"interrupted \(SIGINT\)"))


def test_stops_at_once_and_after_a_step_then_finishing_matches_the_uninterrupted_run(corpus, reference, tmp_path):
    """One run directory through five processes of the same command: kill -9, Ctrl-C twice (both stop at once: no
    chance to finish the step; a save they cut short must never be used), SIGTERM, one Ctrl-C (both stop after a
    step, with that step saved), then the run to the end: bitwise the uninterrupted run. Each process resumes from
    the newest complete checkpoint, and exactly at the step a signal stopped the one before."""
    command = train_command(*overrides(corpus), f"base_output_directory={tmp_path}", "run_name=run")
    run_dir = tmp_path / "run"
    env = compilation_cache_env(tmp_path / "jax_cache")

    # 1.-2. Stopped at once: kill -9 once the first checkpoint is complete; then, resumed, Ctrl-C twice.
    newest = 0
    for index, hard_stop in enumerate(("kill -9", "Ctrl-C twice")):
        log_path = tmp_path / f"at_once_{index}.log"
        process = start_training(command, log_path, env)
        if index == 0:
            wait_for_step(process, run_dir, 6)
            wait_until(process, (run_dir / "checkpoints" / "4").is_dir, "checkpoint 4 was complete")
        else:
            wait_for_step(process, run_dir, newest + 3)
        stop_at_once(process, hard_stop, log_path)
        if index:
            resumed_from = int(re.search(r"resumed from checkpoint at step (\d+)", output(log_path))[1])
            assert 4 <= resumed_from <= newest and resumed_from % 4 == 0
        newest = max(logged_steps(run_dir))
        assert newest < STEPS, "the run finished before it could be stopped"

    # 3.-4. The same command resumes; a signal a few steps later stops it after a step, with that step saved, and
    #    the one-line message; the next one resumes exactly there.
    stopped_at = None
    for index, (soft_stop, stop_words) in enumerate(SOFT_STOPS):
        log_path = tmp_path / f"after_a_step_{index}.log"
        process = start_training(command, log_path, env)
        wait_for_step(process, run_dir, newest + 3)
        process.send_signal(soft_stop)
        assert process.wait(timeout=120) == PREEMPTED_EXIT_STATUS, output(log_path)[-3000:]
        log = output(log_path)
        assert "Traceback" not in log
        resumed_from = int(re.search(r"resumed from checkpoint at step (\d+)", log)[1])
        if stopped_at is None:
            assert 4 <= resumed_from <= newest and resumed_from % 4 == 0
        else:
            assert resumed_from == stopped_at
        stopped_at = int(re.search(stop_words + r" after step (\d+): checkpoint step \1 is written; rerun the same "
                                   r"command to resume", log)[1])
        assert newest + 3 <= stopped_at < STEPS
        newest = max(logged_steps(run_dir))

    # 5. The same command again resumes exactly at the preempted step and finishes.
    last = start_training(command, tmp_path / "last.log", env)
    assert last.wait(timeout=300) == 0, output(tmp_path / "last.log")[-3000:]
    assert f"resumed from checkpoint at step {stopped_at}" in output(tmp_path / "last.log")

    # One clean run in metrics.jsonl, bitwise equal to the uninterrupted one.
    rows, expected = read_metrics(run_dir), read_metrics(reference)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert [row["loss"] for row in rows] == [row["loss"] for row in expected]
    assert [row["grad_norm"] for row in rows] == [row["grad_norm"] for row in expected]


# The trainer's CLI, sending itself a signal (argv[1]) once the device has finished step argv[2] (a fresh run's
# argv[2]-th step): a thread waits for that step's results, as a user watching the device would.
SIGNAL_AFTER_STEP = textwrap.dedent("""
    import os, signal, sys, threading
    import jax
    from maxpar import train
    signum, signal_step = signal.Signals[sys.argv[1]], int(sys.argv[2])
    compile_train_step = train.RunSetup.compile_train_step

    def signalling(run):
        step_fn, dispatched = compile_train_step(run), iter(range(1, sys.maxsize))
        def step(state, batch):
            state, metrics = step_fn(state, batch)
            if next(dispatched) == signal_step:
                def send():
                    jax.block_until_ready(metrics)
                    os.kill(os.getpid(), signum)
                threading.Thread(target=send, daemon=True).start()
            return state, metrics
        return step

    train.RunSetup.compile_train_step = signalling
    sys.exit(train.main(sys.argv[3:]))
""")
SIGNAL_STEP = 8
# Steps the run may go on after the one the device had finished when the signal came: the host runs at most one
# step ahead of the device, plus slack for the signalling thread's wake-up on a loaded machine.
MAX_STEPS_PAST_SIGNAL = 6


def test_a_signal_stops_the_run_within_a_few_steps_of_the_device_whatever_the_log_period(corpus, tmp_path):
    """Nothing is logged before the last step, so no read syncs the host with the device: the stop must still
    come right after the step the device is at, not after every step the host has already dispatched. SIGTERM here;
    in one process a first SIGINT is the same request (guards.PreemptionWatch), and the test above sends both."""
    signum = signal.SIGTERM
    steps = SIGNAL_STEP + 100
    args = [str(REPO / "configs" / "base.yml"), *MICRO, *overrides(corpus), f"steps={steps}", f"log_period={steps}",
            f"checkpoint_period={steps}", f"base_output_directory={tmp_path}", "run_name=run"]
    done = subprocess.run([sys.executable, "-c", SIGNAL_AFTER_STEP, signum.name, str(SIGNAL_STEP), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=compilation_cache_env(tmp_path / "jax_cache"))
    assert done.returncode == PREEMPTED_EXIT_STATUS, done.stderr[-3000:]
    stopped_at = int(re.search(r"after step (\d+): checkpoint step \1 is written", done.stderr)[1])
    assert SIGNAL_STEP <= stopped_at <= SIGNAL_STEP + MAX_STEPS_PAST_SIGNAL
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == [str(stopped_at)]


# Saves step 1, starts an async save of step 2 big enough to take a while, and SIGKILLs itself.
KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    sys.path.insert(0, "tests")
    from helpers import micro_config
    from maxpar.io import checkpoint
    from maxpar.train import setup_run
    from maxpar.training.train_step import create_state
    config = micro_config(*sys.argv[2:])
    run = setup_run(config)
    state, iterator = create_state(run.model, run.tx, run.layout, run.mesh), iter(run.train_data)
    manager = checkpoint.make_manager(Path(sys.argv[1]), config)
    checkpoint.save(manager, 1, state, iterator, config, run.shape.global_rows)
    manager.wait_until_finished()
    checkpoint.save(manager, 2, state, iterator, config, run.shape.global_rows)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_save_killed_mid_write_is_never_restored(corpus, tmp_path):
    # A wide vocabulary makes the step-2 write long enough (~100 MB) to still be going when the kill lands.
    big = [*overrides(corpus), "vocab_size=65536", "async_checkpointing=true"]
    done = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tmp_path), *big], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "1" in names and "2" not in names
    assert any(name.startswith("2.orbax-checkpoint-tmp") for name in names), names  # the kill was mid-write

    config = micro_config(*big)
    run = setup_run(config)
    manager = checkpoint.make_manager(tmp_path, config)
    warnings: list[str] = []
    target = run.restore_target()
    state = checkpoint.resume(manager, target, iter(run.train_data), warnings.append)
    manager.close()
    assert int(state.step) == 1 and warnings == []
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name[0].isdigit()) == ["1"]
