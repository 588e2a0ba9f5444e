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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from maxpar.axes import CONTEXT_AXIS, Logical
from maxpar.plan.hlo import wire_bytes
from maxpar.plan.layout import Layout, Tensor
from maxpar.pipeline.spmd import manual_batch_axes
from maxpar.plan.model_math import (context_degree, dtype_bytes, layer_split, regathers_in_backward, sequence_parallel,
                                     tp_degrees)

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


def _fsdp_axes(layout: Layout, tensor: Tensor) -> tuple[str, ...]:
    """Axes that shard both this weight and the batch: the weight must be gathered."""
    return layout.live(a for a in tensor.axes if a in layout.weight_batch_axes(tensor))


def _tp_axes(layout: Layout, tensor: Tensor | None, logical: str) -> tuple[str, ...]:
    """Non-batch axes sharding one feature dim of a weight: activations move over them. Not `context`: context
    parallelism gathers the weights it shards, like FSDP."""
    if tensor is None:
        return ()
    return layout.live(a for a in tensor.dim_axes(logical) if a not in layout.batch_axes and a != CONTEXT_AXIS)


def _sequence_axes(layout: Layout, tensor: Tensor) -> tuple[str, ...]:
    """Non-batch axes splitting the tokens a weight is applied to (TP-sequence: the residual stream's length).

    Only the norm scales, the token table and the output projection see the residual stream itself; the
    attention and MLP weights see activations whose length stays whole (activation_attn_length, _mlp_length).
    """
    if tensor.role not in ("norm", "embedding", "output"):
        return ()
    return layout.live(a for a in layout.residual_axes[1] if a not in layout.batch_axes + ("context",))


def _gather_chain(layout: Layout, pattern: str, groups: Iterable[tuple[str, ...]], size: float,
                  **kwargs) -> list[Comm]:
    """One all-gather per group of axes in turn, each on the previous one's output (the partitioner
    gathers one sharded dimension at a time, so each group is a collective of its own)."""
    comms: list[Comm] = []
    for axes in groups:
        if axes:
            comms += hierarchical(layout, pattern, axes, "all-gather", size, **kwargs)
            size *= math.prod(layout.degree(a) for a in axes)
    return comms


def pipeline_manual_axes(layout: Layout) -> tuple[str, ...]:
    """The batch axes a pipelined step runs per replica (maxpar.pipeline.spmd): reduced once per step."""
    gathered_once = layout.config.pipeline_fsdp_ag_once
    stacked = [t for t in layout.params() if t.layered]
    loop_batch = layout.weight_batch_axes(stacked[0])
    weight_axes = set().union(*(t.axes - set(loop_batch) if gathered_once else t.axes for t in stacked))
    return manual_batch_axes(loop_batch, weight_axes)


