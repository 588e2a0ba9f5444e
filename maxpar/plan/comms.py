"""Predicted collectives of one training step, per mesh axis, following the seeds' strategies.

Each rule below is one row of the seeds' tables, applied to every weight of the
real model through its shardings (a `Layout`), not to a two-matrix caricature:

- FSDP (a weight sharded over an axis that also shards the batch): all-gather
  the weight before use, in the forward pass and again in the backward pass
  (for the scanned or rematerialized layers; unscanned layers without remat,
  and top-level weights, are gathered once per step), and reduce-scatter its
  gradient.
- DP (a batch axis that does not shard the weight): all-reduce the gradient
  (after the FSDP reduce-scatter, on the smaller shard).
- TP, Megatron style (a non-batch axis sharding heads / mlp / vocab): per layer,
  all-reduce the block output in the forward pass and the block input's
  gradient in the backward pass (all-gather + reduce-scatter of the same bytes
  when the residual stream is sequence-sharded); the vocab-sharded loss reduces
  its max / sum / label logit over that axis.
- The token-embedding lookup: a table split on embed over batch axes only (FSDP)
  is looked up on its shards: the token ids are gathered, each shard looks up
  every token's slice and an all-to-all moves the rows to their batch shards (and
  their gradient back), so the lookup's gradient needs no FSDP reduction. Any
  other table has its embed shards gathered first (an FSDP gather, once per
  step); a vocab-sharded one looks up its own rows and all-reduces them.
- PP (`stage`), as maxpar.pipeline.spmd runs it: per iteration of the
  M x R + S - 1, one collective-permute of a pipeline microbatch's activations to
  the next stage in the forward pass and one back in the backward pass; once per
  step the pipeline output is all-reduced to every stage (the loss head runs on
  each) and the input gradient summed over the stages. Layers run every
  iteration, bubble included, on 1/M of the batch: per-layer TP collectives
  scale by 1 / (1 - bubble). Stage weights are gathered per iteration (their
  gradients reduce-scattered per iteration), or once per step with
  pipeline_fsdp_ag_once; reductions over the batch axes the loop runs per
  replica (`manual_batch_axes`) happen once per step, outside the loop.
- Multi-slice: a collective over an axis with a DCN degree is hierarchical:
  reduce-scatter over ICI, all-reduce across DCN on the shard, all-gather back.

Bytes are what one device sends with bandwidth-optimal ring algorithms
(`maxpar.plan.hlo.wire_bytes`), the same formula `--verify` applies to the
compiled program.

Each strategy is a small rule below, reading weights by their role (`maxpar.model.roles`)
and axes from the layout: FSDP gathers (`stacked_weight_gathers`, `top_level_gathers`),
gradient reductions (`sequence_gradient_reduction`, `lookup_gradient_reduction`,
`matmul_gradient_reduction`), ZeRO-1 (`zero_comms`), TP (`attention_tp_comms`,
`mlp_tp_comms`, `loss_tp_comms`, `tp_transpose_comms`, `sequence_input_comms`), PP
(`pipeline_comms`) and the token lookup (`lookup_comms`); EP is `maxpar.plan.moe_comms`'s,
CP's k/v traffic `maxpar.plan.context_comms`'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from maxpar.core.axes import Logical
from maxpar.core.config import Config
from maxpar.model.roles import Block, ParamRole
from maxpar.plan.hlo import wire_bytes
from maxpar.plan.layout import Layout, Tensor
from maxpar.plan.model_math import dtype_bytes, layer_split, regathers_in_backward, sequence_parallel, tp_degrees

FORWARD, BACKWARD = "forward", "backward"


@dataclasses.dataclass(frozen=True)
class Comm:
    """One collective pattern on one mesh-axis group and network, summed over a step."""

    pattern: str
    axes: tuple[str, ...]        # mesh axes of the replica group
    network: str                 # ici | dcn
    collective: str              # all-gather | reduce-scatter | all-reduce | all-to-all | collective-permute
    phase: str                   # forward | backward: the compute it can overlap with
    dtype: str
    operand_bytes: float         # per device per execution
    group_size: int
    count: float                 # executions per step
    scales_with_batch: bool      # activations (True) or weights/gradients (False)
    cpu_parts: int = 1           # partial sums XLA:CPU reduces one by one (it has no AllReduceReassociate)
    tensor: str = ""             # the weight it moves, for per-weight patterns
    explicit: bool = False       # written in a shard_map (psum_scatter): XLA:CPU keeps it a reduce-scatter

    @property
    def axis(self) -> str:
        return "+".join(self.axes)

    @property
    def bytes_per_device(self) -> float:
        return wire_bytes(self.collective, self.operand_bytes, self.group_size) * self.count


def _levels(layout: Layout, axes: tuple[str, ...]) -> tuple[int, int]:
    return (math.prod(layout.ici(a) for a in axes), math.prod(layout.dcn(a) for a in axes))


def hierarchical(layout: Layout, pattern: str, axes: Iterable[str], collective: str, operand_bytes: float, *,
                 count: float, phase: str, dtype: str, scales: bool, cpu_parts: int = 1,
                 tensor: str = "") -> list[Comm]:
    """One logical collective split into its ICI and DCN parts (XLA's hierarchical collectives)."""
    axes = layout.live(axes)
    if not axes or operand_bytes <= 0 or count <= 0:
        return []
    ici, dcn = _levels(layout, axes)
    ici_axes = tuple(a for a in axes if layout.ici(a) > 1)
    dcn_axes = tuple(a for a in axes if layout.dcn(a) > 1)
    common = dict(pattern=pattern, collective=collective, phase=phase, dtype=dtype, count=count,
                  scales_with_batch=scales, cpu_parts=cpu_parts, tensor=tensor)
    parts: list[tuple[str, tuple[str, ...], float, int]] = []
    if collective == "all-gather":          # across DCN first (small), then ICI (operand x dcn)
        parts = [("dcn", dcn_axes, operand_bytes, dcn), ("ici", ici_axes, operand_bytes * dcn, ici)]
    elif collective in ("reduce-scatter", "all-reduce"):  # ICI first, then DCN on the 1/ici shard
        parts = [("ici", ici_axes, operand_bytes, ici), ("dcn", dcn_axes, operand_bytes / ici, dcn)]
    elif collective == "all-to-all":
        parts = [("ici", ici_axes, operand_bytes / dcn, ici), ("dcn", dcn_axes, operand_bytes, dcn)]
    elif collective == "collective-permute":
        parts = [("dcn" if dcn > 1 else "ici", axes, operand_bytes, 2)]
    return [Comm(axes=group_axes, network=network, operand_bytes=size, group_size=n, **common)
            for network, group_axes, size, n in parts if n > 1]


def _degree(layout: Layout, axes: Iterable[str]) -> int:
    return math.prod(layout.degree(a) for a in axes)


# ---------------------------------------------------------------- which axes a weight's collectives run over

def _fsdp_axes(layout: Layout, tensor: Tensor) -> tuple[str, ...]:
    """Axes that shard both this weight and the batch: the weight must be gathered."""
    return layout.live(a for a in tensor.axes if a in layout.weight_batch_axes(tensor))


def _tp_axes(layout: Layout, tensor: Tensor | None, logical: str) -> tuple[str, ...]:
    """Non-batch axes sharding one feature dim of a weight: activations move over them. Not the context axes:
    context parallelism gathers the weights it shards, like FSDP."""
    if tensor is None:
        return ()
    return layout.live(a for a in tensor.dim_axes(logical)
                       if a not in layout.batch_axes and a not in layout.context_axes)


def _residual_split_axes(layout: Layout, dims: Iterable[int]) -> tuple[str, ...]:
    """Non-batch, non-context axes splitting these dims of the residual stream [batch, length, embed]: TP-sequence
    (length) or TP-transpose (embed)."""
    excluded = layout.batch_axes + layout.context_axes
    return layout.live(a for d in dims for a in layout.residual_axes[d] if a not in excluded)


def _sequence_axes(layout: Layout, tensor: Tensor) -> tuple[str, ...]:
    """Non-batch axes splitting the tokens a weight is applied to (TP-sequence: the residual stream's length).

    Only the norm scales, the token table and the output projection see the residual stream itself; the
    attention and MLP weights see activations whose length stays whole (activation_attn_length, _mlp_length).
    """
    if tensor.block not in (Block.NORM, Block.EMBEDDING, Block.OUTPUT):
        return ()
    return _residual_split_axes(layout, (1,))


def _gather_chain(layout: Layout, pattern: str, groups: Iterable[tuple[str, ...]], size: float,
                  **kwargs) -> list[Comm]:
    """One all-gather per group of axes in turn, each on the previous one's output (the partitioner
    gathers one sharded dimension at a time, so each group is a collective of its own)."""
    comms: list[Comm] = []
    for axes in groups:
        if axes:
            comms += hierarchical(layout, pattern, axes, "all-gather", size, **kwargs)
            size *= _degree(layout, axes)
    return comms


# ---------------------------------------------------------------- weights: FSDP gathers, gradient reductions

@dataclasses.dataclass(frozen=True)
class StageLoop:
    """How often a step gathers a stacked weight and reduces its gradient. A pipeline gathers a stage's stacked
    weights one block (1/R of them) per iteration in each pass and reduces their gradient per iteration over the
    batch axes it does not run per replica (`manual`: once per step); with pipeline_fsdp_ag_once it gathers
    them once per step (hoisted out of gradient accumulation too), with pipeline_fsdp_ag_per_repeat once per
    window of iterations. Without a pipeline: once per microbatch."""

    per_iteration: float = 1.0          # gathers / reductions of a stacked weight per microbatch
    once: bool = False
    per_repeat: bool = False
    manual: tuple[str, ...] = ()
    repeats: int = 1
    pipelined: bool = False


def stage_loop(layout: Layout) -> StageLoop:
    pipe = layout.pipeline
    if pipe is None:
        return StageLoop()
    return StageLoop(per_iteration=pipe.num_iterations / pipe.num_repeats, once=layout.config.pipeline_fsdp_ag_once,
                     per_repeat=layout.config.pipeline_fsdp_ag_per_repeat, manual=layout.pipeline_manual_axes,
                     repeats=pipe.num_repeats, pipelined=True)


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
    partial_gradients: int              # 2 for a tied table (the lookup's and the output projection's), else 1


def weight_moves(layout: Layout, t: Tensor, loop: StageLoop) -> WeightMoves:
    """Matmul weights are cast to `dtype` before use, so gathers and gradient partial sums are in `dtype`; norm
    scales are used and differentiated in float32; the token table is gathered and looked up in its own dtype,
    and so are stage weights gathered once before a pipeline (before the cast to `dtype`)."""
    elements = layout.local_bytes(t) / dtype_bytes(t.dtype)
    dtype = {Block.NORM: "float32", Block.EMBEDDING: t.dtype}.get(t.block, layout.config.dtype)
    if loop.once and t.layered:
        dtype = t.dtype
    size = elements * dtype_bytes(dtype)
    gather = _fsdp_axes(layout, t)
    sequence = _sequence_axes(layout, t)
    # A vocab dim sharded over an axis that splits the tokens cannot shard the lookup or the logits (that axis
    # is taken by their length): the weight is gathered over it too, like FSDP.
    sequence_gather = tuple(a for a in sequence if a in t.axes)
    tied = t.block == Block.EMBEDDING and layout.config.logits_via_embedding
    return WeightMoves(tensor=t, elements=elements, dtype=dtype, size=size, gather=gather, sequence=sequence,
                       sequence_gather=sequence_gather, full=size * _degree(layout, gather + sequence_gather),
                       reduce=layout.live(a for a in layout.weight_batch_axes(t) if a not in t.axes),
                       partial_gradients=2 if tied else 1)


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


def top_level_gathers(layout: Layout, w: WeightMoves) -> list[Comm]:
    """Outside the layer scan the gathered weight is one array that the forward and the backward matmul share:
    one gather per step. The table's ("vocab", None) constraint gathers its embed shards first (none when the
    lookup runs on them and the logits do not use it); the output projection is gathered on its vocab dim first."""
    table = w.tensor.block == Block.EMBEDDING
    if not (w.gather or w.sequence_gather) or (table and not layout.table_gathered):
        return []
    order = (w.gather, w.sequence_gather) if table else (w.sequence_gather, w.gather)
    return _gather_chain(layout, "FSDP weight all-gather (once per step)", order, w.size, count=1, phase=FORWARD,
                         dtype=w.dtype, scales=False, tensor=w.tensor.name)


def _gradient(w: WeightMoves) -> dict:
    return dict(phase=BACKWARD, dtype=w.dtype, scales=False, tensor=w.tensor.name)


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
    axes = layout.live(w.gather + w.reduce)
    groups = (tuple(a for a in axes if a in layout.context_axes), tuple(a for a in axes if a not in layout.context_axes))
    return [c for group in groups for c in hierarchical(layout, "DP+FSDP gradient all-reduce", group, "all-reduce",
                                                        w.full, count=microbatches, **_gradient(w))]


def matmul_gradient_reduction(layout: Layout, w: WeightMoves, loop: StageLoop, microbatches: int,
                              pieces: int) -> list[Comm]:
    """FSDP reduce-scatter of the gradient onto the weight's shards, then DP all-reduce of the shard (a pipeline
    reduces a stacked weight's per iteration over the axes it does not run per replica). `pieces`: partial
    gradients reduced one by one (a tied table's two: the partitioner reduces each where it is made)."""
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
    return comms + hierarchical(layout, "DP gradient all-reduce", reduce, "all-reduce", w.size,
                                count=microbatches * pieces, **grad)


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
                  else top_level_gathers(layout, w))
        comms += sequence_gradient_reduction(layout, w, microbatches)
        lookup = lookup_gradient_reduction(layout, w, microbatches)
        comms += lookup or []
        comms += matmul_gradient_reduction(layout, w, loop, microbatches,
                                           w.partial_gradients - (lookup is not None))
    return comms


