"""Blockwise (flash-style) attention in pure JAX: online softmax over a static schedule of block pairs.

Queries and keys are cut into blocks of `block` rows. Only the (query block, key block)
pairs that can hold an unmasked score are visited: `block_pairs` drops every pair
entirely above the causal diagonal or entirely outside the sliding window, so that work
is skipped, not computed and masked. The schedule is a small int32 array and the visit
is one `lax.scan` over it, so memory is O(seq x block) per head, never O(seq^2).

The mask is the einsum core's (maxpar.model.attention): a key is visible when its global
sequence index is <= the query's (and within `window` of it) and both lie in the same
packed document. Global indices are explicit arguments because context parallelism
reorders and splits the sequence (maxpar.model.context_parallel).

The backward pass is a custom VJP that recomputes the probabilities block by block from
the saved log-sum-exp (flash attention), so it never stores the scores either. It also
accepts a cotangent for the log-sum-exp, which ring attention needs to combine hops.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

NEG = -1e30  # "minus infinity" that stays finite: exp(NEG - m) == 0 and NEG - NEG == 0, never NaN


def block_pairs(q_index: np.ndarray, k_index: np.ndarray, block: int, window: int = 0) -> np.ndarray:
    """[P, 2] int32 (query block, key block) pairs that may hold an unmasked score, by query block.

    `q_index`/`k_index` are the static global sequence indices of the rows. A pair is
    skipped when every key index exceeds every query index (above the causal diagonal)
    or, with a window, when every key is at least `window` behind every query.
    """
    qb, kb = np.asarray(q_index).reshape(-1, block), np.asarray(k_index).reshape(-1, block)
    needed = kb.min(1)[None, :] <= qb.max(1)[:, None]
    if window:
        needed &= qb.min(1)[:, None] - kb.max(1)[None, :] < window
    return np.argwhere(needed).astype(np.int32)


def padded_schedules(schedules: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Stack per-shard schedules into ([N, P, 2] pairs, [N, P] valid), padding with skipped entries."""
    longest = max(1, max(len(s) for s in schedules))
    pairs = np.zeros((len(schedules), longest, 2), np.int32)
    valid = np.zeros((len(schedules), longest), bool)
    for n, schedule in enumerate(schedules):
        pairs[n, :len(schedule)] = schedule
        valid[n, :len(schedule)] = True
    return pairs, valid


class Carry(NamedTuple):
    """Online-softmax state of every query block: unnormalized output, running max and sum."""

    acc: Array  # [nq, B, KV, G, bq, Dv] float32
    m: Array    # [nq, B, KV, G, bq] float32
    l: Array    # [nq, B, KV, G, bq] float32


