"""Storage outages during a run on gs:// (docs/storage.md#outages): the emulator, keeping its objects on disk, is
stopped mid-run and started again on the same port, or stopped for good. The run is a training process; the same
command then resumes it in this process (`maxpar.train.main`, the process's exit status its return value): a
process adds nothing to reading back what the outage left."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from gcs import Server, filesystem, process_env
from helpers import compilation_cache_env, start_training, train_command
from maxpar.core import storage
from maxpar.training.guards import STORAGE_EXIT_STATUS

pytestmark = pytest.mark.slow  # training processes against a failing server: left out of the development tier

BUCKET = "maxpar-outage"
STEPS = 12
# Saves at steps 6 and 12 (all kept), retried 1, 2, 4, 8 s apart: a 3-second outage is waited out. Steps of 256 tokens
# per row take long enough that an outage begun at step 1 is under way when step 6 saves.
RUN = ("dataset_type=synthetic", "per_device_batch_size=1", "max_target_length=256", f"steps={STEPS}",
       "enable_checkpointing=true", "checkpoint_period=6", "max_checkpoints_to_keep=0", "save_retry_delay_s=1",
       "save_retry_max_delay_s=8", f"base_output_directory=gs://{BUCKET}/runs")


def test_the_retry_policy_doubles_its_delay_up_to_the_cap_and_reports_the_last_failure():
    policy = storage.RetryPolicy(attempts=5, base_delay_s=1.5, max_delay_s=5)
    assert policy.delays() == [1.5, 3, 5, 5]
    outcomes, warned, slept = [OSError("refused"), OSError("refused"), "saved"], [], []

    def action():
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert policy.run(action, "checkpoint step 4 to gs://b/r", warned.append, slept.append) == "saved"
    assert slept == [1.5, 3]
    assert warned == ["checkpoint step 4 to gs://b/r failed (OSError: refused); attempt 2 of 5 in 1.5 s",
                      "checkpoint step 4 to gs://b/r failed (OSError: refused); attempt 3 of 5 in 3 s"]

    def refused():
        raise ConnectionRefusedError("no server")

    with pytest.raises(storage.StorageError, match=r"^checkpoint step 4 to gs://b/r failed 2 time\(s\); last: "
                                                   r"ConnectionRefusedError: no server$"):
        storage.RetryPolicy(attempts=2, base_delay_s=0).run(refused, "checkpoint step 4 to gs://b/r", warned.append,
                                                            slept.append)


@pytest.fixture
def server(tmp_path, monkeypatch):
    """The emulator, its objects on disk; this test's own process reaches it as maxpar's would."""
    server = Server(BUCKET, tmp_path / "emulator.log", data_dir=tmp_path / "objects")
    environ = {storage.EMULATOR: server.start()}
    for key, value in {**environ, **storage.emulator_environment(environ)}.items():
        monkeypatch.setenv(key, value)
    yield server
    server.stop()


def train_until(server: Server, run_name: str, log, step: int, env: dict[str, str], *overrides: str):
    """Start a training process on the emulator and return it once it has logged `step`."""
    process = start_training(train_command(*RUN, f"run_name={run_name}", *overrides), log, env)
    while f"step {step} " not in log.read_text() and process.poll() is None:
        time.sleep(0.02)
    return process


def losses(fs, run_name: str) -> dict[int, float]:
    text = fs.cat(f"{BUCKET}/runs/{run_name}/metrics.jsonl").decode()
    return {row["step"]: row["loss"] for row in map(json.loads, text.splitlines())}


def complete_steps(fs, run_name: str) -> list[int]:
    """The steps whose save completed: on gs:// Orbax writes commit_success.txt last."""
    names = fs.find(f"{BUCKET}/runs/{run_name}/checkpoints")
    return sorted(int(m.group(1)) for n in names if (m := re.search(r"/checkpoints/(\d+)/commit_success\.txt$", n)))


def test_a_save_during_a_short_outage_is_retried_and_the_run_resumes_bitwise(server, tmp_path, monkeypatch, capsys):
    env = process_env(server.url, compilation_cache_env(tmp_path / "jax_cache"))
    log = tmp_path / "train.log"
    process = train_until(server, "blip", log, 1, env)
    server.stop()
    time.sleep(3)
    server.start()
    assert process.wait(timeout=300) == 0, log.read_text()[-3000:]
    output = log.read_text()
    assert re.search(r"warning: checkpoint step 6 to gs://maxpar-outage/runs/blip/checkpoints failed "
                     r"\(Unreachable: cannot connect to 127\.0\.0\.1:\d+.*\); attempt 2 of 4 in 1 s", output), output
    fs = filesystem(server.url)
    assert complete_steps(fs, "blip") == [6, 12]
    first = losses(fs, "blip")
    assert sorted(first) == list(range(1, STEPS + 1))
    fs.rm(f"{BUCKET}/runs/blip/checkpoints/12", recursive=True)  # resume from the step saved through the outage
    status, output = rerun(monkeypatch, capsys, "run_name=blip")
    assert status == 0, output
    assert "resumed from checkpoint at step 6" in output
    assert losses(fs, "blip") == first  # bitwise: floats from JSON


def test_a_save_that_fails_for_good_stops_with_one_line_and_restore_takes_the_last_good_step(server, tmp_path,
                                                                                              monkeypatch, capsys):
    env = process_env(server.url, compilation_cache_env(tmp_path / "jax_cache"))
    log = tmp_path / "train.log"  # saving synchronously, step 6 is complete once step 7 is logged
    process = train_until(server, "dead", log, 7, env, "save_attempts=2", "async_checkpointing=false")
    server.stop()
    assert process.wait(timeout=300) == STORAGE_EXIT_STATUS, log.read_text()[-3000:]
    output = log.read_text()
    errors = [line for line in output.splitlines() if line.startswith("maxpar: storage error:")]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    assert re.match(r"maxpar: storage error: checkpoint step 12 to gs://maxpar-outage/runs/dead/checkpoints failed "
                    r"2 time\(s\); last: Unreachable: cannot connect to 127\.0\.0\.1:\d+.*The newest complete "
                    r"checkpoint is step 6; rerun the same command", errors[0]), errors[0]

    server.start()
    fs = filesystem(server.url)
    assert complete_steps(fs, "dead") == [6]
    fs.pipe(f"{BUCKET}/runs/dead/checkpoints/9/params/_METADATA", b"{}")  # a save cut short: no commit_success.txt
    status, output = rerun(monkeypatch, capsys, "run_name=dead", "steps=6")
    assert status == 0, output
    assert "resumed from checkpoint at step 6" in output
    assert not fs.exists(f"{BUCKET}/runs/dead/checkpoints/9"), "a step cut short is removed when a run starts"


def rerun(monkeypatch, capsys, *overrides: str) -> tuple[int, str]:
    """The training command's `main` in this process (its 8 simulated devices, the server the fixture named): the
    exit status and the output."""
    from maxpar.train import main

    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))  # main sets it where it is unset
    capsys.readouterr()
    status = main(train_command(*RUN, *overrides)[3:])  # the arguments after `python -m maxpar.train`
    out = capsys.readouterr()
    return status, out.out + out.err
