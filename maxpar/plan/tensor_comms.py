"""Predicted collectives of tensor-parallel activations: per layer, the loss and the token lookup.

- TP, Megatron style (a non-batch axis sharding heads / mlp / vocab): per layer,
  all-reduce the block output in the forward pass and the block input's
  gradient in the backward pass (all-gather + reduce-scatter of the same bytes
  when the residual stream is sequence-sharded); the vocab-sharded loss reduces
  its max / sum / label logit over that axis.
- TP-transpose: the dense MLP weights split on embed; the hidden activations move (`tp_transpose_comms`).
- The token-embedding lookup: a table split on embed over batch axes only (FSDP)
  is looked up on its shards: the token ids are gathered, each shard looks up
  every token's slice and an all-to-all moves the rows to their batch shards (and
  their gradient back), so the lookup's gradient needs no FSDP reduction. Any
  other table has its embed shards gathered first (an FSDP gather, once per
  step); a vocab-sharded one looks up its own rows and all-reduces them.

Under a pipeline the layers run every iteration, bubble included (`maxpar.plan.comms.layer_runs`).
"""

from __future__ import annotations

from collections.abc import Iterable

from maxpar.core.axes import Logical
from maxpar.core.config import Config
from maxpar.model.roles import ParamRole
from maxpar.plan.comms import (BACKWARD, FORWARD, Comm, LayerRuns, fsdp_axes, hierarchical,
                               residual_split_axes, sequence_axes, tp_axes)
from maxpar.plan.tensors import Layout
from maxpar.plan.model_math import dtype_bytes, regathers_in_backward


# ---------------------------------------------------------------- Megatron blocks

def tp_block_steps(config: Config, residual: float, shard: float, parts: int, sequence_parallel_block: bool,
                   label: str, gradient: float | None = None) -> list[tuple[str, str, str, float, int]]:
    """(phase, what, collective, operand bytes, partial sums XLA:CPU reduces one by one) of one Megatron block:
    an all-reduce after it and of its input gradient, or under TP-sequence an all-gather before and a
    reduce-scatter after (and their transposes). `parts`: the projections whose partial sums the input
    gradient adds (q, k, v, or gate, up); `gradient`: the bytes of that partial input gradient where it is not the
    residual's (MLA's split projections read its low-rank latents)."""
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
                 (BACKWARD, "input-gradient all-reduce", "all-reduce", residual if gradient is None else gradient,
                  parts)]
        recomputed = "all-reduce"
    if config.remat_policy == "full" and label == "attention":
        # remat=full re-runs the layer in the backward pass up to the MLP input, which needs the attention
        # block's output again (the MLP's own output is not needed).
        steps.append((BACKWARD, f"output {recomputed} recomputed by remat=full", recomputed, residual, 1))
    return steps


def tp_block_comms(layout: Layout, label: str, axes: tuple[str, ...], parts: int, runs: LayerRuns,
                   count: float, gradient: float | None = None) -> list[Comm]:
    """One Megatron-style block (attention or MLP) split over the TP `axes`, `count` runs per step."""
    config = layout.config
    sequence_parallel_block = bool(set(axes) & set(residual_split_axes(layout, (1, 2))))
    shard = runs.residual / layout.group_degree(axes)
    return [c for phase, what, collective, size, cpu_parts
            in tp_block_steps(config, runs.residual, shard, parts, sequence_parallel_block, label, gradient)
            for c in hierarchical(layout, f"TP {label} {what} ({phase})", axes, collective, size, count=count,
                                  phase=phase, dtype=config.dtype, scales=True, cpu_parts=cpu_parts)]


def _split_parts(layout: Layout, axes: tuple[str, ...], projections: Iterable[tuple[ParamRole, str]]) -> int:
    """How many of these input projections are split over (some of) the block's TP axes."""
    return sum(1 for role, dim in projections if set(tp_axes(layout, layout.param(role), dim)) & set(axes))


