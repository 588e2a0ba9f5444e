"""Predicted collectives of the pipeline's stage traffic (PP over `stage`), as maxpar.pipeline.spmd runs it.

Per iteration of the M x R + S - 1, one collective-permute of a pipeline microbatch's activations to
the next stage in the forward pass and one back in the backward pass; outside the loop the stages split
the batch (`pipeline_comms`). The layers run every iteration, bubble included, on 1/M of the batch
(`maxpar.plan.comms.layer_runs`): per-layer TP collectives scale by 1 / (1 - bubble). The stage weights'
gathers and gradient reductions are `maxpar.plan.weight_comms`'s. The schedules with an explicit backward (1F1B,
zero-bubble) run another executor, with collectives of their own: `explicit_backward_comms`.
"""

from __future__ import annotations

from maxpar.core.op_schedule import F, op_kinds
from maxpar.core.schedule import ScheduleKind
from maxpar.model.roles import Block
from maxpar.plan.comms import BACKWARD, FORWARD, Comm, LayerRuns, fsdp_axes, hierarchical
from maxpar.plan.tensors import Layout
from maxpar.plan.model_math import dtype_bytes, tp_degrees


def pipeline_comms(layout: Layout, tokens: float, runs: LayerRuns, microbatches: int) -> list[Comm]:
    """PP: per iteration the stage state rolls to the next stage (and back in the backward pass); outside the
    loop the stages split the batch: its input is gathered over them, and stage 0's outputs scattered back (a
    reduce-scatter of the output left on stage 0); the reverse when differentiated."""
    config, pipe = layout.config, layout.schedule
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


def explicit_backward_comms(layout: Layout, tokens: float, runs: LayerRuns, microbatches: int) -> list[Comm]:
    """1F1B and zero-bubble (`maxpar.pipeline.one_f_one_b`): every tick one permute of a microbatch's stage
    output to the next stage and one of a cotangent to the previous, in `dtype`; neither wraps round, so only
    (S-1)/S of the devices send (interleaved_1f1b's wrap round: every device sends, a tick one block's op).
    Around the executor's shard_map: the embedded input and the per-row integers (positions, segment ids,
    targets) gathered over the stages; the input's cotangent comes back stacked over the stages with only stage
    0's block real, and taking that block reshards it to the batch's layout: an all-to-all over the stages. The
    gradients (`_explicit_gradient_comms`) replace `maxpar.plan.weight_comms`."""
    config, pipe = layout.config, layout.schedule
    axes = layout.live(layout.stage_axes)
    if not pipe or not axes:
        return []
    stages = pipe.num_stages
    schedule = layout.ops
    ticks = schedule.num_ticks
    senders = 1.0 if pipe.num_repeats > 1 else (stages - 1) / stages
    residual = tokens * config.emb_dim * dtype_bytes(config.dtype)
    common = dict(dtype=config.dtype, scales=True)
    comms: list[Comm] = []
    for phase, what in ((FORWARD, "stage output"), (BACKWARD, "cotangent")):
        comms += hierarchical(layout, f"PP {what} collective-permute per tick ({phase})", axes, "collective-permute",
                              runs.residual, count=ticks * senders * microbatches, phase=phase,
                              **common)
    if config.num_moe_layers and config.load_balance_loss_weight > 0:  # the forward-only pass for the MoE totals
        forward_ticks = len({op.tick for op in schedule.ops() if op.kind == F})
        comms += hierarchical(layout, "PP stage output collective-permute per tick of the forward-only pass "
                              f"({FORWARD})", axes, "collective-permute", runs.residual,
                              count=forward_ticks * senders * microbatches, phase=FORWARD, **common)
    comms += hierarchical(layout, "PP input rows all-gather over the stages (forward)", axes, "all-gather", residual,
                          count=microbatches, phase=FORWARD, **common)
    comms += hierarchical(layout, "PP input-gradient rows all-to-all from stage 0 (backward)", axes, "all-to-all",
                          residual * stages, count=microbatches, phase=BACKWARD, **common)
    comms += hierarchical(layout, "PP positions, segment ids and targets all-gather over the stages (forward)", axes,
                          "all-gather", 3 * tokens * 4, count=microbatches, phase=FORWARD, dtype="int32",
                          scales=True)
    return comms + _explicit_gradient_comms(layout, axes, microbatches)


