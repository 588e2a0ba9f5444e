"""Predicted collectives of the weights and their gradients, as the partitioner emits them around the matmuls.

- FSDP (a weight sharded over an axis that also shards the batch): all-gather
  the weight before use, in the forward pass and again in the backward pass
  (for the scanned or rematerialized layers; unscanned layers without remat,
  and top-level weights, are gathered once per step), and reduce-scatter its
  gradient.
- DP (a batch axis that does not shard the weight): all-reduce the gradient
  (after the FSDP reduce-scatter, on the smaller shard).
- A pipeline gathers its stage weights per iteration (their gradients reduce-scattered per
  iteration), or once per step with pipeline_fsdp_ag_once; reductions over the batch axes the
  loop runs per replica (`manual_batch_axes`) happen once per step, outside the loop.
- The token table's lookup gradient where it is not reduced like a matmul weight's
  (`lookup_gradient_reduction`; the lookup itself: `maxpar.plan.tensor_comms.lookup_comms`).

The experts' weights are moved by the MoE shard_map, not the partitioner: `maxpar.plan.moe_comms`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from maxpar.core.axes import Logical
from maxpar.model.mtp import MTP
from maxpar.model.roles import Block
from maxpar.plan.comms import (BACKWARD, FORWARD, Comm, StageLoop, fsdp_axes, hierarchical,
                               sequence_axes, stage_loop)
from maxpar.plan.tensors import Layout, Tensor
from maxpar.plan.model_math import dtype_bytes, regathers_in_backward, sequence_parallel


# ---------------------------------------------------------------- FSDP gathers

def _gather_chain(layout: Layout, pattern: str, groups: Iterable[tuple[str, ...]], size: float,
                  **kwargs) -> list[Comm]:
    """One all-gather per group of axes in turn, each on the previous one's output (the partitioner
    gathers one sharded dimension at a time, so each group is a collective of its own)."""
    comms: list[Comm] = []
    for axes in groups:
        if axes:
            comms += hierarchical(layout, pattern, axes, "all-gather", size, **kwargs)
            size *= layout.group_degree(axes)
    return comms


@dataclasses.dataclass(frozen=True)
class WeightMoves:
    """Over which axes, in which dtype and on how many bytes one weight's gathers and gradient reductions run."""

    tensor: Tensor
    elements: float                     # of its local shard
    dtype: str                          # gathered and reduced in
    size: float                         # bytes of its local shard in `dtype`
    gather: tuple[str, ...]             # FSDP: batch axes that shard it
    sequence: tuple[str, ...]           # TP-sequence axes its gradient sums partial results over
    sequence_gather: tuple[str, ...]    # of those, the ones that also split it (the vocab dim): gathered like FSDP
    full: float                         # bytes of its gradient before the reduce-scatter
    reduce: tuple[str, ...]             # DP: batch axes that do not shard it
    partial_gradients: int              # reduced one by one: a tied table's lookup and output projection, and each
                                        # MTP module's besides the main model's (they share the table and the head)


def weight_moves(layout: Layout, t: Tensor, loop: StageLoop) -> WeightMoves:
    """Matmul weights are cast to `dtype` before use, so gathers and gradient partial sums are in `dtype`; norm
    scales are used and differentiated in float32; the token table is gathered and looked up in its own dtype,
    and so are stage weights gathered once before a pipeline (before the cast to `dtype`)."""
    elements = layout.local_bytes(t) / dtype_bytes(t.dtype)
    dtype = {Block.NORM: "float32", Block.EMBEDDING: t.dtype}.get(t.block, layout.config.dtype)
    if loop.once and t.layered:
        dtype = t.dtype
    size = elements * dtype_bytes(dtype)
    gather = fsdp_axes(layout, t)
    sequence = sequence_axes(layout, t)
    # A vocab dim sharded over an axis that splits the tokens cannot shard the lookup or the logits (that axis
    # is taken by their length): the weight is gathered over it too, like FSDP.
    sequence_gather = tuple(a for a in sequence if a in t.axes)
    tied = t.block == Block.EMBEDDING and layout.config.logits_via_embedding
    heads = 1 + layout.config.mtp_num_layers if t.block in (Block.EMBEDDING, Block.OUTPUT) else 1
    return WeightMoves(tensor=t, elements=elements, dtype=dtype, size=size, gather=gather, sequence=sequence,
                       sequence_gather=sequence_gather, full=size * layout.group_degree(gather + sequence_gather),
                       reduce=layout.live(a for a in layout.weight_batch_axes(t) if a not in t.axes),
                       partial_gradients=(2 if tied else 1) * heads)


