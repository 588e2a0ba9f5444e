"""Multi-process training on one machine: the environment contract, the hierarchical mesh, loss
equivalence with one process, per-process data reads, checkpoints across process counts, and the fallback from a
checkpoint that only one process finds damaged.

The multi-process part is one 2-process job (`launch.local`) whose processes run this file as their
module (`python -m tests.test_distributed SPEC.json`, see `worker`): they train through
`maxpar.train.main` and report what they read and what their compiled train step communicates.
"""

from __future__ import annotations

import collections
import contextlib
import json
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))  # helpers, also for the launched worker processes

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import maxpar.io.data.text as text_data  # noqa: E402
from helpers import TINY, read_metrics, write_corpus  # noqa: E402
from launch.local import rank_env  # noqa: E402
from maxpar import train as train_module  # noqa: E402
from maxpar.core.config import ConfigError, load_config  # noqa: E402
from maxpar.host.distributed import distributed_spec, env_topology, resplit_iterator_states  # noqa: E402
from maxpar.io.data.pipeline import make_datasets  # noqa: E402
from maxpar.plan.hlo import cross_process_collectives  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BASE = str(REPO / "configs" / "base.yml")


def cfg(*overrides: str):
    return load_config([BASE, *overrides])


# ---------------------------------------------------------------- the environment contract (pure)

