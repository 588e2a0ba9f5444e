"""Pure pieces of the optimizer family: the WSD schedule, the bad-step judgement, Muon against a NumPy reference of
its algorithm, Muon's matrices by parameter role, and the z-loss term."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import micro_config
from maxpar.core.config import WSD_DECAY_STYLES
from maxpar.training.guards import LOSS_AVERAGE_DECAY, SPIKE_MIN_LOSSES, StepGuard, judge_step
from maxpar.training.muon import NS_COEFFICIENTS, NS_STEPS, MatrixView, newton_schulz
from maxpar.training.optimizer import (WSD_DECAY_SHAPES, OptimizerState, learning_rate_schedule, make_optimizer,
                                       muon_labels)
from maxpar.training.train_step import _token_losses, trace_state

# ---------------------------------------------------------------- warmup-stable-decay


def wsd(*overrides: str):
    return learning_rate_schedule(micro_config("lr_schedule_type=wsd", "learning_rate=1e-3", "warmup_steps=10",
                                              "steps=110", "learning_rate_final_fraction=0.1",
                                              "wsd_decay_steps_fraction=0.2", *overrides))


def test_wsd_decay_styles_are_the_configs():
    assert set(WSD_DECAY_SHAPES) == set(WSD_DECAY_STYLES)


@pytest.mark.parametrize("style,at_quarter", [("linear", 0.75), ("cosine", 0.5 * (1 + math.cos(math.pi / 4))),
                                              ("1-sqrt", 0.5)])
def test_wsd_warms_up_holds_the_peak_then_decays_over_the_last_fraction(style, at_quarter):
    schedule = wsd(f"wsd_decay_style={style}")  # decay: the last 22 of 110 steps, from step 88
    assert float(schedule(0)) == 0.0
    assert float(schedule(5)) == pytest.approx(5e-4)
    assert [float(schedule(s)) for s in (10, 50, 88)] == pytest.approx([1e-3] * 3)
    assert float(schedule(88 + 22 / 4)) == pytest.approx(1e-4 + 9e-4 * at_quarter, rel=1e-5)
    assert float(schedule(110)) == pytest.approx(1e-4, rel=1e-5)
    assert float(schedule(200)) == pytest.approx(1e-4, rel=1e-5)  # the final rate after `steps`


def test_wsd_resumed_with_more_steps_stays_at_the_peak_longer():
    short, longer = wsd("steps=110"), wsd("steps=220")
    assert float(short(100)) < 1e-3 and float(longer(100)) == pytest.approx(1e-3)
    assert float(longer(220)) == pytest.approx(1e-4, rel=1e-5)


# ---------------------------------------------------------------- bad steps


def judged(losses, spike_factor=2.0, grad_norm=1.0):
    guard, applied = StepGuard.fresh(), []
    for loss in losses:
        verdict = judge_step(guard, jnp.float32(loss), jnp.float32(grad_norm), spike_factor)
        guard = verdict.guard
        applied.append(bool(verdict.apply))
    return guard, applied


def test_nonfinite_loss_or_gradient_norm_is_not_applied_nor_averaged():
    guard, applied = judged([2.0, math.nan, math.inf, 2.0])
    assert applied == [True, False, False, True]
    assert int(guard.skipped_nonfinite) == 2 and int(guard.losses_seen) == 2
    assert float(guard.loss_average) == pytest.approx(2.0, rel=1e-5)
    verdict = judge_step(guard, jnp.float32(2.0), jnp.float32(math.nan), 0.0)
    assert not bool(verdict.apply) and int(verdict.guard.skipped_nonfinite) == 3


def test_a_spike_over_the_factor_is_skipped_once_the_average_has_history():
    early = [1.0] * (SPIKE_MIN_LOSSES - 1) + [5.0]  # the 10th loss, judged on 9: too early
    assert judged(early)[1] == [True] * SPIKE_MIN_LOSSES
    guard, applied = judged([1.0] * SPIKE_MIN_LOSSES + [2.5, 1.9])
    assert applied == [True] * SPIKE_MIN_LOSSES + [False, True]  # 2.5 > 2 x 1.0; 1.9 is not (the average rose)
    assert int(guard.skipped_spikes) == 1 and int(guard.skipped_nonfinite) == 0
    assert judged([1.0] * SPIKE_MIN_LOSSES + [2.5], spike_factor=0.0)[1][-1]  # 0 = off


def test_the_loss_average_is_a_bias_corrected_moving_average():
    losses = [3.0, 2.0, 1.0]
    guard, _ = judged(losses)
    weights = [LOSS_AVERAGE_DECAY ** (len(losses) - 1 - i) for i in range(len(losses))]
    assert float(guard.loss_average) == pytest.approx(np.dot(weights, losses) / sum(weights), rel=1e-5)


# ---------------------------------------------------------------- Muon against a NumPy reference


def newton_schulz_reference(g: np.ndarray) -> np.ndarray:
    """Jordan's quintic Newton-Schulz iteration in float64, written out for one matrix."""
    a, b, c = NS_COEFFICIENTS
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (3, 7, 5)])
def test_newton_schulz_equals_the_numpy_reference_and_nearly_orthogonalizes(shape):
    g = np.random.default_rng(0).normal(size=shape)
    got = np.asarray(newton_schulz(jnp.asarray(g, jnp.float32)))
    want = np.stack([newton_schulz_reference(m) for m in g.reshape(-1, *shape[-2:])]).reshape(shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    singular = np.linalg.svd(want.reshape(-1, *shape[-2:]), compute_uv=False)
    assert singular.min() > 0.6 and singular.max() < 1.25  # Jordan's iteration: about [0.7, 1.2], not exactly 1


def test_one_muon_step_equals_the_numpy_reference():
    config = micro_config("opt_type=muon", "gradient_clipping_threshold=0", "learning_rate=0.02", "warmup_steps=0",
                         "muon_beta=0.9", "muon_weight_decay=0.1", "muon_consistent_rms=0.2")
    rng = np.random.default_rng(1)
    shape = (2, 8, 2, 3)  # a stacked query: [layers, embed, heads, head_dim], each layer one [8, 6] matrix
    params = {"attention": {"query": jnp.asarray(rng.normal(size=shape), jnp.float32)},
              "final_norm": {"scale": jnp.ones((8,), jnp.float32)}}
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(2)]
    tx = make_optimizer(config)
    state = tx.init(params)
    momentum = np.zeros(shape)
    p = np.asarray(params["attention"]["query"], np.float64)
    for step, g in enumerate(grads):
        lr = float(learning_rate_schedule(config)(step))
        updates, state = tx.update(g, state, params)
        grad = np.asarray(g["attention"]["query"], np.float64)
        momentum = 0.9 * momentum + 0.1 * grad
        nesterov = (0.9 * momentum + 0.1 * grad).reshape(2, 8, 6)
        direction = np.stack([newton_schulz_reference(m) for m in nesterov]).reshape(shape) * 0.2 * math.sqrt(8)
        want = -lr * (direction + 0.1 * p)
        np.testing.assert_allclose(np.asarray(updates["attention"]["query"]), want, rtol=1e-4, atol=1e-6)
        params = optax.apply_updates(params, updates)
        p = np.asarray(params["attention"]["query"], np.float64)
    adam = optax.adam(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)
    adam_state, scale = adam.init(jnp.ones(8)), jnp.ones(8)
    for g in grads:  # the norm scale: AdamW without decay (norm scales are not decayed)
        adam_update, adam_state = adam.update(g["final_norm"]["scale"], adam_state)
        scale = scale + adam_update
    np.testing.assert_allclose(np.asarray(params["final_norm"]["scale"]), np.asarray(scale), rtol=1e-6)


