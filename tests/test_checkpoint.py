"""Checkpoints in process: canonical layout, resharding, corruption fallback, compatibility, load paths, NaN stop.

The kill -9 / SIGTERM cases need real processes: tests/test_checkpoint_preemption.py.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import MICRO, read_metrics, micro_config, write_corpus
from maxpar.core.config import ConfigError, model_config
from maxpar.io import checkpoint
from maxpar.io.data.pipeline import make_datasets
from maxpar.io.metrics import rewind_metrics
from maxpar.model import stack
from maxpar.train import initial_state, main, setup_run, train
from maxpar.training.guards import first_nonfinite

# Orbax leaves its read coroutines unawaited when a damaged checkpoint fails to restore (on purpose, here).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

# Every mesh trains on the same 8-row global batch, so losses are comparable.
MESHES = {
    "fsdp8": ((), 8),
    "fsdp4_tp2": (("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"), 8),
    "dp2_fsdp4": (("ici_data_parallelism=2", "ici_fsdp_parallelism=4"), 8),
    "one": (("per_device_batch_size=8",), 1),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def run_overrides(corpus) -> list[str]:
    return ["dataset_type=text", f"dataset_path={corpus}", "per_device_batch_size=1", "steps=4", "checkpoint_period=2",
            "enable_checkpointing=true", "max_checkpoints_to_keep=0"]


def run_config(corpus, *overrides):
    return micro_config(*run_overrides(corpus), *overrides)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, corpus) -> Path:
    """An FSDP(8) run of 4 steps with checkpoints at steps 2 and 4. Tests copy it before changing anything."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    train(run_config(corpus), devices=jax.devices(), run_dir=run_dir)
    return run_dir


def copy_run(saved_run: Path, destination: Path, steps=None) -> Path:
    """The saved run's checkpoints (only `steps`, if given) in a new run directory, without its metrics."""
    for step_dir in (saved_run / "checkpoints").iterdir():
        if step_dir.name.isdigit() and (steps is None or int(step_dir.name) in steps):
            shutil.copytree(step_dir, destination / "checkpoints" / step_dir.name)
    return destination


def restore(run_dir: Path, config, devices, step=None):
    """(run, state, data iterator, warnings): the newest usable checkpoint (or `step`) restored onto `devices`."""
    run = setup_run(config, devices)
    iterator = iter(run.train_data)
    target = run.restore_target()
    manager = checkpoint.make_manager(run_dir, config)
    warnings: list[str] = []
    try:
        if step is None:
            state = checkpoint.resume(manager, target, iterator, warnings.append)
        else:
            state = checkpoint.resume_step(manager, step, target, iterator)
    finally:
        manager.close()
    return run, state, iterator, warnings


def max_difference(a, b) -> float:
    diffs = jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)), initial=0)),
                                         a, b))
    return max(diffs, default=0.0)


def assert_batches_equal(a, b):
    for _ in range(2):
        x, y = next(a), next(b)
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])


def losses(run_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(run_dir)]


# ---------------------------------------------------------------- pure pieces

def test_unrolled_layers_stack_into_the_canonical_layout_and_back():
    unrolled = {"decoder": {"layers_0": {"w": np.zeros((2, 3))}, "layers_1": {"w": np.ones((2, 3))}},
                "final": np.ones(3)}
    config = model_config(micro_config("scan_layers=false"))  # 2 layers
    canonical = stack.to_canonical(unrolled, config, stack=np.stack)
    assert set(canonical["decoder"]) == {"layers"}
    np.testing.assert_array_equal(canonical["decoder"]["layers"]["w"], np.stack([np.zeros((2, 3)), np.ones((2, 3))]))
    jax.tree.map(np.testing.assert_array_equal, stack.from_canonical(canonical, config), unrolled)
    jax.tree.map(np.testing.assert_array_equal, stack.to_canonical(canonical, config, stack=np.stack), canonical)
    with pytest.raises(ValueError, match="numbered"):
        stack.to_canonical({"layers_0": 1, "layers_2": 2}, config, stack=np.stack)


def test_scan_and_unrolled_models_have_one_on_disk_layout(corpus):
    scanned = setup_run(run_config(corpus), jax.devices())
    unrolled = setup_run(run_config(corpus, "scan_layers=false"), jax.devices())
    for item in checkpoint.ARRAY_ITEMS:
        scanned_target, unrolled_target = scanned.restore_target(), unrolled.restore_target()
        assert checkpoint.structure_differences(unrolled_target.on_disk(item), scanned_target.on_disk(item)) == []


