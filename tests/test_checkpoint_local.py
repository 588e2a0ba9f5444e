"""The local checkpoint tier: a 2-process job (state split over the processes) killed with SIGKILL after a local
save newer than the persistent tier resumes from the local tier bitwise; with one process's local tier gone it
resumes from the persistent tier; a local tier written under another mesh is not used.

The job's persistent tier and run outputs are on gs:// (a GCS API server on loopback, tests/gcs.py), so the same
launches prove that a 2-process job killed mid-run resumes bitwise from the bucket. The launched processes run this
file as their module (`worker`): both runs of a launch in the same processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))  # helpers, also for the launched worker processes

import jax  # noqa: E402
import pytest  # noqa: E402

from gcs import emulator, filesystem, process_env  # noqa: E402
from helpers import REPO, MICRO, compilation_cache_env, micro_config, write_corpus  # noqa: E402
from maxpar import train as train_module  # noqa: E402
from maxpar.core import storage  # noqa: E402
from maxpar.io import checkpoint, local_checkpoint  # noqa: E402
from maxpar.train import setup_run  # noqa: E402
from maxpar.training.train_step import create_state  # noqa: E402

pytestmark = pytest.mark.slow  # multi-process jobs: left out of the development tier

STEPS, PERSISTENT, LOCAL, KILL_AFTER = 8, 5, 2, 6  # persistent saves 5, 8; local 2, 4, 6; killed after 6
BUCKET = "maxpar-test"


def kill_rank_1_after_local_save(step_to_kill: int) -> None:
    """Make rank 1 SIGKILL itself once both processes' local saves of `step_to_kill`, and the persistent save before
    it, are complete."""
    from jax.experimental import multihost_utils
    save_local, save = local_checkpoint.save_local, checkpoint.Saver.save
    savers = []

    def persistent(self, *args, **kwargs):
        savers.append(self)
        return save(self, *args, **kwargs)

    def saving(manager, step, *args):
        save_local(manager, step, *args)
        if step == step_to_kill:
            manager.wait_until_finished()
            savers[-1].manager.wait_until_finished()
            multihost_utils.sync_global_devices("maxpar test: both local saves are complete")
            if jax.process_index() == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.Saver.save, local_checkpoint.save_local = persistent, saving


def worker(spec_path: str) -> int:
    """One process of a launched job: `maxpar.train.main` for each run of the spec, in order."""
    for run in json.loads(Path(spec_path).read_text()):
        if run.get("kill_after"):
            kill_rank_1_after_local_save(run["kill_after"])
        code = train_module.main(run["argv"])
        if code:
            return code
    return 0


def launch(root: Path, name: str, runs: list[dict], env: dict[str, str]) -> subprocess.CompletedProcess:
    (root / f"{name}.json").write_text(json.dumps(runs))
    return subprocess.run([sys.executable, "-m", "launch.local", "--num_processes", "2", "--devices_per_process", "1",
                           "--grace_s", "2", "--timeout_s", "280", "--module", "tests.test_checkpoint_local", "--",
                           str(root / f"{name}.json")], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The uninterrupted run and the killed run in one launch; then, in a second launch, the killed run resumed and
    a copy of it whose process 1 lost its local tier resumed. Run outputs and the persistent tier in the bucket."""
    root = tmp_path_factory.mktemp("local_tier")
    corpus = write_corpus(root / "corpus")
    with emulator(BUCKET, root / "emulator.log") as url, pytest.MonkeyPatch.context() as monkeypatch:
        for key, value in {storage.EMULATOR: url, **storage.emulator_environment({storage.EMULATOR: url})}.items():
            monkeypatch.setenv(key, value)  # this process's gcsfs client, as the launched processes derive it
        env = process_env(url, compilation_cache_env(root / "jax_cache"))
        fs = filesystem(url)
        argv = [str(REPO / "configs" / "base.yml"), *MICRO, "dataset_type=text", f"dataset_path={corpus}",
                "per_device_batch_size=1", f"steps={STEPS}", "enable_checkpointing=true", "dcn_data_parallelism=1",
                "dcn_fsdp_parallelism=2", f"checkpoint_period={PERSISTENT}", f"local_checkpoint_period={LOCAL}",
                f"base_output_directory=gs://{BUCKET}/out", f"local_checkpoint_directory={root / 'local'}"]
        first = launch(root, "first", [{"argv": [*argv, "run_name=reference"]},
                                       {"argv": [*argv, "run_name=killed"], "kill_after": KILL_AFTER}], env)
        output = first.stdout + first.stderr
        assert "rank 1 was killed by signal 9" in output, output[-4000:]
        persistent = {name: sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/out/{name}/checkpoints"))
                      for name in ("reference", "killed")}
        marked = fs.exists(f"{BUCKET}/out/killed/checkpoints/{PERSISTENT}/commit_success.txt")  # gs://'s marker
        killed_at = max(row["step"] for row in rows(fs, "killed"))
        # The same state, but process 1's node-local disk is lost.
        fs.copy(f"{BUCKET}/out/killed", f"{BUCKET}/out/lost_disk", recursive=True)
        shutil.copytree(root / "local" / "killed", root / "local" / "lost_disk")
        shutil.rmtree(root / "local" / "lost_disk" / "process_1-of-2")

        second = launch(root, "second", [{"argv": [*argv, "run_name=killed"]}, {"argv": [*argv, "run_name=lost_disk"]}],
                        env)
        output = second.stdout + second.stderr
        assert second.returncode == 0, output[-4000:]
        losses = {name: [(row["step"], row["loss"], row["grad_norm"]) for row in rows(fs, name)]
                  for name in ("reference", "killed", "lost_disk")}
        persistent["resumed"] = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/out/killed/checkpoints"))
    return SimpleNamespace(root=root, killed_at=killed_at, output=output, losses=losses, persistent=persistent,
                           marked=marked)