def weight_comms(layout: Layout, microbatches: int) -> list[Comm]:
    """FSDP all-gathers and the gradient reduce-scatters / all-reduces of every weight."""
    config = layout.config
    comms = []
    pipe = layout.pipeline
    # A pipeline gathers a stage's stacked weights one block (1/R of them) per iteration in each pass and
    # reduces their gradient per iteration over the batch axes it does not run per replica; with
    # pipeline_fsdp_ag_once it gathers them once per step (hoisted out of gradient accumulation too).
    per_iteration = pipe.num_iterations / pipe.num_repeats if pipe else 1.0
    once = pipe is not None and config.pipeline_fsdp_ag_once
    per_repeat = pipe is not None and config.pipeline_fsdp_ag_per_repeat
    manual = pipeline_manual_axes(layout) if pipe else ()
    for t in layout.params():
        if t.role == "experts":
            continue  # moved by the MoE shard_map, not the partitioner: maxpar.plan.moe_comms
        elements = layout.local_bytes(t) / dtype_bytes(t.dtype)
        # Matmul weights are cast to `dtype` before use, so gathers and gradient partial sums are in
        # `dtype`; norm scales are used and differentiated in float32; the token table is gathered
        # and looked up in its own dtype.
        dtype = {"norm": "float32", "embedding": t.dtype}.get(t.role, config.dtype)
        if once and t.layered:  # gathered (and its gradient reduced) before the cast to `dtype`
            dtype = t.dtype
        size = elements * dtype_bytes(dtype)
        name = t.path.replace(".params", "").replace("['", "").replace("']", "/").rstrip("/")
        gather = _fsdp_axes(layout, t)
        sequence = _sequence_axes(layout, t)
        # A vocab dim sharded over an axis that splits the tokens cannot shard the lookup or the logits
        # (that axis is taken by their length): the weight is gathered over it too, like FSDP.
        sequence_gather = tuple(a for a in sequence if a in t.axes)
        full = size * math.prod(layout.degree(a) for a in gather + sequence_gather)
        looped = microbatches * (per_iteration if t.layered and not once else 1.0)  # gradient reductions
        if gather:
            if t.layered and once:
                comms += hierarchical(layout, "FSDP stage-weight all-gather (once per step: pipeline_fsdp_ag_once)",
                                      gather, "all-gather", size, count=1, phase=FORWARD, dtype=dtype,
                                      scales=False, tensor=name)
            elif t.layered and per_repeat:
                # One window of M iterations per repeat gathers the blocks its stages run (two repeats' but in
                # the first and the last window): 2R blocks of 1/R of the stage's stack, in the weights' dtype,
                # and again in the backward pass (the window is rematerialized). Gradients: per iteration.
                block = elements / pipe.num_repeats * dtype_bytes(t.dtype)
                for phase in (FORWARD, BACKWARD):
                    comms += hierarchical(layout, f"FSDP stage-block all-gather (per repeat, {phase})", gather,
                                          "all-gather", block, count=microbatches * 2 * pipe.num_repeats, phase=phase,
                                          dtype=t.dtype, scales=False, tensor=name)
            elif t.layered:
                # Under TP-sequence the backward's gathers name their replica groups differently from the
                # forward's (mesh vs iota form), so XLA's CSE does not merge them even in unscanned layers.
                kept = not regathers_in_backward(config) and not sequence_parallel(layout)
                for phase in (FORWARD,) if kept else (FORWARD, BACKWARD):
                    comms += hierarchical(layout, f"FSDP weight all-gather ({phase})", gather, "all-gather",
                                          size, count=microbatches * per_iteration, phase=phase, dtype=dtype,
                                          scales=False, tensor=name)
        # A tied table (logits_via_embedding) has two partial gradients, the lookup's scatter-add and the
        # output projection's; the partitioner reduces each where it is made, and sums them after.
        tied = t.role == "embedding" and config.logits_via_embedding
        on_shards = t.role == "embedding" and layout.lookup_on_shards
        if (gather or sequence_gather) and not t.layered and (t.role != "embedding" or layout.table_gathered):
            # Outside the layer scan the gathered weight is one array that the forward and the backward
            # matmul share: one gather per step. The table's ("vocab", None) constraint gathers its embed
            # shards first; the output projection is gathered on its vocab dim first.
            order = (gather, sequence_gather) if t.role == "embedding" else (sequence_gather, gather)
            comms += _gather_chain(layout, "FSDP weight all-gather (once per step)", order, size, count=1,
                                   phase=FORWARD, dtype=dtype, scales=False, tensor=name)
        grad = dict(phase=BACKWARD, dtype=dtype, scales=False, tensor=name)
        if sequence:
            # Its gradient sums partial results of the sequence shards: the partitioner all-reduces the whole
            # gradient over them, separately from (and before) the batch axes' reduction.
            comms += hierarchical(layout, "sequence-parallel gradient all-reduce", sequence, "all-reduce", full,
                                  count=microbatches * (2 if tied else 1), **grad)
        reduce = layout.live(a for a in layout.weight_batch_axes(t) if a not in t.axes)
        pieces = 2 if tied else 1  # partial gradients reduced like a matmul weight's (FSDP, then DP)
        if on_shards:
            # Each embed shard looked up every token of its batch group: only the other batch axes sum it.
            comms += hierarchical(layout, "DP gradient all-reduce", reduce, "all-reduce", size, count=microbatches,
                                  **grad)
            pieces -= 1
        elif gather and (reduce or "context" in gather) and t.role == "embedding":
            # The lookup's gradient is a scatter-add of the looked-up rows, unreduced on every batch
            # shard; the partitioner sums it over all batch axes at once and keeps its FSDP slice.
            # Context shards hold other tokens of the same rows: their partial sums are reduced first, on their own.
            axes = layout.live(gather + reduce)
            for group in (tuple(a for a in axes if a == "context"), tuple(a for a in axes if a != "context")):
                comms += hierarchical(layout, "DP+FSDP gradient all-reduce", group, "all-reduce", full,
                                      count=microbatches, **grad)
            pieces -= 1
        if not pieces:
            continue
        if gather:
            comms += hierarchical(layout, "FSDP gradient reduce-scatter", gather, "reduce-scatter", full,
                                  count=looped * pieces, **grad)
        if pipe and t.layered:  # inside the loop over the axes it does not run per replica
            inner = tuple(a for a in reduce if a not in manual)
            comms += hierarchical(layout, "DP gradient all-reduce (per pipeline iteration)", inner, "all-reduce",
                                  size, count=microbatches * per_iteration, **grad)
            reduce = tuple(a for a in reduce if a in manual)
        comms += hierarchical(layout, "DP gradient all-reduce", reduce, "all-reduce", size,
                              count=microbatches * pieces, **grad)
    return comms


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
    config = layout.config
    if not config.shard_optimizer_over_data:
        return comms
    by_name = {t.path.replace(".params", "").replace("['", "").replace("']", "/").rstrip("/"): t
               for t in layout.params()}
    out: list[Comm] = []
    merged: set[str] = set()
    for c in comms:
        t = by_name.get(c.tensor)
        zero = _zero_axes(layout, t) if t is not None else ()
        if not zero or c.phase != BACKWARD or c.collective not in ("all-reduce", "reduce-scatter"):
            out.append(c)
            continue
        if c.pattern == "DP gradient all-reduce" and set(c.axes) <= set(zero):
            if not t.layered and any(o.tensor == c.tensor and o.pattern == "FSDP gradient reduce-scatter"
                                     for o in comms):
                continue  # merged into the top-level weight's reduce-scatter below
            out.append(dataclasses.replace(c, pattern="ZeRO-1 gradient reduce-scatter", collective="reduce-scatter"))
        elif c.pattern == "FSDP gradient reduce-scatter" and not t.layered and c.tensor not in merged:
            dp = [o for o in comms if o.tensor == c.tensor and o.pattern == "DP gradient all-reduce"
                  and set(o.axes) <= set(zero)]
            if dp:
                merged.add(c.tensor)
                axes = layout.live(c.axes + tuple(a for o in dp for a in o.axes))
                out += hierarchical(layout, "FSDP + ZeRO-1 gradient reduce-scatter", axes, "reduce-scatter",
                                    c.operand_bytes, count=c.count, phase=c.phase, dtype=c.dtype, scales=False,
                                    tensor=c.tensor)
            else:
                out.append(c)
        else:
            out.append(c)
    for name, t in by_name.items():
        zero = _zero_axes(layout, t)
        if zero:
            shard = layout.local_bytes(t) / math.prod(layout.degree(a) for a in zero)
            out += hierarchical(layout, "ZeRO-1 updated-parameter all-gather", zero, "all-gather", shard, count=1,
                                phase=BACKWARD, dtype=t.dtype, scales=False, tensor=name)
    return out