def _blocks(q: Array, k: Array, v: Array, block: int) -> tuple[Array, Array, Array]:
    """q [B, L, H, D] -> [nq, B, bq, KV, G, D]; k, v [B, L, KV, D or Dv] -> [nk, B, bk, KV, D or Dv]."""
    b, lq, h, d = q.shape
    kv = k.shape[2]
    qb = q.reshape(b, lq // block, block, kv, h // kv, d).swapaxes(0, 1)
    kb = k.reshape(b, k.shape[1] // block, block, kv, d).swapaxes(0, 1)
    vb = v.reshape(b, v.shape[1] // block, block, kv, v.shape[-1]).swapaxes(0, 1)
    return qb, kb, vb


def _row_blocks(x: Array, block: int) -> Array:
    """[B, L] -> [n, B, block]; [L] -> [n, block]."""
    if x.ndim == 1:
        return x.reshape(-1, block)
    return x.reshape(x.shape[0], -1, block).swapaxes(0, 1)


def _masked_scores(qi, kj, q_idx, k_idx, q_seg, k_seg, window: int, ok: Array) -> tuple[Array, Array]:
    """Scores [B, KV, G, bq, bk] in float32 (NEG where masked) and the mask [B, 1, 1, bq, bk]; `ok` false (a
    padding entry of the schedule) masks the whole block, which makes its visit change nothing."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32)
    offset = q_idx[:, None] - k_idx[None, :]
    visible = (offset >= 0) & (offset < window) if window else offset >= 0
    mask = (visible[None] & (q_seg[:, :, None] == k_seg[:, None, :]) & ok)[:, None, None]
    return jnp.where(mask, s, NEG), mask


def _varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over (empty outside shard_map)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def varying_like(tree, *arrays: Array):
    """`tree` marked device-varying over every mesh axis the `arrays` vary over (inside shard_map).

    A loop carry that starts as constants must already have the type the loop body gives it.
    """
    axes = frozenset().union(*(_varying_axes(a) for a in arrays))

    def cast(x):
        missing = tuple(sorted(axes - _varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(cast, tree)


def init_carry(q: Array, v: Array, block: int) -> Carry:
    """The empty online-softmax state of q's blocks against values like `v` (its heads and width)."""
    b, lq, h, _ = q.shape
    num_kv = v.shape[2]
    shape = (lq // block, b, num_kv, h // num_kv, block)
    return Carry(jnp.zeros((*shape, v.shape[-1]), jnp.float32), jnp.full(shape, NEG, jnp.float32), jnp.zeros(shape, jnp.float32))


def accumulate(carry: Carry, q: Array, k: Array, v: Array, q_index: Array, k_index: Array, q_seg: Array,
               k_seg: Array, pairs: Array, valid: Array, *, window: int, block: int) -> Carry:
    """Add the keys k, v to the online softmax of every query block, visiting only `pairs` where `valid`."""
    qb, kb, vb = _blocks(q, k, v, block)
    qi_all, ki_all = _row_blocks(q_index, block), _row_blocks(k_index, block)
    qs_all, ks_all = _row_blocks(q_seg, block), _row_blocks(k_seg, block)

    def visit(carry: Carry, entry) -> tuple[Carry, None]:
        (i, j), ok = entry
        s, mask = _masked_scores(qb[i], kb[j], qi_all[i], ki_all[j], qs_all[i], ks_all[j], window, ok)
        m_old = carry.m[i]
        m_new = jnp.maximum(m_old, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m_old - m_new)
        pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vb[j], preferred_element_type=jnp.float32)
        return Carry(carry.acc.at[i].set(carry.acc[i] * correction[..., None] + pv),
                     carry.m.at[i].set(m_new), carry.l.at[i].set(carry.l[i] * correction + p.sum(-1))), None

    # Padding entries are masked, not branched around: a lax.cond here made XLA keep every iteration's scores
    # and masks inside a scanned layer stack (several times the memory of ring attention's step; docs/results).
    carry, _ = jax.lax.scan(visit, varying_like(carry, q, k, v, q_index, k_index, q_seg, k_seg, pairs), (pairs, valid))
    return carry


def finish(carry: Carry) -> tuple[Array, Array]:
    """(out [B, L, H, D] float32, lse [B, KV, G, L]) from the online-softmax state."""
    has = carry.l > 0
    out = carry.acc / jnp.where(has, carry.l, 1.0)[..., None]
    lse = jnp.where(has, carry.m + jnp.log(jnp.where(has, carry.l, 1.0)), NEG)
    nq, b, kv, g, bq, d = out.shape
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, kv * g, d)
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(b, kv, g, nq * bq)
    return out, lse


def backward(q: Array, k: Array, v: Array, q_index: Array, k_index: Array, q_seg: Array, k_seg: Array,
             pairs: Array, valid: Array, d_out: Array, lse: Array, delta: Array, *, window: int,
             block: int) -> tuple[Array, Array, Array]:
    """(dq, dk, dv) in float32 for the keys k, v, given the final lse and delta = rowsum(dO * O) - d_lse.

    The probabilities are recomputed per visited block pair from lse: p = exp(s - lse).
    """
    qb, kb, vb = _blocks(q, k, v, block)
    qi_all, ki_all = _row_blocks(q_index, block), _row_blocks(k_index, block)
    qs_all, ks_all = _row_blocks(q_seg, block), _row_blocks(k_seg, block)
    b, lq, h, _ = q.shape
    kv = k.shape[2]
    nq = lq // block
    # [B, L, H, Dv] -> [nq, B, KV, G, bq, Dv]; [B, KV, G, L] -> [nq, B, KV, G, bq]
    do_b = d_out.reshape(b, nq, block, kv, h // kv, d_out.shape[-1]).transpose(1, 0, 3, 4, 2, 5)
    lse_b = lse.reshape(b, kv, h // kv, nq, block).transpose(3, 0, 1, 2, 4)
    delta_b = delta.reshape(b, kv, h // kv, nq, block).transpose(3, 0, 1, 2, 4)
    grads = (jnp.zeros(qb.shape, jnp.float32), jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32))

    def visit(grads, entry):
        dq, dk, dv = grads
        (i, j), ok = entry
        s, mask = _masked_scores(qb[i], kb[j], qi_all[i], ki_all[j], qs_all[i], ks_all[j], window, ok)
        p = jnp.where(mask, jnp.exp(s - lse_b[i][..., None]), 0.0)
        dv = dv.at[j].add(jnp.einsum("bkgqs,bkgqd->bskd", p, do_b[i]))
        dp = jnp.einsum("bkgqd,bskd->bkgqs", do_b[i], vb[j], preferred_element_type=jnp.float32)
        ds = p * (dp - delta_b[i][..., None])
        dq = dq.at[i].add(jnp.einsum("bkgqs,bskd->bqkgd", ds, kb[j], preferred_element_type=jnp.float32))
        dk = dk.at[j].add(jnp.einsum("bkgqs,bqkgd->bskd", ds, qb[i], preferred_element_type=jnp.float32))
        return (dq, dk, dv), None

    grads = varying_like(grads, q, k, v, q_index, k_index, q_seg, k_seg, pairs, d_out, lse, delta)
    (dq, dk, dv), _ = jax.lax.scan(visit, grads, (pairs, valid))
    return (dq.swapaxes(0, 1).reshape(q.shape), dk.swapaxes(0, 1).reshape(k.shape),
            dv.swapaxes(0, 1).reshape(v.shape))


def output_delta(d_out: Array, out: Array, d_lse: Array) -> Array:
    """delta [B, KV, G, L] = rowsum(dO * O) - d_lse (the lse cotangent enters the softmax gradient here)."""
    b, length, h, d = out.shape
    kv = d_lse.shape[1]
    rowsum = jnp.sum(d_out.astype(jnp.float32) * out, axis=-1)  # [B, L, H]
    return rowsum.reshape(b, length, kv, h // kv).transpose(0, 2, 3, 1) - d_lse


# ---------------------------------------------------------------- one device (or one shard holding all keys)

@partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def flash(q, k, v, q_index, k_index, q_seg, k_seg, pairs, valid, window, block):
    """(out [B, Lq, H, D] float32, lse [B, KV, G, Lq]) of q against k, v over the block `pairs` where `valid`."""
    carry = accumulate(init_carry(q, v, block), q, k, v, q_index, k_index, q_seg, k_seg, pairs, valid,
                       window=window, block=block)
    return finish(carry)


def _flash_fwd(q, k, v, q_index, k_index, q_seg, k_seg, pairs, valid, window, block):
    out, lse = flash(q, k, v, q_index, k_index, q_seg, k_seg, pairs, valid, window, block)
    return (out, lse), (q, k, v, q_index, k_index, q_seg, k_seg, pairs, valid, out, lse)


def _flash_bwd(window, block, residuals, cotangents):
    q, k, v, q_index, k_index, q_seg, k_seg, pairs, valid, out, lse = residuals
    d_out, d_lse = cotangents
    delta = output_delta(d_out, out, d_lse)
    dq, dk, dv = backward(q, k, v, q_index, k_index, q_seg, k_seg, pairs, valid, d_out, lse, delta,
                          window=window, block=block)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None, None, None)


flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(q: Array, k: Array, v: Array, segment_ids: Array, *, block: int, window: int = 0,
                        index: np.ndarray | None = None) -> Array:
    """q [B, L, H, D] (pre-scaled), k [B, L, KV, D], v [B, L, KV, Dv] -> [B, L, H, Dv] in q's dtype.

    `index`: the static global sequence index of each row (default: 0..L-1).
    """
    length = q.shape[1]
    index = np.arange(length) if index is None else np.asarray(index)
    pairs = block_pairs(index, index, block, window)
    idx = jnp.asarray(index, jnp.int32)
    out, _ = flash(q, k, v, idx, idx, segment_ids, segment_ids, jnp.asarray(pairs),
                   jnp.ones(len(pairs), bool), window, block)
    return out.astype(q.dtype)