def test_muon_reads_each_projection_as_its_matrix_and_leaves_the_rest_to_adamw():
    config = micro_config("opt_type=muon", "num_experts=4", "num_experts_per_tok=2", "moe_layer_interval=2")
    params = trace_state(config).abstract.params
    labels = {"/".join(str(k.key) for k in path): label
              for path, label in jax.tree_util.tree_leaves_with_path(muon_labels(params))}
    adamw = {name for name, label in labels.items() if label == "adamw"}
    assert {name.split("/")[-2] if name.endswith("scale") else name.split("/")[-1] for name in adamw} == {
        "token_embedding", "output", "router", "pre_attention_norm", "pre_mlp_norm", "final_norm"}
    muon = {name for name, label in labels.items() if label == "muon"}
    assert {name.split("/")[-1] for name in muon} == {"query", "key", "value", "out", "wi_gate", "wi_up", "wo"}
    views = {name: MatrixView.of(tuple(name.split("/")), leaf.shape)
             for name, leaf in zip(labels, jax.tree.leaves(params)) if labels[name] == "muon"}
    query = next(v for n, v in views.items() if n.endswith("attention/query"))
    assert (query.count, query.rows, query.columns) == (1, 64, 64)  # [layers 1, embed 64, heads 4, head_dim 16]
    out = next(v for n, v in views.items() if n.endswith("attention/out"))
    assert (out.rows, out.columns) == (64, 64)  # [heads, head_dim] are its rows
    expert = next(v for n, v in views.items() if n.endswith("moe/wi_gate"))
    assert (expert.count, expert.rows, expert.columns) == (4, 64, 128)  # one matrix per expert


