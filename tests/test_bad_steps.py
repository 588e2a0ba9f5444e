"""Bad steps: a NaN/Inf loss or gradient norm, or a loss spike, is judged inside the step and its update not applied,
so no checkpoint ever holds it; a skipped step leaves the state bitwise as it was; the guard's running statistics
resume exactly (issue 43 item 1, issue 49 item 4)."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import layout_on, packed_batch, read_metrics, micro_config, write_corpus
from maxpar.core.config import model_config
from maxpar.io import checkpoint
from maxpar.model import Transformer
from maxpar.train import setup_run, train
from maxpar.training.guards import StepGuard
from maxpar.training.optimizer import make_optimizer
from maxpar.training.train_step import create_state, jit_train_step


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def run_config(corpus, *overrides):
    return micro_config("dataset_type=text", f"dataset_path={corpus}", "per_device_batch_size=8",
                       "enable_checkpointing=true", "max_checkpoints_to_keep=0", *overrides)


def restored(run_dir, config, step=None):
    """The newest checkpoint of `run_dir` (or `step`) as `config`'s run restores it."""
    run = setup_run(config, jax.devices()[:1])
    manager = checkpoint.make_manager(run_dir, config)
    try:
        iterator = iter(run.train_data)
        if step is None:
            return checkpoint.resume(manager, run.restore_target(), iterator, lambda _: None)
        return checkpoint.resume_step(manager, step, run.restore_target(), iterator)
    finally:
        manager.close()


def all_finite(tree) -> bool:
    return all(bool(np.all(np.isfinite(np.asarray(leaf)))) for leaf in jax.tree.leaves(tree)
               if jnp.issubdtype(leaf.dtype, jnp.floating))


def test_a_blow_up_never_reaches_a_checkpoint_and_the_rerun_resumes_from_finite_numbers(corpus, tmp_path):
    """learning_rate=1e4 (a user's blow-up): the gradient norm turns NaN while the loss is still finite."""
    blow_up = ("learning_rate=1e4", "steps=8", "checkpoint_period=1")
    train(run_config(corpus, *blow_up, "stop_on_nan=false"), devices=jax.devices()[:1], run_dir=tmp_path / "on")
    rows = read_metrics(tmp_path / "on")
    bad = [row["step"] for row in rows if not np.isfinite(row["grad_norm"]) or not np.isfinite(row["loss"])]
    assert bad and rows[-1]["skipped_nonfinite"] == len(bad)  # stop_on_nan=false: skipped, counted, trained on
    assert all_finite(restored(tmp_path / "on", run_config(corpus, *blow_up)).params)

    with pytest.raises(FloatingPointError) as stop:
        train(run_config(corpus, *blow_up), devices=jax.devices()[:1], run_dir=tmp_path / "stop")
    assert f"is nan at step {bad[0]};" in str(stop.value) and f"step {bad[0] - 1}, is intact" in str(stop.value)
    # What the advised rerun does first: restore the newest checkpoint, under a lower learning rate.
    state = restored(tmp_path / "stop", run_config(corpus, "learning_rate=1e-3", "steps=8", "checkpoint_period=1"))
    assert int(state.step) == bad[0] - 1
    assert all_finite(state.params) and all_finite(state.opt_state)


def bits(tree):
    return [np.asarray(leaf).reshape(-1).view(np.uint8) for leaf in jax.tree.leaves(tree)]


def assert_bitwise(got, want):
    for a, b in zip(bits(got), bits(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_skipped_step_leaves_parameters_moments_histories_and_routing_biases_bitwise_alone():
    config = micro_config("num_experts=4", "num_experts_per_tok=2", "routed_bias=true", "quantization=fp8",
                         "fp8_scaling=delayed", "fp8_amax_history_length=2", "skip_step_on_spike_factor=2",
                         "per_device_batch_size=4", "warmup_steps=0")
    devices = jax.devices()[:1]
    layout, mesh = layout_on(config, devices)
    model = Transformer(model_config(config), layout.model)
    tx = make_optimizer(config, layout)
    step = jit_train_step(model, tx, layout, mesh)
    batch = packed_batch(layout.batch.global_rows, config.max_target_length)
    fresh = create_state(model, tx, layout, mesh)
    before = jax.device_get(fresh)
    good, _ = step(fresh, batch)
    after_good = jax.device_get(good)
    moved = [not np.array_equal(a, b) for a, b in zip(bits(before.params), bits(after_good.params))]
    assert all(moved)  # every parameter moves on a good step, the routing biases too
    assert not np.array_equal(bits(before.fp8_meta)[0], bits(after_good.fp8_meta)[0])

    def skipped(state, cause: str):
        held = jax.device_get(state)
        out, metrics = step(state, batch)
        out = jax.device_get(out)
        assert int(out.step) == int(held.step) + 1 and int(metrics[cause]) == int(getattr(held.opt_state.guard,
                                                                                          cause)) + 1
        assert_bitwise(out.params, held.params)
        assert_bitwise(out.opt_state.rule, held.opt_state.rule)
        assert_bitwise(out.fp8_meta, held.fp8_meta)

    # A spike: the guard has seen 100 losses averaging 0.1, this one is ~5.
    guard = StepGuard(loss_sum=jnp.float32(0.1 * (1 - 0.99 ** 100)), losses_seen=jnp.int32(100),
                      skipped_nonfinite=jnp.int32(0), skipped_spikes=jnp.int32(0))
    skipped(good.replace(opt_state=good.opt_state._replace(guard=guard)), "skipped_spikes")
    # A NaN in the output projection: NaN logits, loss and gradients.
    poisoned = jax.tree.map(np.array, jax.device_get(good))
    poisoned.params["output"][0, 0] = np.nan
    skipped(jax.device_put(poisoned, layout.state_shardings(mesh)), "skipped_nonfinite")


def test_the_spike_statistics_resume_exactly(corpus, tmp_path):
    """A run that skips spikes resumed from step 12 logs steps 13-16 exactly as the uninterrupted run: the running
    average came back with the checkpoint (a fresh one would judge no spike before 10 more losses). Factor 0.4:
    from the 11th step on, every loss is over 0.4 x the average of the falling losses before it: skipped."""
    config = run_config(corpus, "steps=16", "checkpoint_period=12", "skip_step_on_spike_factor=0.4")
    train(config, devices=jax.devices()[:1], run_dir=tmp_path / "whole")
    whole = read_metrics(tmp_path / "whole")
    assert whole[-1]["skipped_spikes"] > 0 and whole[11]["skipped_spikes"] < whole[-1]["skipped_spikes"]
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "12", tmp_path / "resumed" / "checkpoints" / "12")
    train(config, devices=jax.devices()[:1], run_dir=tmp_path / "resumed")
    resumed = read_metrics(tmp_path / "resumed")
    keys = ("loss", "grad_norm", "learning_rate", "skipped_spikes", "skipped_nonfinite")
    assert [[row[k] for k in keys] for row in resumed] == [[row[k] for k in keys] for row in whole[12:]]