# ---------------------------------------------------------------- ZeRO-1

def zero_comms(layout: Layout, comms: list[Comm]) -> list[Comm]:
    """`comms` under shard_optimizer_over_data (ZeRO-1): each replica updates only its data shard of a
    parameter, so the gradient is reduce-scattered over `data` instead of all-reduced (the same bytes as
    DP's all-reduce, with the updated parameters' all-gather), as the partitioner emits it:

    - a gradient all-reduced over `data` alone becomes a reduce-scatter;
    - a top-level weight's FSDP reduce-scatter and its `data` all-reduce become one reduce-scatter over
      both (its whole gradient is summed over every batch axis at once);
    - a gradient summed over `data` and other axes together (norm scales, the token table's lookup) stays
      an all-reduce, sliced after;
    - every parameter whose moments `data` splits is all-gathered over it once per step, in its dtype.
    """
    if not layout.config.shard_optimizer_over_data:
        return comms
    by_name = {t.name: t for t in layout.params()}
    zero_axes = {name: _zero_axes(layout, t) for name, t in by_name.items()}
    out: list[Comm] = []
    merged: set[str] = set()
    for c in comms:
        t = by_name.get(c.tensor)
        zero = zero_axes.get(c.tensor, ())
        if not zero or c.phase != BACKWARD or c.collective not in ("all-reduce", "reduce-scatter"):
            out.append(c)
        elif c.pattern == "DP gradient all-reduce" and set(c.axes) <= set(zero):
            if t.layered or not _has(comms, c.tensor, "FSDP gradient reduce-scatter"):
                out.append(dataclasses.replace(c, pattern="ZeRO-1 gradient reduce-scatter",
                                               collective="reduce-scatter"))
            # else: merged into the top-level weight's reduce-scatter below
        elif c.pattern == "FSDP gradient reduce-scatter" and not t.layered and c.tensor not in merged:
            merged.add(c.tensor)
            out += _merged_reduce_scatter(layout, c, comms, zero)
        else:
            out.append(c)
    for name, t in by_name.items():
        if zero_axes[name]:
            shard = layout.local_bytes(t) / _degree(layout, zero_axes[name])
            out += hierarchical(layout, "ZeRO-1 updated-parameter all-gather", zero_axes[name], "all-gather", shard,
                                count=1, phase=BACKWARD, dtype=t.dtype, scales=False, tensor=name)
    return out


