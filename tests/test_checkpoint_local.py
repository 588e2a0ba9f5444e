"""The local checkpoint tier: a 2-process job (state split over the processes) killed with SIGKILL after a local
save newer than the persistent tier resumes from the local tier bitwise; with one process's local tier gone it
resumes from the persistent tier; a local tier written under another mesh is not used.

The launched processes run this file as their module (`worker`): both runs of a launch in the same processes."""

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

from helpers import REPO, TINY, compilation_cache_env, read_metrics, tiny_config, write_corpus  # noqa: E402
from maxpar import train as train_module  # noqa: E402
from maxpar.io import checkpoint, local_checkpoint  # noqa: E402
from maxpar.train import setup_run  # noqa: E402
from maxpar.training.train_step import create_state  # noqa: E402

STEPS, PERSISTENT, LOCAL, KILL_AFTER = 8, 5, 2, 6  # persistent saves 5, 8; local 2, 4, 6; killed after 6


def kill_rank_1_after_local_save(step_to_kill: int) -> None:
    """Make rank 1 SIGKILL itself once both processes' local saves of `step_to_kill` are complete."""
    from jax.experimental import multihost_utils
    save_local = local_checkpoint.save_local

    def saving(manager, step, *args):
        save_local(manager, step, *args)
        if step == step_to_kill:
            manager.wait_until_finished()
            multihost_utils.sync_global_devices("maxpar test: both local saves are complete")
            if jax.process_index() == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    local_checkpoint.save_local = saving


def worker(spec_path: str) -> int:
    """One process of a launched job: `maxpar.train.main` for each run of the spec, in order."""
    for run in json.loads(Path(spec_path).read_text()):
        if run.get("kill_after"):
            kill_rank_1_after_local_save(run["kill_after"])
        code = train_module.main(run["argv"])
        if code:
            return code
    return 0


def launch(root: Path, name: str, runs: list[dict]) -> subprocess.CompletedProcess:
    (root / f"{name}.json").write_text(json.dumps(runs))
    return subprocess.run([sys.executable, "-m", "launch.local", "--num_processes", "2", "--devices_per_process", "1",
                           "--grace_s", "2", "--timeout_s", "280", "--module", "tests.test_checkpoint_local", "--",
                           str(root / f"{name}.json")], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=compilation_cache_env(root / "jax_cache"))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The uninterrupted run and the killed run in one launch; then, in a second launch, the killed run resumed and
    a copy of it whose process 1 lost its local tier resumed."""
    root = tmp_path_factory.mktemp("local_tier")
    corpus = write_corpus(root / "corpus")
    argv = [str(REPO / "configs" / "base.yml"), *TINY, "dataset_type=text", f"dataset_path={corpus}",
            "per_device_batch_size=1", f"steps={STEPS}", "enable_checkpointing=true", "dcn_data_parallelism=1",
            "dcn_fsdp_parallelism=2", f"checkpoint_period={PERSISTENT}", f"local_checkpoint_period={LOCAL}",
            f"base_output_directory={root / 'out'}", f"local_checkpoint_directory={root / 'local'}"]
    first = launch(root, "first", [{"argv": [*argv, "run_name=reference"]},
                                   {"argv": [*argv, "run_name=killed"], "kill_after": KILL_AFTER}])
    assert "rank 1 was killed by signal 9" in first.stdout + first.stderr, (first.stdout + first.stderr)[-4000:]
    killed_at = max(row["step"] for row in read_metrics(root / "out" / "killed"))
    for tree in ("out", "local"):  # the same state, but process 1's node-local disk is lost
        shutil.copytree(root / tree / "killed", root / tree / "lost_disk")
    shutil.rmtree(root / "local" / "lost_disk" / "process_1-of-2")

    second = launch(root, "second", [{"argv": [*argv, "run_name=killed"]}, {"argv": [*argv, "run_name=lost_disk"]}])
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-4000:]
    return SimpleNamespace(root=root, killed_at=killed_at, output=output)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(row["step"], row["loss"]) for row in read_metrics(run_dir)]


def test_a_killed_process_resumes_from_the_local_tier_bitwise(job):
    resumed = re.findall(r"resumed from checkpoint at step (\d+) \((\w+) tier", job.output)
    assert resumed[0] == (str(KILL_AFTER), "local"), job.output[-4000:]
    assert job.killed_at - KILL_AFTER <= LOCAL and KILL_AFTER > PERSISTENT
    assert losses(job.root / "out" / "killed") == losses(job.root / "out" / "reference")
    kept = sorted(int(p.name) for p in (job.root / "local" / "killed" / "process_0-of-2").iterdir())
    assert kept == [4, 6]  # the newest few local steps; the last step went to the persistent tier


def test_a_process_that_lost_its_local_tier_resumes_everyone_from_the_persistent_tier(job):
    resumed = re.findall(r"resumed from checkpoint at step (\d+) \((\w+) tier", job.output)
    assert resumed[1] == (str(PERSISTENT), "persistent"), job.output[-4000:]
    assert f"local checkpoint step {KILL_AFTER} is not on every process" in job.output
    assert losses(job.root / "out" / "lost_disk") == losses(job.root / "out" / "reference")


def test_a_local_tier_of_another_mesh_is_not_used(tmp_path):
    """Saved by FSDP(8), resumed by FSDP(4)xTP(2): the local blocks are not the ones needed, so the persistent
    tier is used, with one notice."""
    def run_of(*overrides):
        config = tiny_config("enable_checkpointing=true", f"local_checkpoint_directory={tmp_path / 'local'}",
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
