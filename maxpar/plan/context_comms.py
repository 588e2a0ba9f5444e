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
reduce-scatters come from `maxpar.plan.comms.weight_comms` like any other weight axis.
"""

from __future__ import annotations

import dataclasses

from maxpar.axes import CONTEXT_AXIS
from maxpar.plan.comms import BACKWARD, FORWARD, Comm, hierarchical
from maxpar.plan.layout import Layout
from maxpar.plan.model_math import context_degree, dtype_bytes, layer_split, tp_degrees


def cp_intensity(seq_len: int, query_heads: int, kv_heads: int, degree: int) -> float:
    """The seed's arithmetic intensity of the k/v all-gather: seq_len x query_heads / (kv_heads x |CP|)."""
    return seq_len * query_heads / (kv_heads * degree)


def predict_context_comms(layout: Layout, tokens_per_shard: float, microbatches: int) -> list[Comm]:
    """Every context-parallel attention collective of one step (tokens_per_shard: one microbatch's
    tokens per batch shard, all context shards together)."""
    config = layout.config
    degree = context_degree(layout)
    if degree == 1 or config.attention != "blockwise":
        return []
    tp = tp_degrees(layout)
    local_tokens = tokens_per_shard / degree
    a = dtype_bytes(config.dtype)
    kv_bytes = local_tokens * config.num_kv_heads / tp["kv_heads"] * config.head_dim * a  # one of k, v
    seg_bytes = local_tokens * 4
    layers = config.num_decoder_layers / layer_split(layout)
    forwards = 1 if config.remat_policy == "none" else 2
    count = layers * microbatches
    common = dict(dtype=config.dtype, scales=True)
    comms: list[Comm] = []
    if config.context_parallel_strategy == "all_gather":
        for what, size in (("k", kv_bytes), ("v", kv_bytes)):
            comms += hierarchical(layout, f"CP {what} all-gather (forward)", (CONTEXT_AXIS,), "all-gather", size,
                                  count=count * forwards, phase=FORWARD, **common)
            # the gather's transpose, written in the shard_map: XLA:CPU keeps it a reduce-scatter
            comms += [dataclasses.replace(c, explicit=True) for c in hierarchical(
                layout, f"CP d{what} reduce-scatter (backward)", (CONTEXT_AXIS,), "reduce-scatter", size * degree,
                count=count, phase=BACKWARD, **common)]
        comms += hierarchical(layout, "CP key segment ids all-gather (forward)", (CONTEXT_AXIS,), "all-gather",
                              seg_bytes, count=count * forwards, phase=FORWARD, dtype="int32", scales=True)
        return comms
    hops = degree - 1
    for what, size, dtype in (("k", kv_bytes, config.dtype), ("v", kv_bytes, config.dtype),
                              ("segment ids", seg_bytes, "int32")):
        comms += hierarchical(layout, f"CP ring {what} collective-permute (forward)", (CONTEXT_AXIS,),
                              "collective-permute", size, count=count * hops * forwards, phase=FORWARD, dtype=dtype,
                              scales=True)
        comms += hierarchical(layout, f"CP ring {what} collective-permute (backward)", (CONTEXT_AXIS,),
                              "collective-permute", size, count=count * hops, phase=BACKWARD, dtype=dtype, scales=True)
    grad = kv_bytes / a * 4  # float32 dk, dv
    for what in ("dk", "dv"):
        comms += hierarchical(layout, f"CP ring {what} collective-permute (backward)", (CONTEXT_AXIS,),
                              "collective-permute", grad, count=count * degree, phase=BACKWARD, dtype="float32",
                              scales=True)
    return comms