def _has(comms: list[Comm], tensor: str, pattern: str) -> bool:
    return any(o.tensor == tensor and o.pattern == pattern for o in comms)


def _merged_reduce_scatter(layout: Layout, fsdp: Comm, comms: list[Comm], zero: tuple[str, ...]) -> list[Comm]:
    """A top-level weight's FSDP reduce-scatter with its ZeRO-1 `data` all-reduce folded in: one reduce-scatter
    over both (the weight unchanged when nothing is folded)."""
    dp = [o for o in comms if o.tensor == fsdp.tensor and o.pattern == "DP gradient all-reduce"
          and set(o.axes) <= set(zero)]
    if not dp:
        return [fsdp]
    axes = layout.live(fsdp.axes + tuple(a for o in dp for a in o.axes))
    return hierarchical(layout, "FSDP + ZeRO-1 gradient reduce-scatter", axes, "reduce-scatter", fsdp.operand_bytes,
                        count=fsdp.count, phase=fsdp.phase, dtype=fsdp.dtype, scales=False, tensor=fsdp.tensor)


def _zero_axes(layout: Layout, tensor: Tensor) -> tuple[str, ...]:
    """The axes ZeRO-1 adds to this parameter's optimizer state (shard_optimizer_over_data): its moments'
    shardings, read from the layout, minus the parameter's own."""
    if not layout.config.shard_optimizer_over_data:
        return ()
    suffix = tensor.path.removeprefix(".params")
    moments = [o for o in layout.tensors if o.group == "optimizer" and o.path.endswith(suffix)
               and o.shape == tensor.shape]
    return layout.live(set().union(*(o.axes for o in moments)) - tensor.axes) if moments else ()


