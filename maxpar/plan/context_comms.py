"""Predicted collectives of context-parallel attention, as `maxpar.model.context_parallel` (and, for the
all_gather strategy, `maxpar.model.splash`) writes them.

Attention runs in a `jax.shard_map`, so these are the collectives written there, per layer
and microbatch:

- all_gather: forward, k and v (dtype) and the key segment ids (int32) all-gathered over
  `context`, again in the backward pass under remat (not an MTP module's layer when the stack
  is scanned: its remat lets XLA merge them with the forward's, `prevent_cse`); backward, dk
  and dv reduce-scattered back (the gather's transpose). The seed's 4·B·T·KV·D bytes per layer
  is the bf16 k and v a device receives. Under attention_type=mla what moves is the per-head
  k [qk_nope + qk_rope] and v [v_head_dim] expanded from the latent (`maxpar.model.mla`), not
  the latent: H heads of each, split like q's heads.
- ring: forward, C - 1 hops, each a collective-permute of the local k, v and segment ids;
  backward, k, v, segment ids go round again (C - 1 hops) and the float32 dk, dv travel
  beside them for C hops (the last brings them home). The forward's hops sit in the ring's
  custom VJP, whose residuals remat keeps rather than re-running them. A layer outside a scan
  (an MTP module's, unscanned layers) without remat, or with the remat that lets XLA merge
  (an MTP module's when the stack is scanned), reuses its forward's hops in the backward pass.

Every layer run counts: the stack's and each multi-token prediction module's.
The weights' `embed` dim is sharded over `context` like FSDP; those gathers and gradient
reduce-scatters come from `maxpar.plan.weight_comms` like any other weight axis.
"""

from __future__ import annotations

import dataclasses

from maxpar.core.config import BLOCK_ATTENTION
from maxpar.plan.comms import BACKWARD, FORWARD, Comm, hierarchical
from maxpar.plan.tensors import Layout
from maxpar.plan.model_math import dtype_bytes, kv_widths, layer_split, regathers_in_backward, tp_degrees


def cp_intensity(seq_len: int, query_heads: int, kv_heads: int, degree: int) -> float:
    """The seed's arithmetic intensity of the k/v all-gather: seq_len x query_heads / (kv_heads x |CP|)."""
    return seq_len * query_heads / (kv_heads * degree)


@dataclasses.dataclass(frozen=True)
class ContextTraffic:
    """What a context shard's attention moves per layer run: its k, v and key segment ids, over `axes`."""

    axes: tuple[str, ...]
    degree: int
    k_bytes: float
    v_bytes: float
    seg_bytes: float
    count: float                        # layer runs per step
    regathered: float                   # all_gather: layer runs whose gathers remat runs again
    resent: float                       # ring: layer runs whose backward pass sends k, v round again
    dtype: str


def all_gather_comms(layout: Layout, cp: ContextTraffic) -> list[Comm]:
    """all_gather: k, v and the key segment ids gathered per forward pass; dk, dv reduce-scattered back."""
    common = dict(dtype=cp.dtype, scales=True)
    comms: list[Comm] = []
    for what, size in (("k", cp.k_bytes), ("v", cp.v_bytes)):
        comms += hierarchical(layout, f"CP {what} all-gather (forward)", cp.axes, "all-gather", size,
                              count=cp.count + cp.regathered, phase=FORWARD, **common)
        # the gather's transpose, written in the shard_map: XLA:CPU keeps it a reduce-scatter
        comms += [dataclasses.replace(c, explicit=True) for c in hierarchical(
            layout, f"CP d{what} reduce-scatter (backward)", cp.axes, "reduce-scatter", size * cp.degree,
            count=cp.count, phase=BACKWARD, **common)]
    return comms + hierarchical(layout, "CP key segment ids all-gather (forward)", cp.axes, "all-gather",
                                cp.seg_bytes, count=cp.count + cp.regathered, phase=FORWARD, dtype="int32",
                                scales=True)


def ring_comms(layout: Layout, cp: ContextTraffic) -> list[Comm]:
    """ring: C - 1 hops of k, v and segment ids per pass; the float32 dk, dv travel C hops in the backward pass."""
    hops = cp.degree - 1
    comms: list[Comm] = []
    for what, size, dtype in (("k", cp.k_bytes, cp.dtype), ("v", cp.v_bytes, cp.dtype),
                              ("segment ids", cp.seg_bytes, "int32")):
        comms += hierarchical(layout, f"CP ring {what} collective-permute (forward)", cp.axes,
                              "collective-permute", size, count=cp.count * hops, phase=FORWARD,
                              dtype=dtype, scales=True)
        comms += hierarchical(layout, f"CP ring {what} collective-permute (backward)", cp.axes,
                              "collective-permute", size, count=cp.resent * hops, phase=BACKWARD, dtype=dtype,
                              scales=True)
    for what, size in (("dk", cp.k_bytes), ("dv", cp.v_bytes)):  # in float32
        comms += hierarchical(layout, f"CP ring {what} collective-permute (backward)", cp.axes,
                              "collective-permute", size / dtype_bytes(cp.dtype) * 4, count=cp.count * cp.degree,
                              phase=BACKWARD, dtype="float32", scales=True)
    return comms


def predict_context_comms(layout: Layout, tokens_per_shard: float, microbatches: int) -> list[Comm]:
    """Every context-parallel attention collective of one step (tokens_per_shard: one microbatch's
    tokens per batch shard, all context shards together)."""
    config = layout.config
    degree = layout.context_degree
    if degree == 1 or config.attention not in BLOCK_ATTENTION:
        return []
    local_tokens = tokens_per_shard / degree
    k_width, v_width = kv_widths(config, tp_degrees(layout))
    stack = config.num_decoder_layers / layer_split(layout) * microbatches
    mtp = config.mtp_num_layers * microbatches  # each module's layer, unscanned
    remat = config.remat_policy != "none"
    mtp_rerun = mtp if remat and not config.scan_layers else 0.0  # else XLA merges the re-run with the forward
    cp = ContextTraffic(axes=layout.context_axes, degree=degree,
                        k_bytes=local_tokens * k_width * dtype_bytes(config.dtype),
                        v_bytes=local_tokens * v_width * dtype_bytes(config.dtype),
                        seg_bytes=local_tokens * 4, count=stack + mtp,
                        regathered=(stack if remat else 0.0) + mtp_rerun,
                        resent=(stack if regathers_in_backward(config) else 0.0) + mtp_rerun, dtype=config.dtype)
    return (all_gather_comms if config.context_parallel_strategy == "all_gather" else ring_comms)(layout, cp)
