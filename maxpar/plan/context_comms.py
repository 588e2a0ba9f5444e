"""Predicted collectives of context-parallel attention, as `maxpar.model.context_parallel` writes them.

Attention runs in a `jax.shard_map`, so these are the collectives written there, per layer
and microbatch (remat re-runs the forward ones in the backward pass):

- all_gather: forward, k and v (dtype) and the key segment ids (int32) all-gathered over
  `context`; backward, dk and dv reduce-scattered back (the gather's transpose). The seed's
  4·B·T·KV·D bytes per layer is the bf16 k and v a device receives.
- ring: forward, C - 1 hops, each a collective-permute of the local k, v and segment ids;
  backward, k, v, segment ids go round again (C - 1 hops) and the float32 dk, dv travel
  beside them for C hops (the last brings them home).

The weights' `embed` dim is sharded over `context` like FSDP; those gathers and gradient
reduce-scatters come from `maxpar.plan.weight_comms` like any other weight axis.
"""

from __future__ import annotations

import dataclasses

from maxpar.plan.comms import BACKWARD, FORWARD, Comm, hierarchical
from maxpar.plan.layout import Layout
from maxpar.plan.model_math import dtype_bytes, layer_split, tp_degrees


def cp_intensity(seq_len: int, query_heads: int, kv_heads: int, degree: int) -> float:
    """The seed's arithmetic intensity of the k/v all-gather: seq_len x query_heads / (kv_heads x |CP|)."""
    return seq_len * query_heads / (kv_heads * degree)


@dataclasses.dataclass(frozen=True)
class ContextTraffic:
    """What a context shard's attention moves per layer run: its k (or v) and key segment ids, over `axes`."""

    axes: tuple[str, ...]
    degree: int
    kv_bytes: float                     # one of k, v
    seg_bytes: float
    count: float                        # layer runs per step
    forwards: int                       # forward passes per layer run (2: remat re-runs it in the backward pass)
    dtype: str


def all_gather_comms(layout: Layout, cp: ContextTraffic) -> list[Comm]:
    """all_gather: k, v and the key segment ids gathered per forward pass; dk, dv reduce-scattered back."""
    common = dict(dtype=cp.dtype, scales=True)
    comms: list[Comm] = []
    for what in ("k", "v"):
        comms += hierarchical(layout, f"CP {what} all-gather (forward)", cp.axes, "all-gather", cp.kv_bytes,
                              count=cp.count * cp.forwards, phase=FORWARD, **common)
        # the gather's transpose, written in the shard_map: XLA:CPU keeps it a reduce-scatter
        comms += [dataclasses.replace(c, explicit=True) for c in hierarchical(
            layout, f"CP d{what} reduce-scatter (backward)", cp.axes, "reduce-scatter", cp.kv_bytes * cp.degree,
            count=cp.count, phase=BACKWARD, **common)]
    return comms + hierarchical(layout, "CP key segment ids all-gather (forward)", cp.axes, "all-gather",
                                cp.seg_bytes, count=cp.count * cp.forwards, phase=FORWARD, dtype="int32",
                                scales=True)


def ring_comms(layout: Layout, cp: ContextTraffic) -> list[Comm]:
    """ring: C - 1 hops of k, v and segment ids per pass; the float32 dk, dv travel C hops in the backward pass."""
    hops = cp.degree - 1
    comms: list[Comm] = []
    for what, size, dtype in (("k", cp.kv_bytes, cp.dtype), ("v", cp.kv_bytes, cp.dtype),
                              ("segment ids", cp.seg_bytes, "int32")):
        comms += hierarchical(layout, f"CP ring {what} collective-permute (forward)", cp.axes,
                              "collective-permute", size, count=cp.count * hops * cp.forwards, phase=FORWARD,
                              dtype=dtype, scales=True)
        comms += hierarchical(layout, f"CP ring {what} collective-permute (backward)", cp.axes,
                              "collective-permute", size, count=cp.count * hops, phase=BACKWARD, dtype=dtype,
                              scales=True)
    grad = cp.kv_bytes / dtype_bytes(cp.dtype) * 4  # float32 dk, dv
    for what in ("dk", "dv"):
        comms += hierarchical(layout, f"CP ring {what} collective-permute (backward)", cp.axes,
                              "collective-permute", grad, count=cp.count * cp.degree, phase=BACKWARD,
                              dtype="float32", scales=True)
    return comms


def predict_context_comms(layout: Layout, tokens_per_shard: float, microbatches: int) -> list[Comm]:
    """Every context-parallel attention collective of one step (tokens_per_shard: one microbatch's
    tokens per batch shard, all context shards together)."""
    config = layout.config
    degree = layout.context_degree
    if degree == 1 or config.attention != "blockwise":
        return []
    local_tokens = tokens_per_shard / degree
    kv_split = tp_degrees(layout)["kv_heads"]
    cp = ContextTraffic(axes=layout.context_axes, degree=degree,
                        kv_bytes=local_tokens * config.num_kv_heads / kv_split * config.head_dim
                        * dtype_bytes(config.dtype),
                        seg_bytes=local_tokens * 4,
                        count=config.num_decoder_layers / layer_split(layout) * microbatches,
                        forwards=1 if config.remat_policy == "none" else 2, dtype=config.dtype)
    return (all_gather_comms if config.context_parallel_strategy == "all_gather" else ring_comms)(layout, cp)
