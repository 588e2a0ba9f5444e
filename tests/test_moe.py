"""The mixture-of-experts block on one device: routing, capacity, balance loss, reference equivalence, config.

Parallel equivalence (EP, mixed with FSDP/TP), checkpoints and the planner: tests/test_moe_parallel.py.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import micro_config
from maxpar.core.config import ConfigError, model_config
from maxpar.model.arithmetic import matmul_params, parameter_counts
from maxpar.model import Transformer
from maxpar.model.moe import MOE_STATS, MoeBlock, moe_totals, routed_counts, routing_bias_update
from maxpar.model.routing import Routing, capacity_slots, expert_capacity, load_balance_loss, route
from maxpar.training.optimizer import decay_mask, make_optimizer

BLOCK = ["emb_dim=16", "mlp_dim=24", "num_experts=4", "num_experts_per_tok=2"]


def block_and_params(*overrides):
    config = micro_config(*BLOCK, *overrides)
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
    config = micro_config("num_experts=8", "num_experts_per_tok=2")
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
    config = micro_config("num_experts=4", "num_experts_per_tok=2", "num_decoder_layers=4", "moe_layer_interval=2")
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = jax.eval_shape(Transformer(model_config(config)).init, jax.random.key(0), tokens, tokens, tokens)["params"]
    block = params["decoder"]["layers"]
    assert set(block) == {"sublayer_0", "sublayer_1"}          # dense, then MoE: layers 2 and 4 are MoE
    assert "mlp" in block["sublayer_0"] and "moe" in block["sublayer_1"]
    assert block["sublayer_1"]["moe"]["wi_gate"].value.shape == (2, 4, 64, 128)   # stacked over 2 blocks
    counts = parameter_counts(nn.unbox(params), 2)
    experts = 2 * 3 * 4 * 64 * 128                               # 2 MoE layers x 3 weights x 4 experts
    assert counts["total"] - counts["active"] == experts // 2    # half of the experts idle per token
    dense = micro_config("num_decoder_layers=4")
    # Active FLOPs: a MoE layer costs its router and k = 2 experts, i.e. 2 dense MLPs.
    assert matmul_params(config) - matmul_params(dense) == 2 * (3 * 64 * 128 + 64 * 4)


@pytest.mark.parametrize("overrides, message", [
    (["num_experts=4", "num_experts_per_tok=5"], "num_experts_per_tok=5 > num_experts=4"),
    (["num_experts=4", "moe_layer_interval=3"], r"moe_layer_interval=3 does not divide the 2 layers \(num_decoder_layers=2\)"),
    (["num_experts=0"], "num_experts=0: must be >= 1"),
    (["capacity_factor=-1"], "capacity_factor=-1.0: must be >= 0"),
])
def test_invalid_moe_configs_fail_at_config_time(overrides, message):
    with pytest.raises(ConfigError, match=message):
        micro_config(*overrides)


# ---------------------------------------------------------------- DeepSeek-V3 routing: sigmoid, bias, groups, shared

def numpy_deepseek_routing(logits, bias, k, groups, keep, scaling):
    """DeepSeek-V3's router per token in plain numpy loops: sigmoid scores; the biased scores pick the groups (by
    the sum of each group's two best) and, within the kept groups, the experts; the unbiased scores of those,
    normalized to sum to 1 and scaled, are the weights. {expert: weight} per token."""
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    out = []
    for row in scores.reshape(-1, scores.shape[-1]):
        biased = row + bias
        per_group = len(row) // groups
        group_score = [sum(sorted(biased[g * per_group:(g + 1) * per_group])[-2:]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -group_score[g])[:keep]
        candidates = [e for e in range(len(row)) if e // per_group in kept]
        chosen = sorted(candidates, key=lambda e: -biased[e])[:k]
        total = sum(row[e] for e in chosen)
        out.append({e: scaling * row[e] / total for e in chosen})
    return out


def test_deepseek_routing_matches_a_numpy_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 16)).astype(np.float32)
    bias = rng.normal(scale=0.3, size=16).astype(np.float32)
    routing = route(jnp.asarray(logits), 3, score_func="sigmoid", bias=jnp.asarray(bias), scaling=2.5, groups=4,
                    topk_groups=2)
    want = numpy_deepseek_routing(logits, bias, k=3, groups=4, keep=2, scaling=2.5)
    got = [dict(zip(e.tolist(), w.tolist())) for e, w in zip(np.asarray(routing.experts).reshape(-1, 3),
                                                              np.asarray(routing.weights).reshape(-1, 3))]
    assert [sorted(g) for g in got] == [sorted(w) for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose([g[e] for e in sorted(w)], [w[e] for e in sorted(w)], rtol=1e-6)
    # The bias moves the choice (some token picks differently without it) but never the weights' values.
    plain = route(jnp.asarray(logits), 3, score_func="sigmoid", scaling=2.5, groups=4, topk_groups=2)
    assert not np.array_equal(np.sort(plain.experts, -1), np.sort(routing.experts, -1))
    # What the balance loss reads: the sigmoid scores normalized over the experts.
    scores = 1 / (1 + np.exp(-logits))
    np.testing.assert_allclose(routing.probs, scores / scores.sum(-1, keepdims=True), rtol=1e-6)


def test_softmax_routing_with_scaling_and_no_renormalization():
    logits = jax.random.normal(jax.random.key(3), (4, 8))
    routing = route(logits, 2, renormalize=False, scaling=2.0)
    probs = np.asarray(jax.nn.softmax(logits, -1))
    np.testing.assert_allclose(routing.weights, 2.0 * np.sort(probs, -1)[:, ::-1][:, :2], rtol=1e-6)


DEEPSEEK_BLOCK = ["routed_score_func=sigmoid", "routed_bias=true", "num_shared_experts=2", "moe_mlp_dim=8",
                  "n_routing_groups=2", "topk_routing_group=1", "routed_scaling_factor=1.5"]


def test_deepseek_block_equals_a_loop_over_experts_plus_shared_and_gives_the_bias_no_gradient():
    config, block, params, x, valid = block_and_params(*DEEPSEEK_BLOCK)
    assert params["wi_gate"].shape == (4, 16, 8) and params["shared_experts"]["wi_gate"].shape == (16, 16)
    params = {**params, "routing_bias": jnp.asarray([0.3, -0.2, 0.0, 0.1])}

    def reference(p):
        p, xs = jax.tree.map(np.asarray, p), np.asarray(x, np.float64)
        silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
        logits = xs @ p["router"]
        routes = numpy_deepseek_routing(logits, p["routing_bias"], k=2, groups=2, keep=1, scaling=1.5)
        y = np.zeros_like(xs)
        for token, chosen in zip(np.ndindex(*xs.shape[:2]), routes):
            for e, weight in chosen.items():
                y[token] += weight * (silu(xs[token] @ p["wi_gate"][e]) * (xs[token] @ p["wi_up"][e])) @ p["wo"][e]
        s = p["shared_experts"]
        return y + (silu(xs @ s["wi_gate"]) * (xs @ s["wi_up"])) @ s["wo"]

    apply = jax.jit(lambda p: block.apply({"params": p}, x, valid))
    np.testing.assert_allclose(apply(params), reference(params), rtol=1e-4, atol=1e-5)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(apply(p) ** 2)))(params)
    assert np.all(np.asarray(grads["routing_bias"]) == 0) and np.any(np.asarray(grads["router"]) != 0)
    assert np.any(np.asarray(grads["shared_experts"]["wo"]) != 0)


def test_routing_bias_update_is_rate_times_the_sign_of_the_imbalance_per_layer():
    bias = {"decoder": {"layers": {"moe": {"routing_bias": jnp.zeros((2, 4)), "router": jnp.ones((2, 3, 4))}},
                        "layers_0": {"moe": {"routing_bias": jnp.full((4,), 0.5)}}}}
    stats = {"decoder": {"layers": {"moe": {"expert_routed": (jnp.asarray([[4.0, 0, 2, 2], [1, 1, 1, 5]]),),
                                            "dropped": (jnp.zeros(2),)}},
                         "layers_0": {"moe": {"expert_routed": (jnp.asarray([3.0, 3, 3, 3]),)}}}}
    new = routing_bias_update(bias, routed_counts(stats), 0.1)
    np.testing.assert_array_equal(new["decoder"]["layers"]["moe"]["routing_bias"],
                                  np.float32([[-0.1, 0.1, 0, 0], [0.1, 0.1, 0.1, -0.1]]))
    np.testing.assert_array_equal(new["decoder"]["layers_0"]["moe"]["routing_bias"], np.full(4, 0.5, np.float32))
    assert new["decoder"]["layers"]["moe"]["router"] is bias["decoder"]["layers"]["moe"]["router"]
    with pytest.raises(ValueError, match="no routed counts"):
        routing_bias_update(bias, {}, 0.1)


@pytest.mark.parametrize("overrides, message", [
    (["n_routing_groups=3"], "n_routing_groups=3 with num_experts=4: the groups must split the experts evenly"),
    (["n_routing_groups=4"], "at least 2 per group"),
    (["n_routing_groups=2", "topk_routing_group=3"], "topk_routing_group=3 with n_routing_groups=2: allowed 1 to 2"),
    (["num_experts=8", "num_experts_per_tok=3", "n_routing_groups=4", "topk_routing_group=1"],
     "num_experts_per_tok=3 with topk_routing_group=1 of n_routing_groups=4: the kept groups hold only 2"),
    (["routed_score_func=relu"], "routed_score_func"),
])
def test_invalid_routing_configs_fail_at_config_time(overrides, message):
    with pytest.raises(ConfigError, match=message):
        micro_config("num_experts=4", "num_experts_per_tok=2", *overrides)


def test_optimizer_leaves_the_routing_bias_alone():
    config = micro_config("num_experts=4", "num_experts_per_tok=2", "routed_bias=true", "adam_weight_decay=0.1",
                         "warmup_steps=0", "gradient_clipping_threshold=1.0")
    tx = make_optimizer(config)
    params = {"decoder": {"layers": {"moe": {"routing_bias": jnp.full((2, 4), 0.5), "router": jnp.ones((2, 3, 4))}}}}
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = tx.update(grads, state, params)
    moe = updates["decoder"]["layers"]["moe"]
    assert np.all(np.asarray(moe["routing_bias"]) == 0) and np.all(np.asarray(moe["router"]) < 0)
    moe_decay = decay_mask(params)["decoder"]["layers"]["moe"]
    assert moe_decay == {"routing_bias": False, "router": True}   # no weight decay on the bias either