def test_the_optimizer_state_carries_the_guard():
    tx = make_optimizer(micro_config())
    state = tx.init({"w": jnp.ones((2, 3))})
    assert isinstance(state, OptimizerState) and int(state.guard.losses_seen) == 0
    _, updated = tx.update({"w": jnp.ones((2, 3))}, state, {"w": jnp.ones((2, 3))})
    assert updated.guard is state.guard  # the train step moves it, not the update rule


# ---------------------------------------------------------------- z-loss


def test_z_loss_adds_the_weighted_squared_log_normalizer_of_real_tokens():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 5, 11)).astype(np.float32) * 3
    targets = rng.integers(0, 11, (2, 5)).astype(np.int32)
    segments = np.array([[1, 1, 1, 0, 0], [1, 2, 2, 2, 0]], np.int32)
    plain, plain_sums = _token_losses(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(segments))
    assert "z_loss_sum" not in plain_sums
    total, sums = _token_losses(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(segments), 1e-2)
    log_z = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    want = np.sum(np.where(segments != 0, log_z ** 2, 0.0))
    assert float(sums["z_loss_sum"]) == pytest.approx(want, rel=1e-5)
    assert float(total) == pytest.approx(float(plain) + 1e-2 * want, rel=1e-6)
    assert float(sums["loss_sum"]) == float(plain_sums["loss_sum"])


# ---------------------------------------------------------------- the planner's view of Muon


def planned(*overrides: str):
    from maxpar.core.mesh import resolve_mesh_shape
    from maxpar.plan.tensors import build_layout

    config = micro_config("opt_type=muon", *overrides)
    return build_layout(config, resolve_mesh_shape(config, 8), trace_state(config))


def test_the_planner_counts_muon_flops_by_how_the_matrices_spread():
    from maxpar.plan.muon import muon_flops, muon_parameters
    from maxpar.plan.muon_comms import muon_comms
    from maxpar.training.muon import newton_schulz_flops

    fsdp8 = planned("ici_fsdp_parallelism=8")
    views = {p.tensor.name: MatrixView.of(tuple(p.tensor.name.split("/")), p.tensor.shape)
             for p in muon_parameters(fsdp8)}
    total = sum(newton_schulz_flops(view) for view in views.values())
    m, n = 64, 128  # the MLP's [64, 128] matrices: 5 steps of 4 m^2 n + 2 m^3, per layer
    assert newton_schulz_flops(views["decoder/layers/mlp/wi_gate"]) == 2 * 5 * (4 * m * m * n + 2 * m ** 3)
    # 2 layers spread over fsdp(8): padded with 6 zero matrices, each device orthogonalizes one matrix of each
    assert muon_flops(fsdp8) == total / 2
    assert {(c.axes, c.collective) for c in muon_comms(fsdp8)} == {(("fsdp",), "all-to-all")}
    # FSDP(4) x TP(2): tensor divides the 2 layers; fsdp then goes onto them padded to 8: one matrix each again
    mixed = planned("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    assert muon_flops(mixed) == total / 2
    assert {(c.axes, c.collective) for c in muon_comms(mixed)} == {(("tensor",), "all-to-all"),
                                                                    (("fsdp",), "all-to-all")}
    gathered = planned("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "ici_stage_parallelism=1",
                       "num_decoder_layers=3", "scan_layers=false")  # one matrix per parameter: nothing to spread
    assert {(c.axes, c.collective) for c in muon_comms(gathered)} == {(("fsdp",), "all-gather"),
                                                                       (("tensor",), "all-gather")}
    assert muon_comms(planned("opt_type=adamw")) == []