def test_no_environment_means_one_process():
    assert distributed_spec(cfg(), {}) is None
    assert distributed_spec(cfg(), {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234"}) is None  # 1 slice x 1 host


def test_gke_tpu_environment():
    env = {"MEGASCALE_COORDINATOR_ADDRESS": "job-slice-0-0.job", "MEGASCALE_NUM_SLICES": "2",
           "MEGASCALE_SLICE_ID": "1", "TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3", "TPU_WORKER_ID": "2"}
    spec = distributed_spec(cfg("distributed_heartbeat_timeout_s=30"), env)
    assert (spec.coordinator_address, spec.num_processes, spec.process_id) == ("job-slice-0-0.job:8482", 8, 6)
    assert spec.heartbeat_timeout_s == 30 and spec.init_timeout_s == 300
    other_port = distributed_spec(cfg(), {**env, "JAX_COORDINATOR_PORT": "9000"})
    assert other_port.coordinator_address == "job-slice-0-0.job:9000"
    # Kubernetes' Indexed-Job index stands in for TPU_WORKER_ID.
    indexed = {k: v for k, v in env.items() if k != "TPU_WORKER_ID"} | {"JOB_COMPLETION_INDEX": "3"}
    assert distributed_spec(cfg(), indexed).process_id == 7


def test_config_keys_override_the_environment():
    env = {"JAX_COORDINATOR_ADDRESS": "a:1", "MEGASCALE_NUM_SLICES": "4", "MEGASCALE_SLICE_ID": "3"}
    spec = distributed_spec(cfg("coordinator_address=b:2", "process_id=1"), env)
    assert (spec.coordinator_address, spec.num_processes, spec.process_id) == ("b:2", 4, 1)
    spec = distributed_spec(cfg("coordinator_address=10.1.1.1:77", "num_processes=2", "process_id=1"), {})
    assert (spec.coordinator_address, spec.num_processes, spec.process_id) == ("10.1.1.1:77", 2, 1)
    auto = distributed_spec(cfg("coordinator_address=auto"), {})
    assert auto.coordinator_address is None and auto.num_processes is None


@pytest.mark.parametrize("overrides, env, message", [
    ((), {"MEGASCALE_NUM_SLICES": "two"}, "MEGASCALE_NUM_SLICES='two': expected an integer >= 1"),
    ((), {"MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "2"},
     "MEGASCALE_SLICE_ID=2: must be < MEGASCALE_NUM_SLICES=2"),
    ((), {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "5"}, "TPU_WORKER_ID=5: must be < the 2 host(s)"),
    ((), {"MEGASCALE_NUM_SLICES": "2"}, "num_processes=2 needs the coordinator's address"),
    (("num_processes=2", "process_id=0", "coordinator_address=nohostport"), {}, "coordinator_address='nohostport'"),
    (("num_processes=2", "process_id=2", "coordinator_address=a:1"), {},
     "process_id=2 must be in [0, num_processes=2)"),
])
def test_bad_distributed_settings_name_the_culprit(overrides, env, message):
    with pytest.raises(ConfigError) as info:
        distributed_spec(cfg(*overrides), env)
    assert message in str(info.value)


def test_bad_keys_are_config_errors():
    with pytest.raises(ConfigError, match="num_processes=0"):
        cfg("num_processes=0")
    with pytest.raises(ConfigError, match="distributed_heartbeat_timeout_s=0"):
        cfg("distributed_heartbeat_timeout_s=0")


def test_launcher_sets_the_same_contract():
    for rank in range(3):
        env = rank_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo", "MEGASCALE_SLICE_ID": "9"},
                       rank, 3, 4, 5555)
        spec = distributed_spec(cfg(), env)
        assert (spec.coordinator_address, spec.num_processes, spec.process_id) == ("127.0.0.1:5555", 3, rank)
        assert env["XLA_FLAGS"].startswith("--xla_foo --xla_force_host_platform_device_count=4 ")
        assert env_topology(env).num_slices == 3  # one host per slice: each process is a DCN granule


# ---------------------------------------------------------------- data state across process counts (pure)

def test_resplit_text_lanes_and_synthetic_steps():
    lanes = [{"lane": j} for j in range(8)]
    two = [{"parents": lanes[:4]}, {"parents": lanes[4:]}]
    one = resplit_iterator_states(two, {"parents": [None] * 8}, 0, 1)
    assert one == {"parents": lanes}
    four = [resplit_iterator_states(two, {"parents": [None] * 2}, i, 4) for i in range(4)]
    assert [s["parents"] for s in four] == [lanes[0:2], lanes[2:4], lanes[4:6], lanes[6:8]]
    assert resplit_iterator_states([{"next_index": 5}] * 2, {"next_index": 0}, 0, 1) == {"next_index": 5}
    with pytest.raises(ConfigError, match="8 lanes .* this run has 4"):
        resplit_iterator_states(two, {"parents": [None] * 2}, 0, 2)
    with pytest.raises(ConfigError, match="cannot be re-split"):
        resplit_iterator_states([{"next_index": 5}, {"next_index": 6}], {"next_index": 0}, 0, 1)


# ---------------------------------------------------------------- the 2-process job

@contextlib.contextmanager
def recorded_reads() -> Iterator[list[str]]:
    """Every document the data pipeline reads meanwhile (observed by wrapping maxpar.io.data.text.read_text)."""
    reads: list[str] = []
    original = text_data.read_text

    def recording(path: str) -> str:
        reads.append(path)
        return original(path)

    text_data.read_text = recording
    try:
        yield reads
    finally:
        text_data.read_text = original


@contextlib.contextmanager
def captured_compiles() -> Iterator[list[tuple[str, object]]]:
    """(HLO text, mesh) of every train step compiled meanwhile."""
    compiled: list[tuple[str, object]] = []
    original = train_module.RunSetup.compile_train_step

    def capturing(self):
        result = original(self)
        compiled.append((result.as_text(), self.mesh))
        return result

    train_module.RunSetup.compile_train_step = capturing
    try:
        yield compiled
    finally:
        train_module.RunSetup.compile_train_step = original


def worker(spec_path: str) -> int:
    """One process of the launched job: run `maxpar.train.main` for each run of the spec and report."""
    import jax

    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        if "damage" in run:
            damage_on_process_1(**run["damage"])
        with recorded_reads() as reads, captured_compiles() as compiled:
            code = train_module.main(run["argv"])
        if code:
            return code
        hlo, mesh = compiled[0]
        report = {"process_index": jax.process_index(), "process_count": jax.process_count(),
                  "local_devices": jax.local_device_count(), "reads": reads,
                  "axis_sizes": dict(mesh.shape), "process_of": [d.process_index for d in mesh.devices.flat]}
        if jax.process_index() == 0:
            report["hlo"] = hlo
        name = f"{run['name']}.rank{jax.process_index()}.json"
        (Path(spec["report_dir"]) / name).write_text(json.dumps(report))
    return 0


def damage_on_process_1(source: str, target: str, missing: str) -> None:
    """Process 0 copies the checkpoints `source` to `target` and deletes `missing` in the copy (a file that only
    process 1 reads); both processes then go on together."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_index() == 0:
        shutil.copytree(source, target)
        (Path(target) / missing).unlink()
    multihost_utils.sync_global_devices("maxpar test: the damaged copy is ready")


def _copy_checkpoint(source: Path, step: int, target: Path) -> None:
    (target / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / str(step), target / "checkpoints" / str(step))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """1 process x 8 devices in this process, 2 processes x 4 devices launched, and the restores across."""
    root = tmp_path_factory.mktemp("multislice")
    corpus = write_corpus(root / "corpus")
    common = [*TINY, "dataset_type=text", f"dataset_path={corpus}", "per_device_batch_size=1", "steps=4",
              "checkpoint_period=2", "max_checkpoints_to_keep=0", "enable_checkpointing=true"]
    one = [BASE, *common, "ici_data_parallelism=2", "ici_fsdp_parallelism=4"]
    two = [BASE, *common, "dcn_data_parallelism=2", "ici_fsdp_parallelism=4"]

    with recorded_reads() as reads_one:
        train_module.train(load_config(one), run_dir=root / "one")
    _copy_checkpoint(root / "one", 2, root / "two_resumed")

    # The first run names no run: the processes must agree on one timestamped directory. The last resumes a copy of
    # the second's checkpoints whose newest step only process 1 finds damaged (its data position file is gone).
    damage = {"source": str(root / "two_resumed" / "checkpoints"), "target": str(root / "damaged" / "checkpoints"),
              "missing": "4/data/process_1-of-2.json"}
    spec = {"report_dir": str(root), "runs": [
        {"name": "two", "argv": [*two, f"base_output_directory={root / 'fresh'}", "run_name="]},
        {"name": "two_resumed", "argv": [*two, f"base_output_directory={root}", "run_name=two_resumed"]},
        {"name": "damaged", "argv": [*two, f"base_output_directory={root}", "run_name=damaged"], "damage": damage}]}
    (root / "spec.json").write_text(json.dumps(spec))
    start = time.perf_counter()
    launched = subprocess.run(
        [sys.executable, "-m", "launch.local", "--num_processes", "2", "--devices_per_process", "4", "--grace_s", "2",
         "--module", "tests.test_distributed", "--timeout_s", "500", "--", str(root / "spec.json")],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    assert launched.returncode == 0, (launched.stdout + launched.stderr)[-6000:]

    runs = list((root / "fresh").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("run_"), f"the processes wrote to {runs}"
    runs[0].rename(root / "two")
    _copy_checkpoint(root / "two", 2, root / "one_resumed")
    train_module.train(load_config(one), run_dir=root / "one_resumed")

    reports = {(name, rank): json.loads((root / f"{name}.rank{rank}.json").read_text())
               for name in ("two", "two_resumed") for rank in range(2)}
    return SimpleNamespace(root=root, one=one, two=two, reads_one=reads_one, reports=reports, output=launched.stdout,
                           errors=launched.stderr, seconds=seconds)


def _losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(run_dir)}


def test_two_processes_match_one_process(job):
    one, two = _losses(job.root / "one"), _losses(job.root / "two")
    assert list(two) == [1, 2, 3, 4]  # one line per step: only process 0 writes metrics
    np.testing.assert_allclose([two[s] for s in two], [one[s] for s in two], rtol=1e-5, atol=0)
    print(f"\n2x4 vs 1x8 per-step losses: max |diff| {max(abs(two[s] - one[s]) for s in two):.2e} "
          f"(launch + 3 runs: {job.seconds:.0f} s)")
    rank1 = [line for line in job.output.splitlines() if line.startswith("[rank 1]")]
    assert not [line for line in rank1 if " step " in line or "maxpar: run" in line], rank1  # process 0 prints
    assert "[Gloo]" not in job.output  # its all-connected lines: dropped by the launcher (log_level=info)
    assert {r["local_devices"] for r in job.reports.values()} == {4}
    assert {r["process_count"] for r in job.reports.values()} == {2}


def test_mesh_is_hierarchical_and_only_data_crosses_processes(job):
    report = job.reports[("two", 0)]
    sizes = report["axis_sizes"]
    assert sizes == {"data": 2, "stage": 1, "fsdp": 4, "context": 1, "expert": 1, "tensor": 1}
    process = np.array(report["process_of"]).reshape(list(sizes.values()))
    for p in range(2):
        assert (process[p] == p).all(), process  # the ICI block at data=p is process p's devices
    crossing = cross_process_collectives(report["hlo"], sizes, report["process_of"])
    labels = collections.Counter(c.axes for c in crossing)
    assert crossing and "data" in labels, labels  # the gradient reduction crosses, over data only
    assert all("data" in c.axes.split("+") for c in crossing), labels
    print(f"\ncross-process collectives by mesh axes: {dict(labels)}; "
          f"bytes per step: { {a: sum(c.operand_bytes * c.count for c in crossing if c.axes == a) for a in labels} }")
    # The check is not vacuous: were the processes split along fsdp instead, fsdp traffic would cross.
    fsdp_split = [(i % 4) // 2 for i in range(8)]
    wrong = cross_process_collectives(report["hlo"], sizes, fsdp_split)
    assert any("data" not in c.axes.split("+") for c in wrong)


def test_each_process_reads_only_its_own_lanes(job):
    rank_reads = [job.reports[("two", p)]["reads"] for p in range(2)]
    # Together they read exactly what one process reads alone: nothing twice, nothing missing ...
    assert collections.Counter(rank_reads[0]) + collections.Counter(rank_reads[1]) == collections.Counter(job.reads_one)
    # ... and each read exactly the documents of its own block of lanes (rows 4p .. 4p+3).
    config = load_config(job.one)
    for p in range(2):
        with recorded_reads() as expected:
            train_data, _ = make_datasets(config, global_rows=8, eval_rows=8, shard_index=p, shard_count=2)
            iterator = iter(train_data)
            for _ in range(4):
                next(iterator)
        assert rank_reads[p] == expected and len(expected) < len(job.reads_one)


def test_checkpoints_restore_across_process_counts(job):
    one, two = _losses(job.root / "one"), _losses(job.root / "two")
    state_dir = job.root / "two" / "checkpoints" / "2"
    assert sorted(p.name for p in (state_dir / "data").glob("*.json")) == ["process_0-of-2.json", "process_1-of-2.json"]
    # Written by 2 processes, resumed by 1 (and the data position re-split onto its 8 lanes) ...
    two_to_one = _losses(job.root / "one_resumed")
    assert list(two_to_one) == [3, 4]
    np.testing.assert_allclose([two_to_one[s] for s in (3, 4)], [two[s] for s in (3, 4)], rtol=1e-5, atol=0)
    # ... and written by 1, resumed by 2.
    one_to_two = _losses(job.root / "two_resumed")
    assert list(one_to_two) == [3, 4]
    np.testing.assert_allclose([one_to_two[s] for s in (3, 4)], [one[s] for s in (3, 4)], rtol=1e-5, atol=0)


def test_a_checkpoint_damaged_on_one_process_falls_back_on_every_process(job):
    """Only process 1 finds the newest step damaged (its data position file is gone) while process 0 reads all of
    it: both must agree, set it aside and resume from the older step, as an undamaged resume from it does. Were
    process 0 to enter Orbax's restore (which ends in a barrier) before they agree, it would wait there while
    process 1 waits in the agreement: Gloo fails or the job hangs."""
    output = job.output + job.errors
    warnings = [line for line in output.splitlines() if "is unusable" in line]
    assert len(warnings) == 1 and "checkpoint step 4" in warnings[0], output[-6000:]  # printed by process 0 ...
    assert "(on process 1: ValueError: data iterator state: " in warnings[0], warnings  # ... naming what 1 found
    assert "falling back to step 2" in warnings[0]
    steps = sorted(p.name for p in (job.root / "damaged" / "checkpoints").iterdir() if p.name[0].isdigit())
    assert steps == ["2", "4", "4.unusable"]
    resumed, undamaged = _losses(job.root / "damaged"), _losses(job.root / "two_resumed")
    assert list(resumed) == [3, 4]
    np.testing.assert_allclose([resumed[s] for s in (3, 4)], [undamaged[s] for s in (3, 4)], rtol=1e-5, atol=0)


def test_the_command_a_two_process_run_prints_samples_in_one_process(job):
    """maxpar.generate joins no job: the command the 2 x 4 run prints folds its DCN degree into one process's 8
    simulated devices, and runs as printed."""
    printed = next(line for line in job.output.splitlines() if "sample from it: " in line and "two_resumed" in line)
    command = shlex.split(printed.split("sample from it: ")[1])
    assert {"ici_data_parallelism=2", "dcn_data_parallelism=1", "num_simulated_devices=8"} <= set(command)
    sampled = subprocess.run([sys.executable, *command[1:]], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert sampled.stdout.startswith("--- prompt: 'def '")


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1]))