def _explicit_gradient_comms(layout: Layout, stage_axes: tuple[str, ...], microbatches: int) -> list[Comm]:
    """The executor sums its float32 gradients of the stage weights and of the loss head's weights (final norm,
    output projection or tied table) over the replicas in one psum; the head's, held by the last stage, then
    reach every stage as the slice of the stage-stacked output: a collective-permute to stage 0 (1/S of the
    devices send) and an all-reduce over the stages, in the weights' dtype. The token lookup runs outside, on
    the rows of every batch axis: its table gradient is all-reduced over all of them. The replicas are the
    executor's manual batch axes; over the batch axes it leaves automatic (FSDP) every op gathers the stage
    weights (pipeline_fsdp_ag_per_repeat: once; B and W recompute the block's forward, so they gather twice:
    `_executor_gathers`) and every weight backward all-reduces their float32 gradient; pipeline_fsdp_ag_once
    gathers them before the executor (its FSDP axes are replicas). The head's weights are gathered and their
    gradient all-reduced over those axes at each of the last stage's F ops (1/S of the devices' ops)."""
    config, stages = layout.config, layout.schedule.num_stages
    executor = layout.run.model.pipeline.executor
    replicas = layout.live(executor.batch_axes)
    batch = layout.live(layout.batch_axes)
    automatic = tuple(a for a in batch if a not in replicas + stage_axes)
    gathers, weight_ops = _executor_gathers(layout.ops.kind, layout.schedule.num_microbatches)
    head_ops = layout.schedule.num_microbatches / stages  # F ops with the head, per device on average
    grad = dict(phase=BACKWARD, scales=False, count=microbatches)
    comms: list[Comm] = []
    for t in layout.params():
        elements = layout.local_bytes(t) / dtype_bytes(t.dtype)
        head = not t.layered and (t.block in (Block.OUTPUT, Block.NORM)
                                  or (t.block == Block.EMBEDDING and config.logits_via_embedding))
        if t.layered or head:
            comms += hierarchical(layout, "PP gradient all-reduce over the replicas (psum in the executor)", replicas,
                                  "all-reduce", elements * 4, dtype="float32", tensor=t.name, **grad)
        fsdp = fsdp_axes(layout, t)
        whole = elements * layout.group_degree(fsdp)  # the weight gathered over the FSDP axes
        if t.layered and config.pipeline_fsdp_ag_once and fsdp:
            comms += hierarchical(layout, "FSDP stage-weight all-gather (before the executor: pipeline_fsdp_ag_once)",
                                  fsdp, "all-gather", elements * dtype_bytes(t.dtype), dtype=t.dtype, tensor=t.name,
                                  **{**grad, "phase": FORWARD})
        elif t.layered and automatic and not config.pipeline_fsdp_ag_once:
            per_step = 1 if config.pipeline_fsdp_ag_per_repeat else gathers
            if fsdp:
                comms += hierarchical(layout, "FSDP stage-weight all-gather per op in the executor", fsdp,
                                      "all-gather", elements * dtype_bytes(t.dtype), dtype=t.dtype, tensor=t.name,
                                      **{**grad, "phase": FORWARD, "count": microbatches * per_step})
            comms += hierarchical(layout, "FSDP stage-weight gradient all-reduce per weight backward", automatic,
                                  "all-reduce", whole * 4, dtype="float32", tensor=t.name,
                                  **{**grad, "count": microbatches * weight_ops})
        if head and automatic:
            if fsdp:
                comms += hierarchical(layout, "FSDP head-weight all-gather per F op of the last stage", fsdp,
                                      "all-gather", elements * dtype_bytes(t.dtype), dtype=t.dtype, tensor=t.name,
                                      **{**grad, "phase": FORWARD, "count": microbatches * head_ops})
            comms += hierarchical(layout, "FSDP head-weight gradient all-reduce per F op of the last stage",
                                  automatic, "all-reduce", whole * dtype_bytes(t.dtype), dtype=t.dtype,
                                  tensor=t.name, **{**grad, "count": microbatches * head_ops})
        if t.block == Block.EMBEDDING and fsdp and layout.table_gathered and not head:
            comms += hierarchical(layout, "FSDP token-table all-gather (the lookup, outside the executor)", fsdp,
                                  "all-gather", elements * dtype_bytes(t.dtype), dtype=t.dtype, tensor=t.name,
                                  **{**grad, "phase": FORWARD})
        if head:
            size = elements * dtype_bytes(t.dtype)
            comms += hierarchical(layout, "PP head gradient collective-permute from the last stage", stage_axes,
                                  "collective-permute", size, dtype=t.dtype, tensor=t.name,
                                  **{**grad, "count": microbatches / stages})
            comms += hierarchical(layout, "PP head gradient all-reduce over the stages", stage_axes, "all-reduce",
                                  size, dtype=t.dtype, tensor=t.name, **grad)
        if t.block == Block.EMBEDDING:
            comms += hierarchical(layout, "DP gradient all-reduce (token lookup)", batch, "all-reduce",
                                  whole * dtype_bytes(t.dtype), dtype=t.dtype, tensor=t.name, **grad)
    return comms


def _executor_gathers(kind: ScheduleKind, num_microbatches: int) -> tuple[int, int]:
    """(stage-weight gathers, weight backwards) per stage per step of the explicit-backward executor under FSDP:
    F gathers once; B and W each take a VJP that recomputes the block's forward, and XLA gathers the weights
    for the recomputation and again for the backward (two loops over the layers)."""
    backward_ops = len(op_kinds(kind)) - 1
    return num_microbatches * (1 + 2 * backward_ops), num_microbatches