def attention_tp_comms(layout: Layout, runs: LayerRuns, label: str = "attention") -> list[Comm]:
    """Heads split over non-batch axes: Megatron attention. MLA's split projections are its per-head ones (q or
    query_b, key_value_b): the input gradient summed over the heads is theirs, at the width of their inputs (the
    query's latent or the residual, the key/value latent) plus the shared RoPE key's, one all-reduce of the three
    (the low-rank projections before them are whole on every device)."""
    config = layout.config
    axes = tp_axes(layout, layout.param(ParamRole.QUERY) or layout.param(ParamRole.QUERY_B), Logical.HEADS)
    if not axes:
        return []
    if config.attention_type == "mla":
        width = (config.q_lora_rank or config.emb_dim) + config.kv_lora_rank + config.qk_rope_head_dim
        return tp_block_comms(layout, label, axes, 1, runs, runs.count,
                              gradient=runs.residual * width / config.emb_dim)
    parts = _split_parts(layout, axes, ((ParamRole.QUERY, Logical.HEADS), (ParamRole.KEY, Logical.KV_HEADS),
                                        (ParamRole.VALUE, Logical.KV_HEADS)))
    return tp_block_comms(layout, label, axes, parts, runs, runs.count)


def mtp_runs(layout: Layout, tokens: float, microbatches: int) -> LayerRuns:
    """The multi-token prediction modules' decoder layers: each runs once per microbatch on the whole microbatch,
    after the stack (and after any pipeline)."""
    config = layout.config
    return LayerRuns(count=config.mtp_num_layers * microbatches,
                     residual=tokens * config.emb_dim * dtype_bytes(config.dtype))


def _dense_layer_share(layout: Layout) -> float:
    """The share of the layers `layer_runs` counts whose feed-forward is a dense MLP (the MoE layers':
    maxpar.plan.moe_comms); a pipeline's runs are its stack's, without the dense prefix."""
    config = layout.config
    return 1 - config.num_moe_layers / (config.num_stack_layers if layout.schedule else config.num_decoder_layers)


def mlp_tp_comms(layout: Layout, runs: LayerRuns) -> list[Comm]:
    """The dense MLPs' hidden layer split over non-batch axes: Megatron MLP."""
    axes = tp_axes(layout, layout.param(ParamRole.MLP_GATE), Logical.MLP)
    if not axes:
        return []
    parts = _split_parts(layout, axes, ((ParamRole.MLP_GATE, Logical.MLP), (ParamRole.MLP_UP, Logical.MLP)))
    return tp_block_comms(layout, "MLP", axes, parts, runs, runs.count * _dense_layer_share(layout))


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
    axes = tp_axes(layout, layout.param(ParamRole.MLP_GATE), Logical.MLP_EMBED)
    if not axes or count <= 0:
        return []
    a = dtype_bytes(config.dtype)
    t = layout.group_degree(axes)
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
    if layout.schedule is None:
        for phase in (FORWARD, BACKWARD):
            comms += hierarchical(layout, f"TP-transpose residual all-gather at the final norm ({phase})", axes,
                                  "all-gather", residual / t, count=microbatches, phase=phase, dtype=config.dtype,
                                  scales=True)
    return comms


# ---------------------------------------------------------------- the loss, TP-sequence's inputs, the token lookup

def loss_tp_comms(layout: Layout, tokens: float, microbatches: int) -> list[Comm]:
    """The vocab-parallel loss: its max, sum and label logit reduced over the vocab shards, and the output
    projection's input gradient."""
    config = layout.config
    projection = layout.param(ParamRole.OUTPUT) or layout.param(ParamRole.EMBEDDING)
    sequence_sharded = residual_split_axes(layout, (1, 2))
    axes = tuple(a for a in tp_axes(layout, projection, Logical.VOCAB) if a not in sequence_sharded)
    residual = tokens * config.emb_dim * dtype_bytes(config.dtype)
    heads = microbatches * (1 + config.mtp_num_layers)  # the MTP modules share the output projection
    return (hierarchical(layout, "TP loss max / sum / label-logit all-reduces (forward)", axes, "all-reduce",
                         3 * tokens * 4, count=heads, phase=FORWARD, dtype="float32", scales=True)
            + hierarchical(layout, "TP output-projection input-gradient all-reduce (backward)", axes, "all-reduce",
                           residual, count=heads, phase=BACKWARD, dtype=config.dtype, scales=True))