def _zero_axes(layout: Layout, tensor: Tensor) -> tuple[str, ...]:
    """The axes ZeRO-1 adds to this parameter's optimizer state (shard_optimizer_over_data): its moments'
    shardings, read from the layout, minus the parameter's own."""
    if not layout.config.shard_optimizer_over_data:
        return ()
    suffix = tensor.path.removeprefix(".params")
    moments = [o for o in layout.tensors if o.group == "optimizer" and o.path.endswith(suffix)
               and o.shape == tensor.shape]
    return layout.live(set().union(*(o.axes for o in moments)) - tensor.axes) if moments else ()


def activation_comms(layout: Layout, tokens: float, microbatches: int) -> list[Comm]:
    """Tensor-parallel activations per layer and the vocab-parallel loss; tokens = one microbatch's per batch shard."""
    config = layout.config
    a = dtype_bytes(config.dtype)
    pipe = layout.pipeline
    residual = tokens * config.emb_dim * a
    if pipe:  # every iteration (bubble too) runs a block of layers on one pipeline microbatch of all stages' rows
        count = pipe.num_iterations * pipe.layers_per_block * microbatches
        layer_residual = residual * pipe.num_stages / pipe.num_microbatches
    else:
        count = config.num_decoder_layers / layer_split(layout) * microbatches
        layer_residual = residual
    sequence_sharded = layout.live(a for a in layout.residual_axes[1] + layout.residual_axes[2]
                                   if a not in layout.batch_axes + ("context",))
    comms: list[Comm] = []

    def block(label: str, axes: tuple[str, ...], parts: int, count: float = count) -> None:
        # (phase, what, collective, operand, partial sums XLA:CPU reduces one by one)
        if any(x in sequence_sharded for x in axes):  # sequence parallel: all-gather before, reduce-scatter after
            shard = layer_residual / math.prod(layout.degree(x) for x in axes)
            steps = [(FORWARD, "input all-gather", "all-gather", shard, 1),
                     (FORWARD, "output reduce-scatter", "reduce-scatter", layer_residual, 1),
                     (BACKWARD, "output-gradient all-gather", "all-gather", shard, 1),
                     (BACKWARD, "input-gradient reduce-scatter", "reduce-scatter", layer_residual, parts)]
            if regathers_in_backward(config):
                # Autodiff saves the block's sequence-sharded input, not the partitioner's gathered copy:
                # the weight gradients gather it again (as Megatron-SP does, to save memory).
                steps.append((BACKWARD, "input all-gather again for the weight gradients", "all-gather", shard, 1))
            recomputed = "reduce-scatter"
        else:
            steps = [(FORWARD, "output all-reduce", "all-reduce", layer_residual, 1),  # after the out / down projection
                     # of the partial sums of q,k,v (or gate, up)
                     (BACKWARD, "input-gradient all-reduce", "all-reduce", layer_residual, parts)]
            recomputed = "all-reduce"
        if config.remat_policy == "full" and label == "attention":
            # remat=full re-runs the layer in the backward pass up to the MLP input, which needs the
            # attention block's output again (the MLP's own output is not needed).
            steps.append((BACKWARD, f"output {recomputed} recomputed by remat=full", recomputed, layer_residual, 1))
        for phase, what, collective, size, cpu_parts in steps:
            comms.extend(hierarchical(layout, f"TP {label} {what} ({phase})", axes, collective, size, count=count,
                                      phase=phase, dtype=config.dtype, scales=True, cpu_parts=cpu_parts))

    query = layout.param("['query']")
    attention_axes = _tp_axes(layout, query, Logical.HEADS)
    if attention_axes:
        parts = sum(1 for name, dim in (("['query']", Logical.HEADS), ("['key']", Logical.KV_HEADS), ("['value']", Logical.KV_HEADS))
                    if set(_tp_axes(layout, layout.param(name), dim)) & set(attention_axes))
        block("attention", attention_axes, parts)
    mlp_axes = _tp_axes(layout, layout.param("['mlp']['wi_gate']"), Logical.MLP)
    if mlp_axes:
        parts = sum(1 for name in ("['mlp']['wi_gate']", "['mlp']['wi_up']")
                    if set(_tp_axes(layout, layout.param(name), Logical.MLP)) & set(mlp_axes))
        # MoE layers' experts have their own rule (maxpar.plan.moe_comms); the dense MLPs are the rest.
        block("MLP", mlp_axes, parts, count * (1 - config.num_moe_layers / config.num_decoder_layers))
    comms += tp_transpose_comms(layout, layer_residual / (config.emb_dim * a),
                                count * (1 - config.num_moe_layers / config.num_decoder_layers), microbatches)
    projection = layout.param("['output']") or layout.param("['token_embedding']")
    vocab_axes = tuple(a for a in _tp_axes(layout, projection, Logical.VOCAB) if a not in sequence_sharded)
    if vocab_axes:
        comms += hierarchical(layout, "TP loss max / sum / label-logit all-reduces (forward)", vocab_axes,
                              "all-reduce", 3 * tokens * 4, count=microbatches, phase=FORWARD, dtype="float32",
                              scales=True)
        comms += hierarchical(layout, "TP output-projection input-gradient all-reduce (backward)", vocab_axes,
                              "all-reduce", residual, count=microbatches, phase=BACKWARD, dtype=config.dtype,
                              scales=True)
    if sequence_sharded and not pipe:
        # Attention constrains positions and segment ids to its whole-length q: gathered once per step.
        length = math.prod(layout.degree(x) for x in sequence_sharded)
        comms += hierarchical(layout, "TP-sequence positions and segment ids all-gather (forward)", sequence_sharded,
                              "all-gather", 2 * tokens / length * 4, count=microbatches, phase=FORWARD,
                              dtype="int32", scales=True)
    stage_axes = layout.live(("stage",))
    if pipe and stage_axes:
        tp = tp_degrees(layout)
        local = 1 / (tp["length"] * tp["embed"])  # the stage state [b, T, emb] is sharded like the residual stream
        for phase in (FORWARD, BACKWARD):  # the roll to the next stage, and its transpose
            comms += hierarchical(layout, f"PP stage-to-stage collective-permute ({phase})", stage_axes,
                                  "collective-permute", layer_residual * local,
                                  count=pipe.num_iterations * microbatches, phase=phase, dtype=config.dtype,
                                  scales=True)
        if config.pipeline_fsdp_ag_per_repeat:
            # The backward pass re-runs each window's iterations; a one-iteration window's roll feeds nothing
            # there (its output only leaves the window), so XLA drops it.
            windows = [pipe.num_microbatches] * pipe.num_repeats + [pipe.num_stages - 1]
            comms += hierarchical(layout, "PP stage-to-stage collective-permute (forward re-run in the backward)",
                                  stage_axes, "collective-permute", layer_residual * local,
                                  count=sum(n for n in windows if n > 1) * microbatches, phase=BACKWARD,
                                  dtype=config.dtype, scales=True)
        # Outside the loop the stages split the batch: its input is gathered over them, and stage 0's
        # outputs scattered back (a reduce-scatter of the output left on stage 0); the reverse when differentiated.
        whole = residual * local * pipe.num_stages
        for phase, rows in ((FORWARD, "input"), (BACKWARD, "output-gradient")):
            comms += hierarchical(layout, f"PP {rows} rows all-gather over the stages ({phase})", stage_axes,
                                  "all-gather", residual * local, count=microbatches, phase=phase,
                                  dtype=config.dtype, scales=True)
        for phase, rows in ((FORWARD, "output"), (BACKWARD, "input-gradient")):
            comms += hierarchical(layout, f"PP {rows} rows reduce-scatter over the stages ({phase})", stage_axes,
                                  "reduce-scatter", whole, count=microbatches, phase=phase, dtype=config.dtype,
                                  scales=True)
        comms += hierarchical(layout, "PP positions and segment ids all-gather over the stages (forward)",
                              stage_axes, "all-gather", 2 * tokens / tp["length"] * 4, count=microbatches,
                              phase=FORWARD, dtype="int32", scales=True)
    return comms


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
    axes = _tp_axes(layout, layout.param("['mlp']['wi_gate']"), Logical.MLP_EMBED)
    if not axes or count <= 0:
        return []
    a = dtype_bytes(config.dtype)
    t = math.prod(layout.degree(x) for x in axes)
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
    table = layout.param("['token_embedding']")
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
    local = tokens_per_shard / context_degree(layout)  # context parallelism: each device holds 1/C of the tokens
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
