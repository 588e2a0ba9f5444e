"""Training through a pipeline: the unpipelined run's per-step losses, the run header, checkpoints across layouts."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import compiled_steps, micro_config, one_device_steps, read_metrics, write_corpus
from maxpar.core.config import model_config
from maxpar.io import checkpoint
from maxpar.model import stack
from maxpar.train import setup_run, train

STEPS = 4
# 2 accumulation microbatches of 16 rows per step everywhere, so every run sees the same batches: the one-device run
# has the program of the one-device steps tests/test_pipeline_1f1b.py compares its schedules with (the session's
# compilation cache holds it once either has compiled it).
ACCUMULATED = ("num_decoder_layers=4", "gradient_accumulation_steps=2")
ONE_DEVICE, EIGHT_DEVICES = ("per_device_batch_size=16",), ("per_device_batch_size=2",)
PIPELINES = {
    "gpipe": ("ici_stage_parallelism=4", "ici_fsdp_parallelism=2", "num_pipeline_microbatches=4",
              "pipeline_fsdp_ag_once=true"),
    "circular": ("ici_stage_parallelism=2", "ici_data_parallelism=2", "ici_fsdp_parallelism=1",
                 "ici_tensor_parallelism=2", "num_pipeline_repeats=2", "num_pipeline_microbatches=4"),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def config_for(corpus: str, *overrides: str):
    return micro_config(*ACCUMULATED, f"steps={STEPS}", "dataset_type=text", f"dataset_path={corpus}",
                       "eval_fraction=0", "enable_checkpointing=true", f"checkpoint_period={STEPS}", *overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> dict[str, tuple[Path, str]]:
    """Run directory and terminal output of the one-device reference and of each pipelined run."""
    import contextlib
    import io
    out = {}
    for name, devices, overrides in [("reference", jax.devices()[:1], ONE_DEVICE),
                                     *((n, jax.devices(), (*EIGHT_DEVICES, *o)) for n, o in PIPELINES.items())]:
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


# The MaxText guide's mode 2: the stage weights gathered once per repeat (a window of M iterations). Its losses need
# no run of the trainer's loop (the two runs above show that loop pipelined): 4 compiled steps against the one-device
# steps tests/test_pipeline_1f1b.py compares its schedules with.
FSDP_PER_REPEAT = ("ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_repeats=2",
                   "num_pipeline_microbatches=2", "pipeline_fsdp_ag_per_repeat=true")


def test_circular_with_stage_weights_gathered_per_repeat_has_the_unpipelined_losses():
    want = one_device_steps(STEPS, *ACCUMULATED, *ONE_DEVICE).metrics
    got = compiled_steps(jax.devices(), STEPS, *ACCUMULATED, *EIGHT_DEVICES, *FSDP_PER_REPEAT).metrics
    assert want["loss"][-1] < want["loss"][0]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)


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
    options = {"reference": (jax.devices()[:1], ONE_DEVICE),
               **{n: (jax.devices(), (*EIGHT_DEVICES, *o))
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