# ---------------------------------------------------------------- activations: TP, TP-sequence, PP

@dataclasses.dataclass(frozen=True)
class LayerRuns:
    """How often a step runs a decoder layer, and the bytes of the residual stream one run reads on a device."""

    count: float
    residual: float


def layer_runs(layout: Layout, tokens: float, microbatches: int) -> LayerRuns:
    """Every pipeline iteration (bubble too) runs a block of layers on one pipeline microbatch of all stages'
    rows; without a pipeline each microbatch runs the device's share of the layer stack."""
    config, pipe = layout.config, layout.pipeline
    residual = tokens * config.emb_dim * dtype_bytes(config.dtype)
    if pipe:
        return LayerRuns(count=pipe.num_iterations * pipe.layers_per_block * microbatches,
                         residual=residual * pipe.num_stages / pipe.num_microbatches)
    return LayerRuns(count=config.num_decoder_layers / layer_split(layout) * microbatches, residual=residual)


def tp_block_steps(config: Config, residual: float, shard: float, parts: int, sequence_parallel_block: bool,
                   label: str) -> list[tuple[str, str, str, float, int]]:
    """(phase, what, collective, operand bytes, partial sums XLA:CPU reduces one by one) of one Megatron block:
    an all-reduce after it and of its input gradient, or under TP-sequence an all-gather before and a
    reduce-scatter after (and their transposes). `parts`: the projections whose partial sums the input
    gradient adds (q, k, v, or gate, up)."""
    if sequence_parallel_block:
        steps = [(FORWARD, "input all-gather", "all-gather", shard, 1),
                 (FORWARD, "output reduce-scatter", "reduce-scatter", residual, 1),
                 (BACKWARD, "output-gradient all-gather", "all-gather", shard, 1),
                 (BACKWARD, "input-gradient reduce-scatter", "reduce-scatter", residual, parts)]
        if regathers_in_backward(config):
            # Autodiff saves the block's sequence-sharded input, not the partitioner's gathered copy: the weight
            # gradients gather it again (as Megatron-SP does, to save memory).
            steps.append((BACKWARD, "input all-gather again for the weight gradients", "all-gather", shard, 1))
        recomputed = "reduce-scatter"
    else:
        steps = [(FORWARD, "output all-reduce", "all-reduce", residual, 1),  # after the out / down projection
                 (BACKWARD, "input-gradient all-reduce", "all-reduce", residual, parts)]
        recomputed = "all-reduce"
    if config.remat_policy == "full" and label == "attention":
        # remat=full re-runs the layer in the backward pass up to the MLP input, which needs the attention
        # block's output again (the MLP's own output is not needed).
        steps.append((BACKWARD, f"output {recomputed} recomputed by remat=full", recomputed, residual, 1))
    return steps


