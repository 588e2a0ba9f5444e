"""Predicted collectives of the pipeline's stage traffic (PP over `stage`), as maxpar.pipeline.spmd runs it.

Per iteration of the M x R + S - 1, one collective-permute of a pipeline microbatch's activations to
the next stage in the forward pass and one back in the backward pass; outside the loop the stages split
the batch (`pipeline_comms`). The layers run every iteration, bubble included, on 1/M of the batch
(`maxpar.plan.comms.layer_runs`): per-layer TP collectives scale by 1 / (1 - bubble). The stage weights'
gathers and gradient reductions are `maxpar.plan.weight_comms`'s.
"""

from __future__ import annotations

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
