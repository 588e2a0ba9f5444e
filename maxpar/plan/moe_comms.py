"""Predicted collectives of the mixture-of-experts layers, as `maxpar.model.moe_dispatch` writes them.

The expert weights and the token exchange live inside a `jax.shard_map`, so
their collectives are the ones written there, not ones the partitioner picks:

- FSDP: each expert weight is all-gathered over the batch axes that split its
  embed (or mlp) dim, once per MoE layer and microbatch in the forward pass
  (the backward pass reuses the gathered copy, unless remat recomputes the
  layer), and its gradient is reduce-scattered back (a real reduce-scatter,
  also on XLA:CPU); batch axes that do not split it all-reduce that shard (DP).
  The `exp` dim is never gathered: over the EP axes each device keeps its experts.
- EP (sharding-strategies.md): two all-to-alls per MoE layer in the forward
  pass (tokens to their experts, results back) and two in the backward pass.
  Dropless sends fixed chunks of `tokens x min(k, experts per device)` rows to
  each EP peer (XLA:CPU has no ragged all-to-all), plus the per-expert counts;
  capacity mode sends its `experts x rows x capacity` buffers.
- TP: the mlp-split experts give partial outputs, all-reduced over the tensor
  axes in the forward pass; the input gradient is all-reduced in the backward pass.

Remat recomputes the forward all-gathers and all-to-alls in the backward pass
(the layer's output all-reduce is not needed there).
"""

from __future__ import annotations

import dataclasses

from maxpar.core.axes import Logical
from maxpar.core.config import Config
from maxpar.model.roles import Block, ParamRole
from maxpar.plan.comms import BACKWARD, FORWARD, Comm, expert_all_to_all_bytes, hierarchical, stage_loop, tp_axes
from maxpar.plan.tensors import Layout, Tensor
from maxpar.plan.model_math import capacity_slots_per_row, dtype_bytes, layer_split


def gathered_axes(layout: Layout, t: Tensor) -> tuple[str, ...]:
    """Axes an expert weight is all-gathered over: the batch and context axes of its dims other than `exp`."""
    return layout.live(a for dim, axes in zip(t.logical, t.mesh_axes) if dim not in (Logical.EXP, Logical.LAYERS)
                       for a in axes if a in layout.batch_axes + layout.context_axes)


def expert_weight_comms(layout: Layout, microbatches: int) -> list[Comm]:
    """FSDP gathers, reduce-scatters and DP all-reduces of the expert weights (written in the shard_map)."""
    config = layout.config
    gathers = 1 if config.remat_policy == "none" else 2
    # In a pipeline every iteration runs one block (1/R of a stage's layers) on a pipeline microbatch: the
    # dispatch gathers that block's experts then and reduces their gradient then; the batch axes the loop
    # runs per replica reduce once per step after it.
    loop = stage_loop(layout)
    comms: list[Comm] = []
    for t in layout.params(Block.EXPERTS):
        size = layout.local_bytes(t) / dtype_bytes(t.dtype) * dtype_bytes(config.dtype)
        gather = gathered_axes(layout, t)
        full = size * layout.group_degree(gather)
        common = dict(dtype=config.dtype, scales=False, tensor=t.name)
        # The MTP modules' experts run once per microbatch after the loop, like unpipelined ones.
        in_loop = loop.pipelined and t.layered
        looped = microbatches * (loop.per_iteration if t.layered else 1)
        comms += hierarchical(layout, "MoE expert-weight all-gather (forward)", gather, "all-gather", size,
                              count=looped, phase=FORWARD, **common)
        comms += hierarchical(layout, "MoE expert-weight all-gather recomputed by remat (backward)", gather,
                              "all-gather", size, count=looped * (gathers - 1), phase=BACKWARD, **common)
        comms += [_explicit(c) for c in hierarchical(layout, "MoE expert-weight gradient reduce-scatter", gather,
                                                     "reduce-scatter", full, count=looped, phase=BACKWARD,
                                                     **common)]
        if in_loop and layout.ops:
            continue  # the executor's psum over the replicas reduces them (pipeline_comms._explicit_gradient_comms)
        reduce = layout.live(a for a in layout.weight_batch_axes(t) if a not in t.axes)
        inner = tuple(a for a in reduce if a not in loop.manual)
        if in_loop and inner:
            comms += hierarchical(layout, "MoE expert-weight gradient all-reduce (DP, per pipeline iteration)", inner,
                                  "all-reduce", size, count=looped, phase=BACKWARD, **common)
            reduce = tuple(a for a in reduce if a in loop.manual)
        comms += hierarchical(layout, "MoE expert-weight gradient all-reduce (DP)", reduce, "all-reduce", size,
                              count=microbatches, phase=BACKWARD, **common)
    return comms


def _explicit(comm: Comm) -> Comm:
    return dataclasses.replace(comm, explicit=True)