def tp_block_comms(layout: Layout, label: str, axes: tuple[str, ...], parts: int, runs: LayerRuns,
                   count: float) -> list[Comm]:
    """One Megatron-style block (attention or MLP) split over the TP `axes`, `count` runs per step."""
    config = layout.config
    sequence_parallel_block = bool(set(axes) & set(_residual_split_axes(layout, (1, 2))))
    shard = runs.residual / _degree(layout, axes)
    return [c for phase, what, collective, size, cpu_parts
            in tp_block_steps(config, runs.residual, shard, parts, sequence_parallel_block, label)
            for c in hierarchical(layout, f"TP {label} {what} ({phase})", axes, collective, size, count=count,
                                  phase=phase, dtype=config.dtype, scales=True, cpu_parts=cpu_parts)]


def _split_parts(layout: Layout, axes: tuple[str, ...], projections: Iterable[tuple[ParamRole, str]]) -> int:
    """How many of these input projections are split over (some of) the block's TP axes."""
    return sum(1 for role, dim in projections if set(_tp_axes(layout, layout.param(role), dim)) & set(axes))


def attention_tp_comms(layout: Layout, runs: LayerRuns) -> list[Comm]:
    """Heads split over non-batch axes: Megatron attention."""
    axes = _tp_axes(layout, layout.param(ParamRole.QUERY), Logical.HEADS)
    if not axes:
        return []
    parts = _split_parts(layout, axes, ((ParamRole.QUERY, Logical.HEADS), (ParamRole.KEY, Logical.KV_HEADS),
                                        (ParamRole.VALUE, Logical.KV_HEADS)))
    return tp_block_comms(layout, "attention", axes, parts, runs, runs.count)