def stacked_weight_gathers(layout: Layout, w: WeightMoves, loop: StageLoop, microbatches: int) -> list[Comm]:
    """FSDP gathers of a per-layer weight: per layer run and pass (once in the forward pass where the backward
    pass keeps the gathered copy), or as a pipeline's fsdp gather option says."""
    if not w.gather:
        return []
    common = dict(scales=False, tensor=w.tensor.name)
    if loop.once:
        return hierarchical(layout, "FSDP stage-weight all-gather (once per step: pipeline_fsdp_ag_once)", w.gather,
                            "all-gather", w.size, count=1, phase=FORWARD, dtype=w.dtype, **common)
    if loop.per_repeat:
        # One window of M iterations per repeat gathers the blocks its stages run (two repeats' but in the
        # first and the last window): 2R blocks of 1/R of the stage's stack, in the weights' dtype, and again
        # in the backward pass (the window is rematerialized). Gradients: per iteration.
        block = w.elements / loop.repeats * dtype_bytes(w.tensor.dtype)
        return [c for phase in (FORWARD, BACKWARD)
                for c in hierarchical(layout, f"FSDP stage-block all-gather (per repeat, {phase})", w.gather,
                                      "all-gather", block, count=microbatches * 2 * loop.repeats, phase=phase,
                                      dtype=w.tensor.dtype, **common)]
    # Under TP-sequence the backward's gathers name their replica groups differently from the forward's (mesh
    # vs iota form), so XLA's CSE does not merge them even in unscanned layers.
    kept = not regathers_in_backward(layout.config) and not sequence_parallel(layout)
    return [c for phase in ((FORWARD,) if kept else (FORWARD, BACKWARD))
            for c in hierarchical(layout, f"FSDP weight all-gather ({phase})", w.gather, "all-gather", w.size,
                                  count=microbatches * loop.per_iteration, phase=phase, dtype=w.dtype, **common)]


def prefix_gathers(layout: Layout, w: WeightMoves, microbatches: int) -> list[Comm]:
    """A pipelined run's dense prefix (first_num_dense_layers): a layer scan of its own before the loop, gathered
    per pass like an unpipelined stack's weights."""
    if not w.gather:
        return []
    kept = not regathers_in_backward(layout.config) and not sequence_parallel(layout)
    return [c for phase in ((FORWARD,) if kept else (FORWARD, BACKWARD))
            for c in hierarchical(layout, f"FSDP dense-prefix weight all-gather ({phase})", w.gather, "all-gather",
                                  w.size, count=microbatches, phase=phase, dtype=w.dtype, scales=False,
                                  tensor=w.tensor.name)]


def top_level_gathers(layout: Layout, w: WeightMoves) -> list[Comm]:
    """Outside the layer scan the gathered weight is one array that the forward and the backward matmul share:
    one gather per step. The table's ("vocab", None) constraint gathers its embed shards first (none when the
    lookup runs on them and the logits do not use it); the output projection is gathered on its vocab dim first."""
    table = w.tensor.block == Block.EMBEDDING
    if not (w.gather or w.sequence_gather) or (table and not layout.table_gathered):
        return []
    order = (w.gather, w.sequence_gather) if table else (w.sequence_gather, w.gather)
    common = dict(dtype=w.dtype, scales=False, tensor=w.tensor.name)
    comms = _gather_chain(layout, "FSDP weight all-gather (once per step)", order, w.size, count=1, phase=FORWARD,
                          **common)
    if _regathered_mtp_layer(layout, w.tensor):
        comms += _gather_chain(layout, "FSDP MTP-layer weight all-gather (backward, rematerialized)", order, w.size,
                               count=1, phase=BACKWARD, **common)
    return comms


def _regathered_mtp_layer(layout: Layout, t: Tensor) -> bool:
    """An MTP module's layer, rematerialized with prevent_cse (unscanned layers): its backward pass gathers its
    weights again (with a scanned stack, XLA merges the re-run's gathers with the forward's)."""
    config = layout.config
    return (config.remat_policy != "none" and not config.scan_layers and t.name.startswith(f"{MTP}/")
            and "/layer/" in t.name)


# ---------------------------------------------------------------- gradient reductions

def _gradient(w: WeightMoves) -> dict:
    return dict(phase=BACKWARD, dtype=w.dtype, scales=False, tensor=w.tensor.name)


def in_weight_dtype(w: WeightMoves) -> WeightMoves:
    """A weight's gradient as the batch axes reduce it: in the weight's own dtype. The matmul's partial product
    is in the compute dtype, but the cast back to the weight's dtype comes first: XLA:TPU reduce-scatters (its
    collective matmuls accumulate the partial sums) and all-reduces float32 gradients of float32 weights
    (llama3-8b FSDP(8) on v5p compiled by libtpu 0.0.50.1)."""
    scale = dtype_bytes(w.tensor.dtype) / dtype_bytes(w.dtype)
    return dataclasses.replace(w, dtype=w.tensor.dtype, size=w.size * scale, full=w.full * scale)


