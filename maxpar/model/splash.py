"""attention=splash: JAX's Pallas TPU splash attention kernel (`jax.experimental.pallas.ops.tpu.splash_attention`).

The kernel attends one example: q [H, Lq, D] against k, v [KV, Lk, D or Dv], H a multiple of KV (GQA: query head h
reads key head h // (H / KV), the grouping of the other cores), in blocks of `sa_block_q` queries and `sa_block_kv`
keys. From its static mask (causal, or a sliding window) it builds a block table at trace time and visits only the
blocks that hold a visible score; inside them it applies the mask and the packed documents' segment ids. Its custom
VJP recomputes the probabilities per block from the saved log-sum-exp, so neither pass keeps seq x seq scores: the
memory of attention=blockwise, as a Mosaic kernel.

On a mesh it runs per device under shard_map, as the layout's `ContextLayout` says: rows split as the batch is,
heads as tensor parallelism splits them. Context parallelism takes the all_gather strategy: k, v and the key segment
ids are gathered over `context`, and the block table is built for the whole sequence with one row block per shard
(the kernel's q_seq_shards), its query positions the load-balanced order, so every shard's queries see the keys they
would see on one device. The ring strategy would need a softmax state that crosses hops, which the kernel's
differentiable output lacks; the layout refuses it.

The kernel compiles for TPU only (`maxpar.core.layout.check_devices` refuses other devices). `interpret=True`, which
only the functions here take, runs the same kernel in Pallas's interpreter: the CPU tests hold it equal to
attention=dot_product that way.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.sharding import NamedSharding, PartitionSpec

from maxpar.core.axes import CONTEXT_AXIS
from maxpar.core.config import ModelConfig
from maxpar.core.layout import ContextLayout
from maxpar.model.context_parallel import sequence_layout

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SplashBlocks:
    """The kernel's query and key/value blocks, the same for its forward, dq and dkv kernels."""

    q: int
    kv: int

    def sizes(self) -> kernels.BlockSizes:
        return kernels.BlockSizes(block_q=self.q, block_kv=self.kv, block_kv_compute=self.kv, block_q_dkv=self.q,
                                  block_kv_dkv=self.kv, block_kv_dkv_compute=self.kv, block_q_dq=self.q,
                                  block_kv_dq=self.kv)


def splash_blocks(config: ModelConfig, queries: int, keys: int) -> SplashBlocks:
    """sa_block_q and sa_block_kv capped at the queries and keys one kernel call sees (the layout checked that
    they divide them)."""
    return SplashBlocks(q=min(config.sa_block_q, queries), kv=min(config.sa_block_kv, keys))


def visible_mask(q_positions: np.ndarray, length: int, window: int) -> masks.Mask:
    """[query row, key position] -> visible: causal, and within the `window` most recent positions when set.

    q_positions[r] is the sequence position of query row r (the load-balanced order under context parallelism);
    the kernel computes the mask in its blocks from these, so no [L, L] array is ever built.
    """
    shape = (len(q_positions), length)
    mask = masks.LocalMask(shape, window_size=(window - 1, 0), offset=0) if window else masks.CausalMask(shape)
    mask.q_sequence = np.asarray(q_positions, np.int32)
    return mask


def make_kernel(q_positions: np.ndarray, length: int, window: int, blocks: SplashBlocks, q_shards: int,
                interpret: bool) -> kernels.SplashAttentionKernel:
    """The kernel for queries at `q_positions` against `length` keys; its block table splits into `q_shards` row
    blocks (one per context shard). Every head has the same mask, so the table has one head."""
    mask = masks.MultiHeadMask((visible_mask(q_positions, length, window),))
    return kernels.make_splash_mha(mask, block_sizes=blocks.sizes(), head_shards=1, q_seq_shards=q_shards,
                                   interpret=interpret)


def run_kernel(kernel: kernels.SplashAttentionKernel, q: Array, k: Array, v: Array, q_segments: Array,
               kv_segments: Array) -> Array:
    """q [B, Lq, H, D] (pre-scaled), k [B, Lk, KV, D], v [B, Lk, KV, Dv], segment ids [B, Lq] and [B, Lk]
    -> [B, Lq, H, Dv]; the kernel takes one example, heads first."""
    def one(q, k, v, q_segments, kv_segments):
        return kernel(q, k, v, segment_ids=kernels.SegmentIds(q=q_segments, kv=kv_segments))

    heads_first = partial(jnp.swapaxes, axis1=1, axis2=2)
    return heads_first(jax.vmap(one)(heads_first(q), heads_first(k), heads_first(v), q_segments, kv_segments))


def splash_attention(q: Array, k: Array, v: Array, segment_ids: Array, window: int, blocks: SplashBlocks,
                     interpret: bool = False) -> Array:
    """The whole arrays on one device: q [B, L, H, D] (pre-scaled), k/v [B, L, KV, D | Dv] -> [B, L, H, Dv]."""
    length = q.shape[1]
    kernel = make_kernel(np.arange(length), length, window, blocks, q_shards=1, interpret=interpret)
    return run_kernel(kernel, q, k, v, segment_ids, segment_ids)


def gathered_keys(k: Array, v: Array, segments: Array, order: np.ndarray) -> tuple[Array, Array, Array]:
    """Inside shard_map: k, v and key segment ids of every context shard, gathered, in sequence order (the kernel
    takes a key's index for its position); `order` is the rows' load-balanced order."""
    gather = partial(jax.lax.all_gather, axis_name=CONTEXT_AXIS, axis=1, tiled=True)
    gathered = (gather(k), gather(v), gather(segments))
    if np.array_equal(order, np.arange(len(order))):
        return gathered
    inverse = jnp.asarray(np.argsort(order), jnp.int32)
    return tuple(jnp.take(x, inverse, axis=1) for x in gathered)


def sharded_splash_attention(q: Array, k: Array, v: Array, segment_ids: Array, window: int, blocks: SplashBlocks,
                             context: ContextLayout, interpret: bool = False) -> Array:
    """On the layout's mesh: the kernel per device under shard_map (batch and heads split as `context`'s specs say),
    with the all_gather strategy across `context` shards. Arrays and shapes as `splash_attention`'s."""
    length, degree = q.shape[1], context.degree
    order = sequence_layout(length, degree, context.load_balance)
    kernel = make_kernel(order, length, window, blocks, q_shards=degree, interpret=interpret)
    mesh = context.mesh.abstract()
    kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, PartitionSpec(None, context.q_spec[1])))

    def body(kernel, q, k, v, segments):
        keys = gathered_keys(k, v, segments, order) if degree > 1 else (k, v, segments)
        return run_kernel(kernel, q, *keys[:2], segments, keys[2])

    segment_spec = PartitionSpec(*context.q_spec[:2])
    # check_vma=False: the kernel's pallas_call declares no varying mesh axes for its outputs.
    return jax.shard_map(body, mesh=mesh, in_specs=(kernel_spec, context.q_spec, context.kv_spec, context.kv_spec,
                                                    segment_spec),
                         out_specs=context.q_spec, check_vma=False)(kernel, q, k, v, segment_ids)


def splash_core(q: Array, k: Array, v: Array, segment_ids: Array, window: int, config: ModelConfig,
                context: ContextLayout | None) -> Array:
    """attention=splash in the model: on the layout's mesh (`context`), or on the whole arrays (None: one device)."""
    length = q.shape[1]
    if context is None:
        return splash_attention(q, k, v, segment_ids, window, splash_blocks(config, length, length))
    return sharded_splash_attention(q, k, v, segment_ids, window,
                                    splash_blocks(config, length // context.degree, length), context)
