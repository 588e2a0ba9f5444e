"""attention=blockwise: equal to the einsum core (forward and gradient), masked blocks skipped, balanced shards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import layout_on, micro_config
from maxpar.core.config import model_config
from maxpar.model.attention import causal_document_mask, einsum_attention
from maxpar.model.blockwise import block_pairs, blockwise_attention
from maxpar.model.context_parallel import context_attention, sequence_layout, shard_indices

B, L, H, KV, D = 2, 32, 4, 2, 8


def random_inputs(dtype=jnp.float32, seed=0):
    """q, k, v (GQA: 4 query heads on 2 kv heads), packed segment ids, and a cotangent."""
    rng = np.random.default_rng(seed)
    q, k, v, w = (jnp.asarray(rng.normal(size=s), dtype) for s in ((B, L, H, D), (B, L, KV, D), (B, L, KV, D),
                                                                    (B, L, H, D)))
    segments = jnp.array([[1] * 10 + [2] * 15 + [3] * 5 + [0] * 2, [1] * L], jnp.int32)
    return q, k, v, segments, w


def value_and_grads(fn, q, k, v, w):
    out = fn(q, k, v)
    grads = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * w), argnums=(0, 1, 2))(q, k, v)
    return out, grads


@pytest.mark.parametrize("block, window", [(4, 0), (32, 0), (4, 5), (8, 12)])
def test_forward_and_gradient_equal_the_einsum_core(block, window):
    q, k, v, segments, w = random_inputs()
    got, got_grads = jax.jit(lambda q, k, v: value_and_grads(
        lambda *a: blockwise_attention(*a, segments, block=block, window=window), q, k, v, w))(q, k, v)
    want, want_grads = value_and_grads(lambda *a: einsum_attention(*a, segments, window), q, k, v, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for name, g, e in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")


def test_bfloat16_stays_close_to_the_float32_core():
    q, k, v, segments, _ = random_inputs(jnp.bfloat16)
    got = blockwise_attention(q, k, v, segments, block=8).astype(jnp.float32)
    want = einsum_attention(*(x.astype(jnp.float32) for x in (q, k, v)), segments)
    assert got.dtype == jnp.float32 and np.abs(np.asarray(got - want)).max() < 5e-2


def test_only_blocks_on_or_below_the_diagonal_are_visited():
    index = np.arange(L)
    assert len(block_pairs(index, index, 4)) == 8 * 9 // 2  # of 64 block pairs, the causal half
    # A window of 5 keeps the diagonal block and the one before it (and no block further back).
    assert [tuple(p) for p in block_pairs(index, index, 4, window=5)] == (
        [(0, 0)] + [(i, j) for i in range(1, 8) for j in (i - 1, i)])
    # The compiled loop makes exactly that many trips: one scan over the schedule.
    q, k, v, segments, _ = random_inputs()
    jaxpr = jax.make_jaxpr(lambda *a: blockwise_attention(*a, segments, block=4))(q, k, v)
    lengths = [eqn.params["length"] for eqn in _equations(jaxpr.jaxpr) if eqn.primitive.name == "scan"]
    assert lengths == [36]


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else _params_jaxprs(eqn):
            yield from _equations(sub)


def _params_jaxprs(eqn):
    for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value)
        if hasattr(inner, "eqns"):
            yield inner


def test_load_balance_equalizes_the_causal_work_of_the_shards():
    """Per context shard: unmasked (causal) scores and visited block pairs, with and without balance."""
    length, degree = 64, 4
    for balance, equal in ((True, True), (False, False)):
        shards = shard_indices(length // degree, degree, balance)
        order = sequence_layout(length, degree, balance)
        assert sorted(order) == list(range(length))  # a permutation: every token once
        scores = [int((shard[:, None] >= order[None, :]).sum()) for shard in shards]
        pairs = [len(block_pairs(shard, order, 4)) for shard in shards]
        assert sum(scores) == length * (length + 1) // 2
        assert (len(set(scores)) == 1) == equal and (len(set(pairs)) == 1) == equal, (balance, scores, pairs)
    unbalanced = [int((s[:, None] >= np.arange(length)[None, :]).sum()) for s in shard_indices(16, 4, False)]
    assert unbalanced[-1] > 3 * unbalanced[0]


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallel_attention_equals_the_einsum_core(strategy):
    """Sliding window, packed rows, GQA, load balance: forward and gradient through the shard_map."""
    q, k, v, segments, w = random_inputs()
    config = micro_config("attention=blockwise", "attention_block_size=4", "ici_context_parallelism=4",
                         "ici_fsdp_parallelism=2", f"context_parallel_strategy={strategy}", "sliding_window=5")
    order = sequence_layout(L, 4, True)
    back = np.argsort(order)

    layout, mesh = layout_on(config)

    def sharded(q, k, v):
        out = context_attention(q[:, order], k[:, order], v[:, order], segments[:, order], model_config(config),
                                layout.model.context)
        return out[:, back]

    placed = jax.device_put((q, k, v), NamedSharding(mesh, P()))  # the layout's shard_map finds the devices here
    got, got_grads = jax.jit(lambda q, k, v: value_and_grads(sharded, q, k, v, w))(*placed)
    want, want_grads = value_and_grads(lambda *a: einsum_attention(*a, segments, 5), q, k, v, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, e in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)


def test_the_mask_is_the_einsum_cores():
    """blockwise uses the same visibility rule: its attention weights on a one-hot v are the einsum's mask."""
    _, _, _, segments, _ = random_inputs()
    q = jnp.zeros((B, L, 1, L))
    k = jnp.zeros((B, L, 1, L))
    v = jnp.broadcast_to(jnp.eye(L)[None, :, None, :], (B, L, 1, L))
    weights = blockwise_attention(q, k, v, segments, block=8, window=6)[:, :, 0]  # uniform over visible keys
    visible = np.asarray(causal_document_mask(segments, 6)[:, 0])
    np.testing.assert_array_equal(np.asarray(weights) > 0, visible)