def sequence_gradient_reduction(layout: Layout, w: WeightMoves, microbatches: int) -> list[Comm]:
    """A weight applied to sequence shards sums their partial gradients: the partitioner all-reduces the whole
    gradient over them, separately from (and before) the batch axes' reduction."""
    return hierarchical(layout, "sequence-parallel gradient all-reduce", w.sequence, "all-reduce", w.full,
                        count=microbatches * w.partial_gradients, **_gradient(w))


def lookup_gradient_reduction(layout: Layout, w: WeightMoves, microbatches: int) -> list[Comm] | None:
    """The token lookup's gradient where it is not reduced like a matmul weight's (None: it is).

    On the table's embed shards each shard looked up every token of its batch group: only the other batch axes
    sum it. Else, under FSDP, the lookup's gradient is a scatter-add of the looked-up rows, unreduced on every
    batch shard; the partitioner sums it over all batch axes at once and keeps its FSDP slice. Context shards hold
    other tokens of the same rows: their partial sums are reduced first, on their own.
    """
    if w.tensor.block != Block.EMBEDDING:
        return None
    if layout.lookup_on_shards:
        return hierarchical(layout, "DP gradient all-reduce", w.reduce, "all-reduce", w.size, count=microbatches,
                            **_gradient(w))
    context = tuple(a for a in w.gather if a in layout.context_axes)
    if not w.gather or not (w.reduce or context):
        return None
    return [c for group in context_first(layout, w.gather + w.reduce)
            for c in hierarchical(layout, "DP+FSDP gradient all-reduce", group, "all-reduce", w.full,
                                  count=microbatches, **_gradient(w))]


def context_first(layout: Layout, axes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A gradient summed over context shards and other batch shards: the partitioner reduces the context shards'
    partial sums (other tokens of the same rows) first, on their own, then the rest."""
    axes = layout.live(axes)
    return (tuple(a for a in axes if a in layout.context_axes), tuple(a for a in axes if a not in layout.context_axes))


def matmul_gradient_reduction(layout: Layout, w: WeightMoves, loop: StageLoop, microbatches: int,
                              pieces: int) -> list[Comm]:
    """FSDP reduce-scatter of the gradient onto the weight's shards, then DP all-reduce of the shard (a pipeline
    reduces a stacked weight's per iteration over the axes it does not run per replica). `pieces`: partial
    gradients reduced one by one (a tied table's two: the partitioner reduces each where it is made)."""
    w = in_weight_dtype(w)
    t, grad = w.tensor, _gradient(w)
    looped = microbatches * (loop.per_iteration if t.layered and not loop.once else 1.0)
    comms = hierarchical(layout, "FSDP gradient reduce-scatter", w.gather, "reduce-scatter", w.full,
                         count=looped * pieces, **grad)
    reduce = w.reduce
    if loop.pipelined and t.layered:  # inside the loop over the axes it does not run per replica
        inner = tuple(a for a in reduce if a not in loop.manual)
        comms += hierarchical(layout, "DP gradient all-reduce (per pipeline iteration)", inner, "all-reduce",
                              w.size, count=microbatches * loop.per_iteration, **grad)
        reduce = tuple(a for a in reduce if a in loop.manual)
    return comms + [c for group in context_first(layout, reduce)
                    for c in hierarchical(layout, "DP gradient all-reduce", group, "all-reduce", w.size,
                                          count=microbatches * pieces, **grad)]


def weight_comms(layout: Layout, microbatches: int) -> list[Comm]:
    """FSDP all-gathers and the gradient reduce-scatters / all-reduces of every weight but the experts' (moved by
    the MoE shard_map, not the partitioner: maxpar.plan.moe_comms)."""
    loop = stage_loop(layout)
    comms: list[Comm] = []
    for t in layout.params():
        if t.block == Block.EXPERTS:
            continue
        w = weight_moves(layout, t, loop)
        comms += (stacked_weight_gathers(layout, w, loop, microbatches) if t.layered
                  else prefix_gathers(layout, w, microbatches) if Logical.DENSE_LAYERS in t.logical
                  else top_level_gathers(layout, w))
        comms += sequence_gradient_reduction(layout, w, microbatches)
        lookups = 1 + layout.config.mtp_num_layers  # the main model's and each MTP module's
        lookup = lookup_gradient_reduction(layout, w, microbatches * lookups)
        comms += lookup or []
        comms += matmul_gradient_reduction(layout, w, loop, microbatches,
                                           w.partial_gradients - (lookups if lookup is not None else 0))
    return comms