def _dense_layer_share(config: Config) -> float:
    """The share of the layers whose feed-forward is a dense MLP (the MoE layers': maxpar.plan.moe_comms)."""
    return 1 - config.num_moe_layers / config.num_decoder_layers


def mlp_tp_comms(layout: Layout, runs: LayerRuns) -> list[Comm]:
    """The dense MLPs' hidden layer split over non-batch axes: Megatron MLP."""
    axes = _tp_axes(layout, layout.param(ParamRole.MLP_GATE), Logical.MLP)
    if not axes:
        return []
    parts = _split_parts(layout, axes, ((ParamRole.MLP_GATE, Logical.MLP), (ParamRole.MLP_UP, Logical.MLP)))
    return tp_block_comms(layout, "MLP", axes, parts, runs, runs.count * _dense_layer_share(layout.config))


def loss_tp_comms(layout: Layout, tokens: float, microbatches: int) -> list[Comm]:
    """The vocab-parallel loss: its max, sum and label logit reduced over the vocab shards, and the output
    projection's input gradient."""
    config = layout.config
    projection = layout.param(ParamRole.OUTPUT) or layout.param(ParamRole.EMBEDDING)
    sequence_sharded = _residual_split_axes(layout, (1, 2))
    axes = tuple(a for a in _tp_axes(layout, projection, Logical.VOCAB) if a not in sequence_sharded)
    residual = tokens * config.emb_dim * dtype_bytes(config.dtype)
    return (hierarchical(layout, "TP loss max / sum / label-logit all-reduces (forward)", axes, "all-reduce",
                         3 * tokens * 4, count=microbatches, phase=FORWARD, dtype="float32", scales=True)
            + hierarchical(layout, "TP output-projection input-gradient all-reduce (backward)", axes, "all-reduce",
                           residual, count=microbatches, phase=BACKWARD, dtype=config.dtype, scales=True))


def sequence_input_comms(layout: Layout, tokens: float, microbatches: int) -> list[Comm]:
    """TP-sequence without a pipeline: attention constrains positions and segment ids to its whole-length q,
    gathered once per step."""
    axes = _residual_split_axes(layout, (1, 2))
    if not axes or layout.pipeline:
        return []
    return hierarchical(layout, "TP-sequence positions and segment ids all-gather (forward)", axes, "all-gather",
                        2 * tokens / _degree(layout, axes) * 4, count=microbatches, phase=FORWARD, dtype="int32",
                        scales=True)