def rows(fs, run_name: str) -> list[dict]:
    return [json.loads(line) for line in fs.cat(f"{BUCKET}/out/{run_name}/metrics.jsonl").decode().splitlines()]


def test_a_killed_process_resumes_from_the_local_tier_bitwise(job):
    resumed = re.findall(r"resumed from checkpoint at step (\d+) \((\w+) tier", job.output)
    assert resumed[0] == (str(KILL_AFTER), "local"), job.output[-4000:]
    assert job.killed_at - KILL_AFTER <= LOCAL and KILL_AFTER > PERSISTENT
    assert [step for step, _, _ in job.losses["reference"]] == list(range(1, STEPS + 1))
    assert job.losses["killed"] == job.losses["reference"]  # bitwise: floats from JSON
    kept = sorted(int(p.name) for p in (job.root / "local" / "killed" / "process_0-of-2").iterdir())
    assert kept == [4, 6]  # the newest few local steps; the last step went to the persistent tier


def test_the_killed_job_left_only_complete_checkpoints_in_the_bucket(job):
    assert job.persistent["reference"] == [str(PERSISTENT), str(STEPS)]
    assert job.persistent["killed"] == [str(PERSISTENT)] and job.marked, job.persistent
    assert job.persistent["resumed"] == [str(PERSISTENT), str(STEPS)]


def test_a_process_that_lost_its_local_tier_resumes_everyone_from_the_persistent_tier(job):
    resumed = re.findall(r"resumed from checkpoint at step (\d+) \((\w+) tier", job.output)
    assert resumed[1] == (str(PERSISTENT), "persistent"), job.output[-4000:]
    assert f"local checkpoint step {KILL_AFTER} is not on every process" in job.output
    assert job.losses["lost_disk"] == job.losses["reference"]


def test_a_local_tier_of_another_mesh_is_not_used(tmp_path):
    """Saved by FSDP(8), resumed by FSDP(4)xTP(2): the local blocks are not the ones needed, so the persistent
    tier is used, with one notice."""
    def run_of(*overrides):
        config = micro_config("enable_checkpointing=true", f"local_checkpoint_directory={tmp_path / 'local'}",
                             f"base_output_directory={tmp_path}", "run_name=run", *overrides)
        return config, setup_run(config)

    config, run = run_of()
    state, iterator = create_state(run.model, run.tx, run.layout, run.mesh), iter(run.train_data)
    persistent = checkpoint.make_manager(tmp_path / "run", config)
    local = local_checkpoint.make_local_manager("run", config)
    checkpoint.save(persistent, 1, state, iterator, config, run.shape.global_rows)
    local_checkpoint.save_local(local, 2, state, iterator, config, run.shape.global_rows)
    for manager in (persistent, local):
        manager.wait_until_finished()
    found = local_checkpoint.resume_tiers(persistent, local, run.restore_target(), iter(run.train_data), print)
    assert int(found[0].step) == 2 and found[1].startswith("local tier")  # the same mesh reads it back
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), found[0].params, state.params))

    config, run = run_of("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    warnings: list[str] = []
    target = run.restore_target()
    found = local_checkpoint.resume_tiers(persistent, local, target, iter(run.train_data), warnings.append)
    assert int(found[0].step) == 1 and found[1].startswith("persistent tier")
    assert len(warnings) == 1 and "written under another mesh, process count or state layout" in warnings[0]
    assert sorted(int(p.name) for p in local.directory.iterdir()) == []  # another timeline's newer steps: dropped
    for manager in (persistent, local):
        manager.close()


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1]))
