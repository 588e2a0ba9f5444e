"""Context parallelism: the sequence split over the `context` mesh axis, attention across the shards.

Each of the C context shards holds a slice of every row's tokens (`activation_length` and
the attention length names shard over `context`). Attention (attention=blockwise) runs in
a `jax.shard_map`; the keys of the other shards reach a query shard in one of two ways
(`context_parallel_strategy`):

- all_gather: k, v (and the key segment ids) are all-gathered over `context` per layer;
  each shard runs the blockwise kernel on its queries against all keys. The gradient of the
  gather is a reduce-scatter of dk, dv.
- ring: k, v blocks travel the ring with `ppermute`, one hop per shard; the online softmax
  state carries across hops. The backward pass (a custom VJP) sends k, v round again with
  their gradients travelling beside them, so no device ever holds all keys and values.

Load balance (`context_parallel_load_balance`): the causal triangle gives later tokens more
keys. The row is reordered once at the input (`reorder_batch`) so that shard i holds chunks
i and 2C-1-i of 2C equal chunks; `sequence_layout` is that order, and the kernel's mask uses
it as the tokens' global indices, so the result is the same function of the same tokens.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from maxpar.core.axes import CONTEXT_AXIS
from maxpar.core.config import ModelConfig
from maxpar.core.layout import ContextLayout, ModelLayout
from maxpar.model.blockwise import (accumulate, backward, block_pairs, blockwise_attention, finish, flash,
                                    init_carry, output_delta, padded_schedules)

Array = jax.Array


def sequence_layout(length: int, degree: int, balance: bool) -> np.ndarray:
    """order[r] = original position of row position r after the load-balancing reorder (shard-major).

    With balance and C = degree shards, the row is cut into 2C chunks and shard s gets
    chunks s and 2C-1-s; otherwise the identity.
    """
    if not balance or degree == 1:
        return np.arange(length)
    chunks = np.arange(length).reshape(2 * degree, -1)
    return np.concatenate([np.concatenate([chunks[s], chunks[2 * degree - 1 - s]]) for s in range(degree)])


def reorder_batch(batch: dict[str, Array], layout: ModelLayout | None) -> dict[str, Array]:
    """Apply the load-balancing order to every [B, L] input (tokens, targets, positions, segment ids).

    Done once per step at the input; the loss, a sum over tokens, is unchanged.
    """
    context = layout.context if layout else None
    if context is None or not context.balanced:
        return batch
    length = next(iter(batch.values())).shape[1]
    order = jnp.asarray(sequence_layout(length, context.degree, True), jnp.int32)
    return {key: jnp.take(value, order, axis=1) for key, value in batch.items()}


def context_attention(q: Array, k: Array, v: Array, segment_ids: Array, config: ModelConfig,
                      context: ContextLayout | None) -> Array:
    """attention=blockwise: q [B, L, H, D] (pre-scaled), k/v [B, L, KV, D].

    Without a context layout (no mesh) it is the blockwise kernel on the whole arrays, in blocks of the model's
    attention_block_size. With one it runs per device under shard_map (batch and heads split as the layout
    says), and across the `context` shards by the layout's strategy, load balance and block size.
    """
    window = config.sliding_window
    if context is None:
        return blockwise_attention(q, k, v, segment_ids, block=min(config.attention_block_size, q.shape[1]),
                                   window=window)
    degree, strategy, balance, block_size = context.degree, context.strategy, context.load_balance, context.block_size

    def body(q, k, v, seg):
        local = q.shape[1]
        block = min(block_size, local)
        if degree == 1:
            return blockwise_attention(q, k, v, seg, block=block, window=window)
        if strategy == "ring":
            return ring_attention(q, k, v, seg, degree, balance, window, block).astype(q.dtype)
        return gathered_attention(q, k, v, seg, degree, balance, window, block).astype(q.dtype)

    seg_spec = jax.sharding.PartitionSpec(*context.q_spec[:2])
    return jax.shard_map(body, mesh=context.mesh.abstract(), in_specs=(context.q_spec, context.kv_spec,
                                                                       context.kv_spec, seg_spec),
                         out_specs=context.q_spec)(q, k, v, segment_ids)


def shard_indices(local: int, degree: int, balance: bool) -> np.ndarray:
    """[C, local]: the original sequence positions each context shard holds."""
    return sequence_layout(local * degree, degree, balance).reshape(degree, local)


def gathered_attention(q: Array, k: Array, v: Array, seg: Array, degree: int, balance: bool, window: int,
                       block: int) -> Array:
    """all_gather strategy, inside shard_map: this shard's queries against the gathered keys (float32 out)."""
    shards = shard_indices(q.shape[1], degree, balance)
    order = shards.reshape(-1)
    pairs, valid = padded_schedules([block_pairs(shards[s], order, block, window) for s in range(degree)])
    me = jax.lax.axis_index(CONTEXT_AXIS)
    gather = partial(jax.lax.all_gather, axis_name=CONTEXT_AXIS, axis=1, tiled=True)
    out, _ = flash(q, gather(k), gather(v), jnp.asarray(shards)[me], jnp.asarray(order, jnp.int32), seg, gather(seg),
                   jnp.asarray(pairs)[me], jnp.asarray(valid)[me], window, block)
    return out