def pipeline_comms(layout: Layout, tokens: float, runs: LayerRuns, microbatches: int) -> list[Comm]:
    """PP: per iteration the stage state rolls to the next stage (and back in the backward pass); outside the
    loop the stages split the batch: its input is gathered over them, and stage 0's outputs scattered back (a
    reduce-scatter of the output left on stage 0); the reverse when differentiated."""
    config, pipe = layout.config, layout.pipeline
    axes = layout.live(layout.stage_axes)
    if not pipe or not axes:
        return []
    tp = tp_degrees(layout)
    local = 1 / (tp["length"] * tp["embed"])  # the stage state [b, T, emb] is sharded like the residual stream
    residual = tokens * config.emb_dim * dtype_bytes(config.dtype)
    common = dict(dtype=config.dtype, scales=True)
    comms: list[Comm] = []
    for phase in (FORWARD, BACKWARD):  # the roll to the next stage, and its transpose
        comms += hierarchical(layout, f"PP stage-to-stage collective-permute ({phase})", axes, "collective-permute",
                              runs.residual * local, count=pipe.num_iterations * microbatches, phase=phase, **common)
    if config.pipeline_fsdp_ag_per_repeat:
        # The backward pass re-runs each window's iterations; a one-iteration window's roll feeds nothing there
        # (its output only leaves the window), so XLA drops it.
        windows = [pipe.num_microbatches] * pipe.num_repeats + [pipe.num_stages - 1]
        comms += hierarchical(layout, "PP stage-to-stage collective-permute (forward re-run in the backward)", axes,
                              "collective-permute", runs.residual * local,
                              count=sum(n for n in windows if n > 1) * microbatches, phase=BACKWARD, **common)
    for phase, rows in ((FORWARD, "input"), (BACKWARD, "output-gradient")):
        comms += hierarchical(layout, f"PP {rows} rows all-gather over the stages ({phase})", axes, "all-gather",
                              residual * local, count=microbatches, phase=phase, **common)
    for phase, rows in ((FORWARD, "output"), (BACKWARD, "input-gradient")):
        comms += hierarchical(layout, f"PP {rows} rows reduce-scatter over the stages ({phase})", axes,
                              "reduce-scatter", residual * local * pipe.num_stages, count=microbatches, phase=phase,
                              **common)
    return comms + hierarchical(layout, "PP positions and segment ids all-gather over the stages (forward)", axes,
                                "all-gather", 2 * tokens / tp["length"] * 4, count=microbatches, phase=FORWARD,
                                dtype="int32", scales=True)


def activation_comms(layout: Layout, tokens: float, microbatches: int) -> list[Comm]:
    """Tensor-parallel activations per layer, the vocab-parallel loss and the pipeline's stage traffic;
    tokens = one microbatch's per batch shard."""
    runs = layer_runs(layout, tokens, microbatches)
    per_token = layout.config.emb_dim * dtype_bytes(layout.config.dtype)
    return (attention_tp_comms(layout, runs)
            + mlp_tp_comms(layout, runs)
            + tp_transpose_comms(layout, runs.residual / per_token, runs.count * _dense_layer_share(layout.config),
                                 microbatches)
            + loss_tp_comms(layout, tokens, microbatches)
            + sequence_input_comms(layout, tokens, microbatches)
            + pipeline_comms(layout, tokens, runs, microbatches))