def test_config_differences_name_each_key_with_both_values(corpus):
    config = run_config(corpus, "emb_dim=32", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    saved = {**run_config(corpus).to_dict(), "vocab_size": 300}
    assert checkpoint.config_differences(saved, config, checkpoint.MODEL_KEYS) == [
        ("emb_dim", 64, 32), ("vocab_size", 300, 264)]
    with pytest.raises(checkpoint.IncompatibleCheckpoint, match=r"emb_dim: 64 in the checkpoint, 32 now"):
        checkpoint.check_config(saved, config, checkpoint.MODEL_KEYS, "here", "advice")


def test_rewind_metrics_drops_rows_after_the_restored_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    assert rewind_metrics(path, 2) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert rewind_metrics(path, 2) == 0
    assert rewind_metrics(tmp_path / "absent.jsonl", 0) == 0


def test_first_nonfinite_finds_the_first_bad_step():
    assert first_nonfinite([(1, np.float32(2.0)), (2, np.float32(1.0))]) is None
    step, value = first_nonfinite([(1, np.float32(2.0)), (2, np.float32(np.inf)), (3, np.float32(np.nan))])
    assert (step, value) == (2, np.inf)


def test_load_path_keys_are_validated(tmp_path):
    with pytest.raises(ConfigError, match="set at most one"):
        micro_config("load_parameters_path=a", "load_full_state_path=b")
    with pytest.raises(ConfigError, match=r"load_parameters_path='.*nothing': no checkpoint there"):
        checkpoint.resolve_source("load_parameters_path", str(tmp_path / "nothing"))


# ---------------------------------------------------------------- restore onto another mesh

def test_restored_state_is_identical_on_every_mesh_with_the_target_shardings(saved_run, corpus):
    reference = None
    for name, (overrides, num_devices) in MESHES.items():
        run, state, _, warnings = restore(saved_run, run_config(corpus, *overrides), jax.devices()[:num_devices],
                                          step=2)
        assert warnings == [] and int(state.step) == 2
        for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(run.state_shardings)):
            assert leaf.sharding == sharding, name  # from the restoring run's mesh, not the checkpoint's
        host = jax.tree.map(np.asarray, state)
        reference = host if reference is None else reference
        assert max_difference(host, reference) == 0.0, name


# Onto every mesh the restored state is the same: the test above. A resumed run trains on where the saved one left
# off on another split of the same devices and on one device (data parallelism's steps: test_equivalence.py's
# dp2_fsdp2_tp2).
@pytest.mark.parametrize("mesh", ["fsdp4_tp2", "one"])
def test_resharded_resume_continues_the_fsdp8_run(saved_run, corpus, tmp_path, mesh):
    overrides, num_devices = MESHES[mesh]
    run_dir = copy_run(saved_run, tmp_path / "run", steps={2})
    train(run_config(corpus, *overrides), devices=jax.devices()[:num_devices], run_dir=run_dir)
    assert [row["step"] for row in read_metrics(run_dir)] == [3, 4]
    np.testing.assert_allclose(losses(run_dir), losses(saved_run)[2:], rtol=1e-5)


def test_unrolled_run_resumes_a_scanned_checkpoint_and_saves_the_same_layout(saved_run, corpus, tmp_path):
    run_dir = copy_run(saved_run, tmp_path / "run", steps={2})
    train(run_config(corpus, "scan_layers=false"), devices=jax.devices(), run_dir=run_dir)
    np.testing.assert_allclose(losses(run_dir), losses(saved_run)[2:], rtol=1e-5)
    # Its step-4 checkpoint is canonical: it has the scanned run's tree, and restores into either layout.
    ours, theirs = (checkpoint.make_manager(directory, run_config(corpus)) for directory in (run_dir, saved_run))
    for item in checkpoint.ARRAY_ITEMS:
        assert checkpoint.structure_differences(ours.item_metadata(4)[item], theirs.item_metadata(4)[item]) == []
    ours.close(), theirs.close()
    _, scanned, _, _ = restore(run_dir, run_config(corpus), jax.devices(), step=4)
    _, unrolled, _, _ = restore(run_dir, run_config(corpus, "scan_layers=false"), jax.devices(), step=4)
    for i in range(2):
        layer = jax.tree.map(lambda x, i=i: np.asarray(x)[i], scanned.params["decoder"]["layers"])
        assert max_difference(layer, unrolled.params["decoder"][f"layers_{i}"]) == 0.0


# ---------------------------------------------------------------- damaged and interrupted checkpoints