def ring_schedules(local: int, degree: int, balance: bool, block: int, window: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per hop t: ([C, P, 2] pairs, [C, P] valid) of shard s's queries against the keys of shard s - t."""
    shards = shard_indices(local, degree, balance)
    return [padded_schedules([block_pairs(shards[s], shards[(s - t) % degree], block, window)
                              for s in range(degree)]) for t in range(degree)]


def _ring_permute(tree):
    """Send to the next shard on the context ring (shard s receives from s - 1)."""
    degree = jax.lax.axis_size(CONTEXT_AXIS)
    return jax.lax.ppermute(tree, CONTEXT_AXIS, [(i, (i + 1) % degree) for i in range(degree)])


def _ring_forward(q, k, v, seg, degree, balance, window, block):
    local = q.shape[1]
    shards = jnp.asarray(shard_indices(local, degree, balance))
    me = jax.lax.axis_index(CONTEXT_AXIS)
    carry = init_carry(q, v, block)
    visiting = (k, v, seg)
    for hop, (pairs, valid) in enumerate(ring_schedules(local, degree, balance, block, window)):
        kh, vh, segh = visiting
        carry = accumulate(carry, q, kh, vh, shards[me], shards[(me - hop) % degree], seg, segh,
                           jnp.asarray(pairs)[me], jnp.asarray(valid)[me], window=window, block=block)
        if hop < degree - 1:
            visiting = _ring_permute(visiting)
    return finish(carry)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def ring_attention(q, k, v, seg, degree, balance, window, block):
    """ring strategy, inside shard_map: [B, L/C, H, D] float32; k, v make one trip round the ring."""
    return _ring_forward(q, k, v, seg, degree, balance, window, block)[0]


def _ring_fwd(q, k, v, seg, degree, balance, window, block):
    out, lse = _ring_forward(q, k, v, seg, degree, balance, window, block)
    return out, (q, k, v, seg, out, lse)


def _ring_bwd(degree, balance, window, block, residuals, d_out):
    """k, v go round again; their gradients travel with them and one last hop brings them home."""
    q, k, v, seg, out, lse = residuals
    local = q.shape[1]
    shards = jnp.asarray(shard_indices(local, degree, balance))
    me = jax.lax.axis_index(CONTEXT_AXIS)
    delta = output_delta(d_out, out, jnp.zeros_like(lse))
    dq = jnp.zeros(q.shape, jnp.float32)
    visiting = (k, v, seg)
    d_visiting = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for hop, (pairs, valid) in enumerate(ring_schedules(local, degree, balance, block, window)):
        kh, vh, segh = visiting
        dq_h, dk_h, dv_h = backward(q, kh, vh, shards[me], shards[(me - hop) % degree], seg, segh,
                                    jnp.asarray(pairs)[me], jnp.asarray(valid)[me], d_out, lse, delta,
                                    window=window, block=block)
        dq = dq + dq_h
        d_visiting = _ring_permute((d_visiting[0] + dk_h, d_visiting[1] + dv_h))
        if hop < degree - 1:
            visiting = _ring_permute(visiting)
    return dq.astype(q.dtype), d_visiting[0].astype(k.dtype), d_visiting[1].astype(v.dtype), None


ring_attention.defvjp(_ring_fwd, _ring_bwd)