def tp_transpose_comms(layout: Layout, tokens: float, count: float, microbatches: int) -> list[Comm]:
    """TP-transpose (configs/tp_transpose.yml): the dense MLP weights split on embed over a non-batch axis.

    Per layer and microbatch (`tokens` per batch shard, t the axis degree): the input is sliced on embed
    (free), so gate and up are partial sums over embed, reduce-scattered onto the mlp-split hidden layer
    [tokens, mlp]; the product is gathered for the down projection, whose embed-split output is gathered
    into the residual stream. The backward pass is the transpose: the hidden gradient reduce-scattered,
    the gate/up gradients gathered, the input gradient gathered; scanned or rematerialized layers gather
    the hidden product again for the down projection's weight gradient. The partitioner also carries the
    residual add split on embed and gathers the residual a second time per layer and pass, and once per
    pass where the layer stack meets the final norm (measured in the compiled step; `--verify`).
    """
    config = layout.config
    axes = _tp_axes(layout, layout.param(ParamRole.MLP_GATE), Logical.MLP_EMBED)
    if not axes or count <= 0:
        return []
    a = dtype_bytes(config.dtype)
    t = _degree(layout, axes)
    hidden, residual = tokens * config.mlp_dim * a, tokens * config.emb_dim * a
    steps = [(FORWARD, "gate/up partial-sum reduce-scatter", "reduce-scatter", hidden, 2),
             (FORWARD, "hidden all-gather", "all-gather", hidden / t, 1),
             (FORWARD, "output and residual all-gathers", "all-gather", residual / t, 2),
             (BACKWARD, "hidden-gradient reduce-scatter", "reduce-scatter", hidden, 1),
             (BACKWARD, "gate/up-gradient all-gather", "all-gather", hidden / t, 2),
             (BACKWARD, "input-gradient and residual-gradient all-gathers", "all-gather", residual / t, 2)]
    if regathers_in_backward(config):
        steps.append((BACKWARD, "hidden all-gather again for the down projection's weight gradient", "all-gather",
                      hidden / t, 1))
    comms: list[Comm] = []
    for phase, what, collective, size, times in steps:
        comms += hierarchical(layout, f"TP-transpose MLP {what} ({phase})", axes, collective, size,
                              count=count * times, phase=phase, dtype=config.dtype, scales=True)
    if layout.pipeline is None:
        for phase in (FORWARD, BACKWARD):
            comms += hierarchical(layout, f"TP-transpose residual all-gather at the final norm ({phase})", axes,
                                  "all-gather", residual / t, count=microbatches, phase=phase, dtype=config.dtype,
                                  scales=True)
    return comms


def lookup_comms(layout: Layout, tokens: float, microbatches: int) -> list[Comm]:
    """The token lookup's own collectives: on embed shards, the ids' all-gather and the rows' all-to-all (and
    back); on a vocab-sharded table, the looked-up rows summed over the vocab shards."""
    table = layout.param(ParamRole.EMBEDDING)
    if table is not None and layout.lookup_on_shards:
        axes = _fsdp_axes(layout, table)
        rows = tokens * layout.config.emb_dim * dtype_bytes(table.dtype)  # one device's before the all-to-all
        comms = hierarchical(layout, "embedding lookup token-id all-gather", axes, "all-gather", tokens * 4,
                             count=microbatches, phase=FORWARD, dtype="int32", scales=True)
        for phase in (FORWARD, BACKWARD):
            comms += hierarchical(layout, f"embedding lookup all-to-all ({phase})", axes, "all-to-all", rows,
                                  count=microbatches, phase=phase, dtype=table.dtype, scales=True)
        return comms
    # Under TP-sequence the table is gathered (weight_comms) and each sequence shard looks up its own tokens.
    sequence = _sequence_axes(layout, table) if table else ()
    vocab_axes = tuple(a for a in _tp_axes(layout, table, Logical.VOCAB) if a not in sequence)
    if table is None or not vocab_axes:
        return []
    rows = tokens * layout.config.emb_dim * dtype_bytes(table.dtype)
    return hierarchical(layout, "TP embedding lookup all-reduce (forward)", vocab_axes, "all-reduce", rows,
                        count=microbatches, phase=FORWARD, dtype=table.dtype, scales=True)


def predict_comms(layout: Layout, tokens_per_shard: float, microbatches: int) -> list[Comm]:
    """Every predicted collective of one step (tokens_per_shard: one microbatch's tokens per batch shard)."""
    local = tokens_per_shard / layout.context_degree  # context parallelism: each device holds 1/C of the tokens
    return (zero_comms(layout, weight_comms(layout, microbatches))
            + activation_comms(layout, local, microbatches)
            + lookup_comms(layout, local, microbatches))


def expert_all_to_all_bytes(tokens: float, emb_dim: int, experts_per_token: int, dtype_size: int) -> float:
    """Operand of one expert-parallel dispatch (or combine) all-to-all: each token's copies for its experts.

    sharding-strategies.md (EP): moving between batch and expert sharding sends
    the routed activations, tokens x experts_per_token x emb; with compute
    2 x that x mlp per matmul, the arithmetic intensity is mlp_dim.
    `maxpar.plan.moe_comms` applies it to the MoE layers' real exchange.
    """
    return tokens * experts_per_token * emb_dim * dtype_size