def dispatch_bytes(config: Config, tokens: float, ep: int, context: int = 1) -> float:
    """Operand bytes of one all-to-all moving one device's `tokens` copies to their experts' devices (or back);
    `context`: the shards a row's tokens are split into (capacity buffers of a shard: at most its tokens)."""
    a = dtype_bytes(config.dtype)
    k, experts = config.num_experts_per_tok, config.num_experts
    if config.capacity_factor > 0:
        rows = tokens * context / config.max_target_length
        return experts * rows * capacity_slots_per_row(config, context) * config.emb_dim * a
    # Fixed chunks: every peer gets room for all copies this device could send it.
    return ep * expert_all_to_all_bytes(tokens, config.emb_dim, min(k, experts // ep), a)


def predict_moe_comms(layout: Layout, tokens_per_shard: float, microbatches: int) -> list[Comm]:
    """Every predicted collective of the MoE layers (`predict.step_comms` has the rest of the model);
    tokens_per_shard: one microbatch's per batch shard (context parallelism splits them further)."""
    local = tokens_per_shard / layout.context_degree
    return expert_weight_comms(layout, microbatches) + expert_activation_comms(layout, local, microbatches)


def expert_activation_comms(layout: Layout, tokens: float, microbatches: int) -> list[Comm]:
    """EP all-to-alls and TP all-reduces of the MoE layers; tokens = one microbatch's per batch and context shard."""
    config = layout.config
    if config.num_moe_layers == 0:
        return []
    experts = next(iter(layout.params(Block.EXPERTS)))
    ep_axes = layout.live(experts.dim_axes(Logical.EXP))
    hidden = layout.live(a for a in experts.dim_axes(Logical.MLP) if a not in layout.batch_axes)
    pipe, tokens_per_microbatch = layout.schedule, tokens
    if pipe:  # every iteration (bubble too) runs a block's MoE layers on a pipeline microbatch of all stages' rows
        count = pipe.num_iterations * pipe.layers_per_block * config.num_moe_layers / config.num_stack_layers \
            * microbatches
        tokens = tokens * pipe.num_stages / pipe.num_microbatches
    else:
        count = config.num_moe_layers / layer_split(layout) * microbatches
    comms = _moe_layer_comms(layout, ep_axes, hidden, tokens, count)
    if config.mtp_num_layers:  # the MTP modules' MoE layers: after the stack, on whole microbatches
        comms += _moe_layer_comms(layout, ep_axes, hidden, tokens_per_microbatch,
                                  config.mtp_num_layers * microbatches, "MTP ")
    return comms


def _moe_layer_comms(layout: Layout, ep_axes: tuple[str, ...], hidden: tuple[str, ...], tokens: float,
                     count: float, label: str = "") -> list[Comm]:
    """EP all-to-alls and TP all-reduces of `count` MoE layer runs on `tokens` per batch shard each; the shared
    experts, a dense MLP split like the experts' mlp dim, all-reduce their output and input gradient (of the gate
    and up projections apart on XLA:CPU) besides."""
    config = layout.config
    recomputed = 0 if config.remat_policy == "none" else 2
    comms: list[Comm] = []
    if ep_axes:
        size = dispatch_bytes(config, tokens, layout.group_degree(ep_axes), layout.context_degree)
        for phase, n in ((FORWARD, 2), (BACKWARD, 2 + recomputed)):
            comms += hierarchical(layout, f"{label}EP token all-to-all ({phase})", ep_axes, "all-to-all", size,
                                  count=count * n, phase=phase, dtype=config.dtype, scales=True)
        if config.capacity_factor == 0:  # tokens per expert, sent ahead of the tokens (int32)
            comms += hierarchical(layout, f"{label}EP expert-count all-to-all (forward)", ep_axes, "all-to-all",
                                  config.num_experts * 4, count=count * (1 + recomputed // 2), phase=FORWARD,
                                  dtype="int32", scales=False)
    if hidden:
        residual = tokens * config.emb_dim * dtype_bytes(config.dtype)
        for phase, what in ((FORWARD, "output"), (BACKWARD, "input-gradient")):
            comms += hierarchical(layout, f"{label}TP MoE {what} all-reduce ({phase})", hidden, "all-reduce",
                                  residual, count=count, phase=phase, dtype=config.dtype, scales=True)
    shared = tp_axes(layout, layout.param(ParamRole.SHARED_GATE), Logical.MLP)
    if shared:
        residual = tokens * config.emb_dim * dtype_bytes(config.dtype)
        for phase, what, parts in ((FORWARD, "output", 1), (BACKWARD, "input-gradient", 2)):
            comms += hierarchical(layout, f"{label}TP shared-expert {what} all-reduce ({phase})", shared,
                                  "all-reduce", residual, count=count, phase=phase, dtype=config.dtype, scales=True,
                                  cpu_parts=parts)
    return comms
