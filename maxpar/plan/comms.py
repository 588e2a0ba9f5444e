"""Predicted collectives of one training step, per mesh axis: what the strategies' rules share.

Each strategy is a few small rules, each one row of the seeds' tables applied to every weight of the real
model through its shardings (a `Layout`), not to a two-matrix caricature; they read weights by their role
(`maxpar.model.roles`) and axes from the layout. One module per strategy: FSDP gathers and the DP / FSDP
gradient reductions in `maxpar.plan.weight_comms`, ZeRO-1 in `maxpar.plan.zero_comms`; TP, TP-sequence,
TP-transpose, the vocab-parallel loss and the token lookup in `maxpar.plan.tensor_comms`; PP in
`maxpar.plan.pipeline_comms`; EP in `maxpar.plan.moe_comms`; CP's k/v traffic in `maxpar.plan.context_comms`.
`maxpar.plan.predict.step_comms` applies them all.

This module holds what they share: a collective (`Comm`); its split over the networks (`hierarchical`: over
an axis with a DCN degree, XLA reduce-scatters over ICI, all-reduces across DCN on the shard and all-gathers
back); which axes a weight's or an activation's collectives run over; how often a step runs a layer
(`layer_runs`) or gathers a stacked weight (`stage_loop`).

Bytes are what one device sends with bandwidth-optimal ring algorithms
(`maxpar.plan.hlo.wire_bytes`), the same formula `--verify` applies to the
compiled program.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from maxpar.model.roles import Block
from maxpar.plan.hlo import wire_bytes
from maxpar.plan.tensors import Layout, Tensor
from maxpar.plan.model_math import dtype_bytes, layer_split

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


# ---------------------------------------------------------------- which axes a weight's collectives run over

def fsdp_axes(layout: Layout, tensor: Tensor) -> tuple[str, ...]:
    """Axes that shard both this weight and the batch: the weight must be gathered."""
    return layout.live(a for a in tensor.axes if a in layout.weight_batch_axes(tensor))


def tp_axes(layout: Layout, tensor: Tensor | None, logical: str) -> tuple[str, ...]:
    """Non-batch axes sharding one feature dim of a weight: activations move over them. Not the context axes:
    context parallelism gathers the weights it shards, like FSDP."""
    if tensor is None:
        return ()
    return layout.live(a for a in tensor.dim_axes(logical)
                       if a not in layout.batch_axes and a not in layout.context_axes)


def residual_split_axes(layout: Layout, dims: Iterable[int]) -> tuple[str, ...]:
    """Non-batch, non-context axes splitting these dims of the residual stream [batch, length, embed]: TP-sequence
    (length) or TP-transpose (embed)."""
    excluded = layout.batch_axes + layout.context_axes
    return layout.live(a for d in dims for a in layout.residual_axes[d] if a not in excluded)


def sequence_axes(layout: Layout, tensor: Tensor) -> tuple[str, ...]:
    """Non-batch axes splitting the tokens a weight is applied to (TP-sequence: the residual stream's length).

    Only the norm scales, the token table and the output projection see the residual stream itself; the
    attention and MLP weights see activations whose length stays whole (activation_attn_length, _mlp_length).
    """
    if tensor.block not in (Block.NORM, Block.EMBEDDING, Block.OUTPUT):
        return ()
    return residual_split_axes(layout, (1,))


# ---------------------------------------------------------------- how often a step runs them

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
    pipe = layout.schedule
    if pipe is None:
        return StageLoop()
    return StageLoop(per_iteration=pipe.num_iterations / pipe.num_repeats, once=layout.config.pipeline_fsdp_ag_once,
                     per_repeat=layout.config.pipeline_fsdp_ag_per_repeat, manual=layout.pipeline_manual_axes,
                     repeats=pipe.num_repeats, pipelined=True)


@dataclasses.dataclass(frozen=True)
class LayerRuns:
    """How often a step runs a decoder layer, and the bytes of the residual stream one run reads on a device."""

    count: float
    residual: float


def layer_runs(layout: Layout, tokens: float, microbatches: int) -> LayerRuns:
    """Every pipeline iteration (bubble too) runs a block of layers on one pipeline microbatch of all stages'
    rows; without a pipeline each microbatch runs the device's share of the layer stack."""
    config, pipe = layout.config, layout.schedule
    residual = tokens * config.emb_dim * dtype_bytes(config.dtype)
    if pipe:
        return LayerRuns(count=pipe.num_iterations * pipe.layers_per_block * microbatches,
                         residual=residual * pipe.num_stages / pipe.num_microbatches)
    return LayerRuns(count=config.num_decoder_layers / layer_split(layout) * microbatches, residual=residual)


def expert_all_to_all_bytes(tokens: float, emb_dim: int, experts_per_token: int, dtype_size: int) -> float:
    """Operand of one expert-parallel dispatch (or combine) all-to-all: each token's copies for its experts.

    sharding-strategies.md (EP): moving between batch and expert sharding sends
    the routed activations, tokens x experts_per_token x emb; with compute
    2 x that x mlp per matmul, the arithmetic intensity is mlp_dim.
    `maxpar.plan.moe_comms` applies it to the MoE layers' real exchange.
    """
    return tokens * experts_per_token * emb_dim * dtype_size
