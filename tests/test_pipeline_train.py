"""Training through a pipeline: the unpipelined run's per-step losses, the run header, checkpoints across layouts."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import read_metrics, micro_config, write_corpus
from maxpar.core.config import model_config
from maxpar.io import checkpoint
from maxpar.model import stack
from maxpar.train import setup_run, train

STEPS = 5
PIPELINES = {  # 8 rows per step everywhere, so every run sees the same batches
    "gpipe": ("ici_stage_parallelism=4", "ici_fsdp_parallelism=2", "num_pipeline_microbatches=4",
              "pipeline_fsdp_ag_once=true"),
    "circular": ("ici_stage_parallelism=2", "ici_data_parallelism=2", "ici_fsdp_parallelism=1",
                 "ici_tensor_parallelism=2", "num_pipeline_repeats=2", "num_pipeline_microbatches=4"),
    # The MaxText guide's mode 2: the stage weights gathered once per repeat (a window of M iterations).
    "circular_fsdp_per_repeat": ("ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_repeats=2",
                                 "num_pipeline_microbatches=2", "pipeline_fsdp_ag_per_repeat=true"),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def config_for(corpus: str, *overrides: str):
    return micro_config("num_decoder_layers=4", f"steps={STEPS}", "dataset_type=text", f"dataset_path={corpus}",
                       "eval_fraction=0", "enable_checkpointing=true", f"checkpoint_period={STEPS}", *overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> dict[str, tuple[Path, str]]:
    """Run directory and terminal output of the one-device reference and of each pipelined run."""
    import contextlib
    import io
    out = {}
    for name, devices, overrides in [("reference", jax.devices()[:1], ("per_device_batch_size=8",)),
                                     *((n, jax.devices(), ("per_device_batch_size=1", *o)) for n, o in PIPELINES.items())]:
        run_dir = tmp_path_factory.mktemp(name) / "run"
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            train(config_for(corpus, *overrides), devices=devices, run_dir=run_dir)
        out[name] = (run_dir, printed.getvalue())
    return out


def losses(run_dir: Path) -> np.ndarray:
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return np.array([r["loss"] for r in rows])


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipelined_training_has_the_unpipelined_losses(name, runs):
    reference = losses(runs["reference"][0])
    assert reference[-1] < reference[0]
    np.testing.assert_allclose(losses(runs[name][0]), reference, rtol=1e-5)


def test_run_header_prints_schedule_and_bubble(runs):
    printed = runs["circular"][1]
    assert ("circular pipeline: S=2 stages, M=4 microbatches, R=2 repeat(s), 1 layer(s) per block, 9 iterations; "
            "bubble (S-1)/(R*M+S-1) = 1/9 = 11.1%") in printed
    assert "layers per stage: stage 0: 0, 2; stage 1: 1, 3" in printed
    assert "gPipe pipeline: S=4 stages, M=4 microbatches, R=1 repeat(s)" in runs["gpipe"][1]
    assert "pipeline" not in runs["reference"][1]


def restored(run_dir: Path, config, devices) -> tuple[object, object]:
    """(state restored from the run's newest checkpoint into `config`'s layout, that layout's shardings)."""
    run = setup_run(config, devices)
    return checkpoint.load_full_state(str(run_dir), run.restore_target()), run.state_shardings


def canonical(state, config):
    tree = {"params": state.params, "opt_state": state.opt_state}
    return jax.device_get(stack.to_canonical(tree, model_config(config)))


# Layouts only restored into: the explicit-backward schedules keep gPipe's and circular's parameter layouts.
RESTORED_ONLY = {"gpipe_as_zero_bubble": (*PIPELINES["gpipe"], "pipeline_schedule=zero_bubble"),
                 "circular_as_interleaved_1f1b": (*PIPELINES["circular"], "pipeline_schedule=interleaved_1f1b")}


@pytest.mark.parametrize("source,destination", [("reference", "circular"), ("circular", "reference"),
                                                 ("gpipe", "circular"), ("reference", "gpipe_as_zero_bubble"),
                                                 ("gpipe", "circular_as_interleaved_1f1b")])
def test_checkpoints_restore_across_pipeline_layouts(source, destination, runs, corpus):
    """A checkpoint restores into another layout (unpipelined <-> circular <-> gPipe, and under another schedule)
    with equal arrays."""
    options = {"reference": (jax.devices()[:1], ("per_device_batch_size=8",)),
               **{n: (jax.devices(), ("per_device_batch_size=1", *o))
                  for n, o in (PIPELINES | RESTORED_ONLY).items()}}
    (own_devices, own), (devices, other) = options[source], options[destination]
    own_config, other_config = config_for(corpus, *own), config_for(corpus, *other)
    original, _ = restored(runs[source][0], own_config, own_devices)
    moved, shardings = restored(runs[source][0], other_config, devices)
    assert int(moved.step) == STEPS
    gate = moved.params["decoder"]["layers"]["mlp"]["wi_gate"]
    assert gate.sharding == shardings.params["decoder"]["layers"]["mlp"]["wi_gate"]
    if other_config.num_pipeline_repeats > 1:
        assert gate.shape[:2] == (2, 2) and gate.sharding.spec[:2] == (None, "stage")
    jax.tree.map(np.testing.assert_array_equal, canonical(moved, other_config), canonical(original, own_config))