def damage(step_dir: Path, kind: str) -> None:
    """Damage one item of a step directory the way a crash, a full disk or a bad copy leaves it."""
    if kind.endswith(" array file"):  # e.g. "truncated opt_state array file": that item's largest array file
        how, item = kind.split()[:2]
        arrays = sorted((step_dir / item).rglob("d/*"), key=lambda p: p.stat().st_size)
        if how == "truncated":
            data = arrays[-1].read_bytes()
            arrays[-1].write_bytes(data[: len(data) // 2])
        else:
            arrays[-1].unlink()
    elif kind == "missing data file":
        (step_dir / "data" / "process_0-of-1.json").unlink()
    elif kind == "garbled data file":
        (step_dir / "data" / "process_0-of-1.json").write_text("{not json")
    elif kind == "truncated config":
        path = step_dir / "config" / "metadata"
        path.write_text(path.read_text()[:100])
    elif kind.startswith("missing ") and kind.endswith(" directory"):
        shutil.rmtree(step_dir / kind.split()[1])
    elif kind.startswith("partial ") and kind.endswith(" metadata"):  # lists only some arrays, each intact
        path = step_dir / kind.split()[1] / "_METADATA"
        metadata = json.loads(path.read_text())
        arrays = sorted(metadata["tree_metadata"])
        metadata["tree_metadata"] = {name: metadata["tree_metadata"][name] for name in arrays[: len(arrays) // 2]}
        path.write_text(json.dumps(metadata))
    elif kind.endswith(" metadata"):
        how, item, _ = kind.split()
        path = step_dir / item / ("_METADATA" if item in checkpoint.ARRAY_ITEMS else "metadata")
        path.unlink() if how == "missing" else path.write_bytes(b"\x00{[")
    else:
        raise ValueError(kind)


DAMAGE = [*(f"{how} {item} array file" for item in checkpoint.ARRAY_ITEMS for how in ("truncated", "missing")),
          "missing data file", "garbled data file", "truncated config",
          *(f"missing {item} directory" for item in ("params", "opt_state", "meta", "data", "config")),
          *(f"missing {item} metadata" for item in ("params", "opt_state", "meta", "config")),
          *(f"garbled {item} metadata" for item in ("params", "opt_state", "meta")),
          "partial params metadata"]
# What the warning must name where the kind alone could fail for an unrelated reason.
DAMAGE_NAMED = {"partial params metadata": "params/_METADATA lists only ",
                "truncated opt_state array file": "opt_state/", "missing opt_state array file": "opt_state/"}


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(saved_run, corpus, tmp_path, kind):
    run_dir = copy_run(saved_run, tmp_path / "run")
    damage(run_dir / "checkpoints" / "4", kind)
    _, state, iterator, warnings = restore(run_dir, run_config(corpus), jax.devices())
    assert int(state.step) == 2
    assert "checkpoint step 4" in warnings[0] and "unusable (" in warnings[0]
    assert "falling back to step 2" in warnings[0]
    assert DAMAGE_NAMED.get(kind, "") in warnings[0]
    _, clean, clean_iterator, _ = restore(saved_run, run_config(corpus), jax.devices(), step=2)
    assert max_difference(state, clean) == 0.0
    assert_batches_equal(iterator, clean_iterator)
    # Nothing deleted: the bad step is set aside (so it can be saved again), the good one kept.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name[0].isdigit()) == ["2", "4.unusable"]
    assert "moved unusable checkpoint step 4 aside" in warnings[1]


def test_a_run_resumes_past_a_damaged_newest_checkpoint_and_trains_on(saved_run, corpus, tmp_path, capsys,
                                                                     monkeypatch):
    copy_run(saved_run, tmp_path / "run")
    damage(tmp_path / "run" / "checkpoints" / "4", "truncated params array file")
    # What absl's first record installs in a fresh process: a handler that prints library records on stderr.
    monkeypatch.setattr(logging.root, "handlers", [*logging.root.handlers, logging.StreamHandler(sys.stderr)])
    status = main(["configs/base.yml", *MICRO, *run_overrides(corpus), f"base_output_directory={tmp_path}",
                   "run_name=run"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "checkpoint step 4" in err and "is unusable (" in err and "falling back to step 2" in err
    assert (tmp_path / "run" / "checkpoints" / "4.unusable").is_dir() and (tmp_path / "run" / "checkpoints" / "4").is_dir()
    # The terminal has maxpar's lines only; the libraries' records are in the file the header names.
    library_log = tmp_path / "run" / "libraries.log"
    assert f"library logs (absl, Orbax, JAX): {library_log}" in out
    assert "Traceback" not in err and not [line for line in err.splitlines() if not line.startswith("maxpar: ")], err
    assert f"Restoring checkpoint from {tmp_path / 'run' / 'checkpoints' / '4'}" in library_log.read_text()  # Orbax's


def test_no_readable_checkpoint_is_an_error_and_deletes_nothing(saved_run, corpus, tmp_path):
    run_dir = copy_run(saved_run, tmp_path / "run")
    damage(run_dir / "checkpoints" / "4", "missing params array file")
    damage(run_dir / "checkpoints" / "2", "truncated params array file")
    with pytest.raises(checkpoint.CheckpointError, match=r"no usable checkpoint .*step 4: .*step 2: "):
        restore(run_dir, run_config(corpus), jax.devices())
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name[0].isdigit()) == ["2", "4"]


def test_leftovers_of_interrupted_saves_are_never_restored(saved_run, corpus, tmp_path):
    run_dir = copy_run(saved_run, tmp_path / "run")
    # What Orbax leaves when a save is killed: a temporary directory that was never renamed.
    temporary = run_dir / "checkpoints" / "6.orbax-checkpoint-tmp-1700000000"
    shutil.copytree(run_dir / "checkpoints" / "4", temporary)
    # What a filesystem without atomic rename could leave: a step directory with items missing.
    partial = run_dir / "checkpoints" / "8"
    shutil.copytree(run_dir / "checkpoints" / "4" / "params", partial / "params")
    _, state, _, warnings = restore(run_dir, run_config(corpus), jax.devices())
    assert int(state.step) == 4
    assert len(warnings) == 2 and "checkpoint step 8" in warnings[0] and "falling back to step 4" in warnings[0]
    assert not temporary.exists()  # removed on start: it never held a complete checkpoint


# ---------------------------------------------------------------- compatibility

def test_resume_with_another_model_shape_is_refused_before_training(saved_run, corpus, tmp_path, capsys):
    run_dir = copy_run(saved_run, tmp_path / "run")
    with pytest.raises(checkpoint.IncompatibleCheckpoint) as info:
        train(run_config(corpus, "emb_dim=32", "num_decoder_layers=3"), devices=jax.devices(), run_dir=run_dir)
    message = str(info.value)
    assert "emb_dim: 64 in the checkpoint, 32 now" in message
    assert "num_decoder_layers: 2 in the checkpoint, 3 now" in message
    assert not (run_dir / "metrics.jsonl").exists()
    # From the command line: a config error, exit status 2, no traceback.
    status = main(["configs/base.yml", *MICRO, *run_overrides(corpus), "vocab_size=300",
                   f"base_output_directory={tmp_path}", "run_name=run"])
    assert status == 2
    assert "vocab_size: 264 in the checkpoint, 300 now" in capsys.readouterr().err


def test_an_intact_optimizer_state_of_other_settings_is_refused_not_set_aside(saved_run, corpus, tmp_path):
    run_dir = copy_run(saved_run, tmp_path / "run")
    with pytest.raises(checkpoint.IncompatibleCheckpoint, match=r"its opt_state arrays differ from this config's"):
        restore(run_dir, run_config(corpus, "gradient_clipping_threshold=0"), jax.devices())
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2", "4"]


def test_resume_with_another_global_batch_is_refused(saved_run, corpus, tmp_path):
    run_dir = copy_run(saved_run, tmp_path / "run")
    with pytest.raises(checkpoint.IncompatibleCheckpoint, match=r"8 rows per global batch, this run has 16.*"
                                                              r"per_device_batch_size=1"):
        restore(run_dir, run_config(corpus, "per_device_batch_size=2"), jax.devices())


def test_data_state_saved_by_two_processes_restores_in_one(saved_run, corpus, tmp_path):
    config = run_config(corpus)
    run_dir = copy_run(saved_run, tmp_path / "run", steps={2})
    data_dir = run_dir / "checkpoints" / "2" / "data"
    (data_dir / "process_0-of-1.json").unlink()
    for index in range(2):  # what two processes of the same run would have written after 2 steps
        iterator = iter(make_datasets(config, global_rows=8, eval_rows=8, shard_index=index, shard_count=2)[0])
        next(iterator), next(iterator)
        (data_dir / f"process_{index}-of-2.json").write_text(json.dumps(iterator.get_state()))
    _, _, resumed, warnings = restore(run_dir, config, jax.devices())
    _, _, clean, _ = restore(saved_run, config, jax.devices(), step=2)
    assert warnings == []
    assert_batches_equal(resumed, clean)


# ---------------------------------------------------------------- starting a new run from another run

def start(config):
    run = setup_run(config, jax.devices())
    iterator = iter(run.train_data)
    return initial_state(run, None, iterator, lambda _: None), iterator, run


def test_load_full_state_path_takes_state_and_step_but_not_the_data_position(saved_run, corpus):
    config = run_config(corpus, "enable_checkpointing=false", f"load_full_state_path={saved_run}/checkpoints/2")
    state, iterator, run = start(config)
    _, clean, _, _ = restore(saved_run, run_config(corpus), jax.devices(), step=2)
    assert int(state.step) == 2 and max_difference(state, clean) == 0.0
    assert_batches_equal(iterator, iter(run.train_data))


def test_load_parameters_path_takes_only_the_newest_parameters(saved_run, corpus):
    state, _, _ = start(run_config(corpus, "enable_checkpointing=false", f"load_parameters_path={saved_run}"))
    _, clean, _, _ = restore(saved_run, run_config(corpus), jax.devices(), step=4)
    assert int(state.step) == 0
    assert max_difference(state.params, clean.params) == 0.0
    assert all(not np.any(np.asarray(leaf)) for leaf in jax.tree.leaves(state.opt_state))  # fresh AdamW state


def test_load_paths_refuse_another_model_and_yield_to_the_runs_own_checkpoints(saved_run, corpus, tmp_path):
    with pytest.raises(checkpoint.IncompatibleCheckpoint, match="emb_dim: 64 in the checkpoint, 32 now"):
        start(run_config(corpus, "enable_checkpointing=false", "emb_dim=32", f"load_parameters_path={saved_run}"))
    with pytest.raises(ConfigError, match=r"step 3 is not a complete checkpoint; complete steps there: \[2, 4\]"):
        start(run_config(corpus, "enable_checkpointing=false", f"load_full_state_path={saved_run}/checkpoints/3"))
    # A run that has its own checkpoints resumes them; the load path only seeds a run's first start.
    run_dir = copy_run(saved_run, tmp_path / "run", steps={2})
    _, state, _, _ = restore(run_dir, run_config(corpus, f"load_parameters_path={saved_run}"), jax.devices())
    assert int(state.step) == 2


# ---------------------------------------------------------------- NaN / Inf loss

def test_nonfinite_loss_stops_at_its_step_and_keeps_the_last_good_checkpoint(corpus, tmp_path):
    exploding = ("learning_rate=1e30", "warmup_steps=0", "checkpoint_period=1", "per_device_batch_size=8")
    devices = jax.devices()[:1]
    train(run_config(corpus, *exploding, "stop_on_nan=false", "enable_checkpointing=false"), devices=devices,
          run_dir=tmp_path / "on")  # only its losses are read
    rows = read_metrics(tmp_path / "on")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # stop_on_nan=false trains on
    bad = next(row["step"] for row in rows if not np.isfinite(row["loss"]) or not np.isfinite(row["grad_norm"]))
    assert bad > 1

    with pytest.raises(FloatingPointError) as info:
        train(run_config(corpus, *exploding), devices=devices, run_dir=tmp_path / "stop")
    assert f"at step {bad};" in str(info.value) and f"step {bad - 1}, is intact" in str(info.value)
    saved = sorted(int(p.name) for p in (tmp_path / "stop" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == list(range(1, bad))
    assert [row["step"] for row in read_metrics(tmp_path / "stop")] == list(range(1, bad))


def test_optimizer_state_restores_cast_into_another_optimizer_state_dtype(saved_run, corpus):
    # Saved with float32 moments; restored into bfloat16 moments (the restore targets carry this run's dtype).
    _, saved, _, _ = restore(saved_run, run_config(corpus), jax.devices(), step=2)
    run, cast, _, warnings = restore(saved_run, run_config(corpus, "optimizer_state_dtype=bfloat16"), jax.devices(),
                                     step=2)
    assert warnings == []
    floats = [leaf for leaf in jax.tree.leaves(cast.opt_state.rule) if jnp.issubdtype(leaf.dtype, jnp.floating)]
    assert floats and {leaf.dtype for leaf in floats} == {jnp.dtype(jnp.bfloat16)}
    expected = jax.tree.map(lambda x, y: np.asarray(x.astype(y.dtype)), saved.opt_state, cast.opt_state)
    assert max_difference(jax.tree.map(np.asarray, cast.opt_state), expected) == 0.0
    assert max_difference(cast.params, saved.params) == 0.0
