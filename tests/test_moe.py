"""The mixture-of-experts block on one device: routing, capacity, balance loss, reference equivalence, config.

Parallel equivalence (EP, mixed with FSDP/TP), checkpoints and the planner: tests/test_moe_parallel.py.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config
from maxpar.core.config import ConfigError, model_config
from maxpar.io.metrics import matmul_params, parameter_counts
from maxpar.model import Transformer
from maxpar.model.moe import MOE_STATS, MoeBlock, moe_totals
from maxpar.model.routing import Routing, capacity_slots, expert_capacity, load_balance_loss, route

BLOCK = ["emb_dim=16", "mlp_dim=24", "num_experts=4", "num_experts_per_tok=2"]


def block_and_params(*overrides):
    config = tiny_config(*BLOCK, *overrides)
    block = MoeBlock(model_config(config))
    x = jax.random.normal(jax.random.key(1), (3, 10, config.emb_dim), jnp.float32)
    valid = jnp.ones((3, 10), bool).at[2, 6:].set(False)  # a padded row
    params = nn.unbox(block.init(jax.random.key(0), x, valid)["params"])
    return config, block, params, x, valid


def reference_moe(params, x, k: int):
    """A plain loop over the experts: every expert runs on every token, weighted by its (renormalized) top-k share."""
    probs = jax.nn.softmax(x @ params["router"], axis=-1)
    chosen = jnp.argsort(-probs, axis=-1, stable=True)[..., :k]
    top = jnp.take_along_axis(probs, chosen, axis=-1)
    top = top / top.sum(-1, keepdims=True)
    y = jnp.zeros_like(x)
    for e in range(probs.shape[-1]):
        share = jnp.sum(jnp.where(chosen == e, top, 0.0), axis=-1)
        hidden = jax.nn.silu(x @ params["wi_gate"][e]) * (x @ params["wi_up"][e])
        y = y + share[..., None] * (hidden @ params["wo"][e])
    return y


def test_parameters_have_the_contracted_names_shapes_and_logical_axes():
    config = tiny_config("num_experts=8", "num_experts_per_tok=2")
    tokens = jnp.zeros((1, 8), jnp.int32)
    boxed = jax.eval_shape(Transformer(model_config(config)).init, jax.random.key(0), tokens, tokens, tokens)["params"]
    moe = boxed["decoder"]["layers"]["moe"]
    e, m, layers = config.emb_dim, config.mlp_dim, config.num_decoder_layers
    assert "mlp" not in boxed["decoder"]["layers"]
    assert {name: (leaf.value.shape, leaf.names) for name, leaf in moe.items()} == {
        "router": ((layers, e, 8), ("layers", "embed", None)),
        "wi_gate": ((layers, 8, e, m), ("layers", "exp", "embed", "mlp")),
        "wi_up": ((layers, 8, e, m), ("layers", "exp", "embed", "mlp")),
        "wo": ((layers, 8, m, e), ("layers", "exp", "mlp", "embed")),
    }


def test_dropless_block_equals_a_loop_over_experts_forward_and_gradients():
    config, block, params, x, valid = block_and_params()

    def ours(p, x):
        return block.apply({"params": p}, x, valid)

    np.testing.assert_allclose(ours(params, x), reference_moe(params, x, 2), rtol=1e-5, atol=1e-6)
    loss = lambda fn: lambda p, x: jnp.sum(jnp.sin(fn(p, x)))  # noqa: E731 -- a non-trivial cotangent
    got = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(params, x)
    want = jax.jit(jax.grad(loss(lambda p, x: reference_moe(p, x, 2)), argnums=(0, 1)))(params, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got, want)
    assert float(jnp.abs(got[0]["router"]).max()) > 0  # the router learns through the combine weights


def test_capacity_with_room_for_every_token_equals_dropless():
    config, block, params, x, valid = block_and_params("capacity_factor=2.0")  # capacity = whole row
    y, stats = block.apply({"params": params}, x, valid, mutable=[MOE_STATS])
    np.testing.assert_allclose(y[valid], reference_moe(params, x, 2)[valid], rtol=1e-5, atol=1e-6)
    assert float(moe_totals(stats[MOE_STATS])["dropped"]) == 0.0
    assert float(jnp.abs(y[~valid]).max()) == 0.0  # padding takes no capacity and is not computed


def test_routing_is_mixtral_softmax_top_k_renormalized():
    logits = jnp.log(jnp.array([[[0.1, 0.4, 0.2, 0.3]]]))
    r = route(logits, 2)
    np.testing.assert_allclose(r.probs, [[[0.1, 0.4, 0.2, 0.3]]], rtol=1e-6)
    assert r.experts.tolist() == [[[1, 3]]]
    np.testing.assert_allclose(r.weights, [[[0.4 / 0.7, 0.3 / 0.7]]], rtol=1e-6)
    raw = route(logits, 2, renormalize=False)  # norm_topk_prob=false (Qwen3-MoE): the same experts, raw weights
    assert raw.experts.tolist() == [[[1, 3]]]
    np.testing.assert_allclose(raw.weights, [[[0.4, 0.3]]], rtol=1e-6)


def test_capacity_drops_exactly_the_assignments_over_the_capacity_rule():
    # One row of 5 tokens, 3 experts, top-2; capacity 2 per expert. Priority: every first choice in
    # sequence order, then every second choice.
    experts = jnp.array([[[0, 1], [0, 2], [0, 1], [1, 0], [2, 0]]])
    valid = jnp.array([[True, True, True, True, False]])   # the last token is padding
    slots, kept = capacity_slots(experts, valid, num_experts=3, capacity=2)
    # First choices: t0->0 (slot 0), t1->0 (slot 1), t2->0 (over: dropped), t3->1 (slot 0); t4 is padding.
    # Second choices: t0->1 (slot 1), t1->2 (slot 0), t2->1 (over: dropped), t3->0 (over: dropped).
    assert kept.tolist() == [[[True, True], [True, True], [False, False], [True, False], [False, False]]]
    assert slots.tolist() == [[[0, 1], [1, 0], [2, 2], [0, 2], [2, 2]]]
    assert expert_capacity(row_length=32, k=2, num_experts=8, capacity_factor=1.25) == 10
    assert expert_capacity(row_length=5, k=2, num_experts=3, capacity_factor=0.6) == 2


def test_capacity_mode_output_and_drop_count_follow_the_rule():
    config, block, params, x, valid = block_and_params("capacity_factor=0.5")
    y, stats = block.apply({"params": params}, x, valid, mutable=[MOE_STATS])
    routing = route(x @ params["router"], 2)
    capacity = expert_capacity(10, 2, 4, 0.5)
    _, kept = capacity_slots(routing.experts, valid, 4, capacity)
    totals = moe_totals(stats[MOE_STATS])
    assert float(totals["routed"]) == 2 * int(valid.sum())
    assert float(totals["dropped"]) == 2 * int(valid.sum()) - int(kept.sum()) > 0
    # Expected output: each token's kept experts only, with their unrenormalized-after-dropping weights.
    want = jnp.zeros_like(x)
    for e in range(4):
        share = jnp.sum(jnp.where((routing.experts == e) & kept, routing.weights, 0.0), axis=-1)
        hidden = jax.nn.silu(x @ params["wi_gate"][e]) * (x @ params["wi_up"][e])
        want = want + share[..., None] * (hidden @ params["wo"][e])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def balance(probs, experts, valid=None):
    probs, experts = jnp.asarray(probs, jnp.float32), jnp.asarray(experts, jnp.int32)
    valid = jnp.ones(probs.shape[:-1], bool) if valid is None else jnp.asarray(valid)
    return float(load_balance_loss(Routing(probs, experts, jnp.zeros(experts.shape)), valid))


def test_load_balance_loss_on_hand_built_routings():
    # Uniform: 4 tokens, 4 experts, top-1, each expert once, uniform probabilities -> E x sum(1/4 x 1/4) = 1 = k.
    uniform = jnp.full((1, 4, 4), 0.25)
    assert balance(uniform, [[[0], [1], [2], [3]]]) == pytest.approx(1.0)
    # Top-2, uniform: every expert chosen by half the tokens -> k = 2.
    assert balance(uniform, [[[0, 1], [2, 3], [0, 2], [1, 3]]]) == pytest.approx(2.0)
    # Collapsed: every token to expert 0 with certainty -> E = 4, the worst.
    collapsed = jnp.zeros((1, 4, 4)).at[..., 0].set(1.0)
    assert balance(collapsed, [[[0], [0], [0], [0]]]) == pytest.approx(4.0)
    # Half collapsed: f = (3/4, 1/4, 0, 0), P = (0.55, 0.3, 0.1, 0.05) -> 4 x (0.4125 + 0.075) = 1.95.
    probs = [[[0.7, 0.1, 0.1, 0.1], [0.7, 0.1, 0.1, 0.1], [0.7, 0.1, 0.1, 0.1], [0.1, 0.9, 0.0, 0.0]]]
    assert balance(probs, [[[0], [0], [0], [1]]]) == pytest.approx(4 * (0.75 * 0.55 + 0.25 * 0.3))
    # Padding tokens count for nothing.
    assert balance(jnp.concatenate([uniform, collapsed], 1), [[[0], [1], [2], [3], [0], [0], [0], [0]]],
                   [[True] * 4 + [False] * 4]) == pytest.approx(1.0)


def test_uniform_routing_is_the_minimum_of_the_balance_loss():
    # Any routing the router itself chose (top-k of its probabilities) scores at least k.
    for seed in range(20):
        logits = 3 * jax.random.normal(jax.random.key(seed), (2, 16, 8))
        r = route(logits, 2)
        assert balance(r.probs, r.experts) >= 2.0 - 1e-6


def test_moe_layers_interleave_and_count_active_parameters():
    config = tiny_config("num_experts=4", "num_experts_per_tok=2", "num_decoder_layers=4", "moe_layer_interval=2")
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = jax.eval_shape(Transformer(model_config(config)).init, jax.random.key(0), tokens, tokens, tokens)["params"]
    block = params["decoder"]["layers"]
    assert set(block) == {"sublayer_0", "sublayer_1"}          # dense, then MoE: layers 2 and 4 are MoE
    assert "mlp" in block["sublayer_0"] and "moe" in block["sublayer_1"]
    assert block["sublayer_1"]["moe"]["wi_gate"].value.shape == (2, 4, 64, 128)   # stacked over 2 blocks
    counts = parameter_counts(nn.unbox(params), 2)
    experts = 2 * 3 * 4 * 64 * 128                               # 2 MoE layers x 3 weights x 4 experts
    assert counts["total"] - counts["active"] == experts // 2    # half of the experts idle per token
    dense = tiny_config("num_decoder_layers=4")
    # Active FLOPs: a MoE layer costs its router and k = 2 experts, i.e. 2 dense MLPs.
    assert matmul_params(config) - matmul_params(dense) == 2 * (3 * 64 * 128 + 64 * 4)


@pytest.mark.parametrize("overrides, message", [
    (["num_experts=4", "num_experts_per_tok=5"], "num_experts_per_tok=5 > num_experts=4"),
    (["num_experts=4", "moe_layer_interval=3"], "moe_layer_interval=3 does not divide num_decoder_layers=2"),
    (["num_experts=0"], "num_experts=0: must be >= 1"),
    (["capacity_factor=-1"], "capacity_factor=-1.0: must be >= 0"),
])
def test_invalid_moe_configs_fail_at_config_time(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(*overrides)