def sequence_input_comms(layout: Layout, tokens: float, microbatches: int) -> list[Comm]:
    """TP-sequence without a pipeline: attention constrains positions and segment ids to its whole-length q,
    gathered once per step."""
    axes = residual_split_axes(layout, (1, 2))
    if not axes or layout.schedule:
        return []
    return hierarchical(layout, "TP-sequence positions and segment ids all-gather (forward)", axes, "all-gather",
                        2 * tokens / layout.group_degree(axes) * 4, count=microbatches, phase=FORWARD, dtype="int32",
                        scales=True)


def lookup_comms(layout: Layout, tokens: float, microbatches: int) -> list[Comm]:
    """The token lookup's own collectives: on embed shards, the ids' all-gather and the rows' all-to-all (and
    back); on a vocab-sharded table, the looked-up rows summed over the vocab shards. Each MTP module looks up
    its own (shifted) tokens in the same table."""
    table = layout.param(ParamRole.EMBEDDING)
    lookups = microbatches * (1 + layout.config.mtp_num_layers)
    if table is not None and layout.lookup_on_shards:
        axes = fsdp_axes(layout, table)
        rows = tokens * layout.config.emb_dim * dtype_bytes(table.dtype)  # one device's before the all-to-all
        comms = hierarchical(layout, "embedding lookup token-id all-gather", axes, "all-gather", tokens * 4,
                             count=lookups, phase=FORWARD, dtype="int32", scales=True)
        for phase in (FORWARD, BACKWARD):
            comms += hierarchical(layout, f"embedding lookup all-to-all ({phase})", axes, "all-to-all", rows,
                                  count=lookups, phase=phase, dtype=table.dtype, scales=True)
        return comms
    # Under TP-sequence the table is gathered (weight_comms) and each sequence shard looks up its own tokens.
    sequence = sequence_axes(layout, table) if table else ()
    vocab_axes = tuple(a for a in tp_axes(layout, table, Logical.VOCAB) if a not in sequence)
    if table is None or not vocab_axes:
        return []
    rows = tokens * layout.config.emb_dim * dtype_bytes(table.dtype)
    return hierarchical(layout, "TP embedding lookup all-reduce (forward)", vocab_axes, "all-reduce", rows,
                        count=lookups, phase=FORWARD, dtype=table.dtype, scales=True)


def tensor_comms(layout: Layout, runs: LayerRuns, tokens: float, microbatches: int) -> list[Comm]:
    """Tensor-parallel activations per layer (Megatron attention and MLP, TP-transpose), the vocab-parallel loss
    and TP-sequence's inputs; tokens = one microbatch's per batch shard."""
    per_token = layout.config.emb_dim * dtype_bytes(layout.config.dtype)
    mtp = mtp_runs(layout, tokens, microbatches)  # a dense model's MTP MLPs here; MoE ones: maxpar.plan.moe_comms
    return (attention_tp_comms(layout, runs)
            + attention_tp_comms(layout, mtp, "MTP attention")
            + mlp_tp_comms(layout, runs)
            + (mlp_tp_comms(layout, mtp) if layout.config.num_experts == 1 else [])
            + tp_transpose_comms(layout, runs.residual / per_token, runs.count * _dense_layer_share(layout),
                                 microbatches)
            + loss_tp_comms(layout, tokens, microbatches)
            + sequence_input_comms(layout, tokens, microbatches))
