"""Predicted collectives of the pipeline's stage traffic (PP over `stage`), as maxpar.pipeline.spmd runs it.

Per iteration of the M x R + S - 1, one collective-permute of a pipeline microbatch's activations to
the next stage in the forward pass and one back in the backward pass; outside the loop the stages split
the batch (`pipeline_comms`). The layers run every iteration, bubble included, on 1/M of the batch
(`maxpar.plan.comms.layer_runs`): per-layer TP collectives scale by 1 / (1 - bubble). The stage weights'
gathers and gradient reductions are `maxpar.plan.weight_comms`'s. The schedules with an explicit backward (1F1B,
zero-bubble) run another executor, with collectives of their own: `explicit_backward_comms`.
"""

from __future__ import annotations

from maxpar.core.op_schedule import OpSchedule
from maxpar.model.roles import Block
from maxpar.plan.comms import BACKWARD, FORWARD, Comm, LayerRuns, hierarchical
from maxpar.plan.layout import Layout
from maxpar.plan.model_math import dtype_bytes, tp_degrees


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


def explicit_backward_comms(layout: Layout, tokens: float, runs: LayerRuns, microbatches: int) -> list[Comm]:
    """1F1B and zero-bubble (`maxpar.pipeline.one_f_one_b`): every tick one permute of a microbatch's stage
    output to the next stage and one of a cotangent to the previous, in `dtype`; neither wraps round, so only
    (S-1)/S of the devices send. Around the executor's shard_map: the embedded input and the per-row integers
    (positions, segment ids, targets) gathered over the stages; the input's cotangent comes back stacked over
    the stages with only stage 0's block real, and taking that block reshards it to the batch's layout: an
    all-to-all over the stages. The gradients (`_explicit_gradient_comms`) replace `maxpar.plan.weight_comms`."""
    config, pipe = layout.config, layout.pipeline
    axes = layout.live(layout.stage_axes)
    if not pipe or not axes:
        return []
    stages = pipe.num_stages
    ticks = OpSchedule(config.pipeline_schedule, stages, pipe.num_microbatches).num_ticks
    residual = tokens * config.emb_dim * dtype_bytes(config.dtype)
    common = dict(dtype=config.dtype, scales=True)
    comms: list[Comm] = []
    for phase, what in ((FORWARD, "stage output"), (BACKWARD, "cotangent")):
        comms += hierarchical(layout, f"PP {what} collective-permute per tick ({phase})", axes, "collective-permute",
                              runs.residual, count=ticks * (stages - 1) / stages * microbatches, phase=phase,
                              **common)
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
    the rows of every batch axis: its table gradient is all-reduced over all of them."""
    config, stages = layout.config, layout.pipeline.num_stages
    replicas = layout.live(layout.run.model.pipeline.loop_batch_axes)
    batch = layout.live(layout.batch_axes)
    grad = dict(phase=BACKWARD, scales=False, count=microbatches)
    comms: list[Comm] = []
    for t in layout.params():
        elements = layout.local_bytes(t) / dtype_bytes(t.dtype)
        head = not t.layered and (t.block in (Block.OUTPUT, Block.NORM)
                                  or (t.block == Block.EMBEDDING and config.logits_via_embedding))
        if t.layered or head:
            comms += hierarchical(layout, "PP gradient all-reduce over the replicas (psum in the executor)", replicas,
                                  "all-reduce", elements * 4, dtype="float32", tensor=t.name, **grad)
        if head:
            size = elements * dtype_bytes(t.dtype)
            comms += hierarchical(layout, "PP head gradient collective-permute from the last stage", stage_axes,
                                  "collective-permute", size, dtype=t.dtype, tensor=t.name,
                                  **{**grad, "count": microbatches / stages})
            comms += hierarchical(layout, "PP head gradient all-reduce over the stages", stage_axes, "all-reduce",
                                  size, dtype=t.dtype, tensor=t.name, **grad)
        if t.block == Block.EMBEDDING:
            comms += hierarchical(layout, "DP gradient all-reduce (token lookup)", batch, "all-reduce",
                                  elements * dtype_bytes(t.dtype), dtype=t.dtype, tensor=t.name, **grad)
    return comms
