"""Parameters, FLOPs and per-device memory of a config on a layout.

FLOPs come from `maxpar.io.metrics` (the same numbers the trainer logs); the
parameter breakdown and memory come from the traced train state and its
shardings, so they follow the model code and the logical axis rules as they are.
"""

from __future__ import annotations


import numpy as np

from maxpar.core.axes import Logical
from maxpar.core.config import BLOCK_ATTENTION, Config
from maxpar.core.layout import TracedState
from maxpar.core.op_schedule import held_inputs
from maxpar.model.arithmetic import attention_head_widths, matmul_params, parameter_counts, training_flops_per_token
from maxpar.model.roles import Block, ParamRole
from maxpar.model.routing import expert_capacity
from maxpar.plan.tensors import Layout, Tensor
from maxpar.plan.muon import muon_working_bytes


def param_breakdown(state: TracedState, layout: Layout) -> dict[str, int]:
    """total, embedding (token table), attention, mlp (dense MLPs and routers), experts, output projection,
    norms, and active: what one token uses (of each MoE layer's experts, only num_experts_per_tok); mtp and
    mtp_active: the multi-token prediction modules' share of total and active."""
    counts = parameter_counts(state.abstract.params, layout.config.num_experts_per_tok)
    by_block = {str(block): sum(t.size for t in layout.params(block))
                for block in (Block.ATTENTION, Block.MLP, Block.EXPERTS, Block.OUTPUT, Block.NORM)}
    return {"total": counts["total"], "embedding": counts["embedding"], **by_block, "active": counts["active"],
            "mtp": counts["mtp"], "mtp_active": counts["mtp_active"]}


def attention_flops_per_token(config: Config) -> float:
    """Training FLOPs per token of the causal attention scores and weighted sum (fwd + bwd)."""
    return training_flops_per_token(config) - 6 * matmul_params(config)


def fp8_matmul_params(config: Config) -> int:
    """Weights per token that quantization=fp8 runs in fp8 matmuls: every matmul weight but the output projection
    and the MoE layers' router (q, k, v, out, the dense MLP and the experts' active weights); 0 without fp8. The
    multi-token prediction modules' layers count, their projections and output projections do not."""
    if config.quantization != "fp8":
        return 0
    e, mtp = config.emb_dim, config.mtp_num_layers
    router = (config.num_moe_layers + (mtp if config.num_experts > 1 else 0)) * e * config.num_experts
    return matmul_params(config) - (1 + mtp) * e * config.vocab_size - mtp * 2 * e * e - router


def dtype_bytes(name: str) -> int:
    return np.dtype(name).itemsize


def tp_degrees(layout: Layout) -> dict[str, int]:
    """How many ways the feature dims that activations carry are split (by non-batch axes)."""
    def of(tensor: Tensor | None, logical: str) -> int:
        if tensor is None:
            return 1
        return layout.group_degree([a for a in tensor.dim_axes(logical) if a not in layout.batch_axes])
    # The feed-forward's hidden layer: the dense MLPs', else (every layer MoE) the experts'.
    mlp = layout.param(ParamRole.MLP_GATE) or layout.param(ParamRole.EXPERT_GATE)
    return {"heads": of(layout.param(ParamRole.QUERY) or layout.param(ParamRole.QUERY_B), Logical.HEADS),
            "kv_heads": of(layout.param(ParamRole.KEY), Logical.KV_HEADS),
            "mlp": of(mlp, Logical.MLP),
            "vocab": of(layout.param(ParamRole.OUTPUT) or layout.param(ParamRole.EMBEDDING), Logical.VOCAB),
            "length": layout.group_degree([a for a in layout.residual_axes[1] if a not in layout.batch_axes]),
            "embed": layout.group_degree([a for a in layout.residual_axes[2] if a not in layout.batch_axes])}


def kv_widths(config: Config, tp: dict[str, int]) -> tuple[float, float]:
    """Per-token features one device holds of k and of v: its KV heads', or MLA's keys and values expanded per
    head from the latent (maxpar/model/mla.py: every query head has its own), split like q's heads."""
    qk, dv = attention_head_widths(config)
    if config.attention_type == "mla":
        heads = config.num_query_heads / tp["heads"]
    else:
        heads = config.num_kv_heads / tp["kv_heads"]
    return heads * qk, heads * dv


def attention_widths(config: Config, tp: dict[str, int]) -> tuple[float, float, float]:
    """Per-token features one device holds of q, of k and v together, and of the attention output."""
    qk, dv = attention_head_widths(config)
    heads = config.num_query_heads / tp["heads"]
    return heads * qk, sum(kv_widths(config, tp)), heads * dv


def mla_latent_widths(config: Config, tp: dict[str, int]) -> tuple[float, float]:
    """Per-token features MLA keeps beyond q, k, v's widths (maxpar/model/mla.py; (0, 0) for GQA): without remat,
    the compressed q and its normed copy (2 q_lora_rank), the compressed kv [kv_lora_rank + qk_rope_head_dim] and
    its normed latent; under `minimal`, the saved projections' outputs hold the compressed q and kv but not k's
    rope part per head (one k_rope broadcast to every head), so with many heads this term is negative. The latents
    are not split over heads."""
    if config.attention_type != "mla":
        return 0.0, 0.0
    compressed = config.kv_lora_rank + config.qk_rope_head_dim
    shared_rope = config.num_query_heads / tp["heads"] * config.qk_rope_head_dim
    return 2 * config.q_lora_rank + compressed + config.kv_lora_rank, config.q_lora_rank + compressed - shared_rope


def activation_bytes_per_token(config: Config, layout: Layout) -> dict[str, float]:
    """Bytes per local token kept for the backward pass, per layer, under each remat policy.

    `none` keeps what autodiff needs: the residual stream and norm outputs (4 x emb),
    q/k/v, the attention probabilities (float32 and `dtype`, seq per head: maxpar
    materialises the full causal score matrix) and mask, the attention output, and
    the MLP's gate, up and their product (`swiglu` saves only its inputs). `minimal` (the
    named weight projections saved) keeps the projections' outputs the backward pass reads
    (q, k, v, attention output, gate, up: `projections`; the down projection's output only
    feeds the residual sum) and the layer input; `full` keeps only the layer input.

    attention=blockwise or splash keeps no probabilities: their custom VJPs save the float32
    log-sum-exp per query and head instead (no seq term). Context parallelism splits
    every token's activations over `context` (the residual through tp["length"]), and
    the all_gather strategy keeps the gathered k, v of the whole sequence per layer.
    MLA adds its latents (`mla_latent_widths`).
    """
    tp = tp_degrees(layout)
    cp = layout.context_degree
    a = dtype_bytes(config.dtype)
    e = config.emb_dim / (tp["length"] * tp["embed"])
    q, kv, out = attention_widths(config, tp)
    latents, saved_latents = mla_latent_widths(config, tp)
    heads, m, s = config.num_query_heads / tp["heads"], config.mlp_dim / tp["mlp"], config.max_target_length
    if config.attention in BLOCK_ATTENTION:
        gathered = kv * a * (cp - 1) if config.context_parallel_strategy == "all_gather" else 0.0
        none = ((q + kv + out + latents + 3 * m) * a + heads * 4 + gathered + 2 * 4) / cp + 4 * e * a
    else:
        none = (4 * e + q + kv + out + latents + 3 * m) * a + heads * s * (4 + a) + s + 2 * 4
    projections = (q + kv + saved_latents + 2 * m) * a / cp + e * a
    full = e * a
    return {"none": none, "minimal": projections + full, "full": full, "projections": projections}


def capacity_slots_per_row(config: Config, context: int = 1) -> int:
    """Slots per expert and row in one device's capacity buffers: the row's capacity, at most the L / context
    tokens a context shard holds of the row (maxpar.model.moe_dispatch.capacity_local)."""
    k, n = config.num_experts_per_tok, config.num_experts
    capacity = expert_capacity(config.max_target_length, k, n, config.capacity_factor)
    return min(capacity, config.max_target_length // context)


def moe_rows_per_token(config: Config, layout: Layout) -> float:
    """Token copies one device's experts compute per local token (maxpar.model.moe_dispatch).

    Dropless: k without EP; with EP the fixed chunks, EP x min(k, experts per device).
    Capacity: the buffers' experts x slots per row, over the row's tokens on this device (L / context degree).
    """
    k, n = config.num_experts_per_tok, config.num_experts
    if config.capacity_factor > 0:
        cp = layout.context_degree
        return n * capacity_slots_per_row(config, cp) * cp / config.max_target_length
    experts = layout.params(Block.EXPERTS)[0]
    ep = layout.group_degree(experts.dim_axes(Logical.EXP))
    return k if ep == 1 else ep * min(k, n // ep)


def moe_activation_bytes_per_token(config: Config, layout: Layout, masked_ragged_dot: bool = False) -> dict[str, float]:
    """Bytes per token of a batch shard a MoE layer keeps for the backward pass beyond a dense MLP's, per remat
    policy (context parallelism: each of the C shards holds 1/C of the tokens).

    `none`: per computed copy its input row and gate/up/product (rows x (emb + 3 moe_mlp_dim)),
    the k results combined per token, router logits and probabilities (float32), the shared experts' gate/up/product.
    `minimal` keeps the router logits (named like the projections) instead of
    the dense MLP's gate and up. `masked_ragged_dot`: the backend lowers
    `ragged_dot` as a dense dot of a group-masked copy of its input per local
    expert (XLA:CPU), kept for the weight gradients; a layer that remat re-runs
    in the backward pass holds those copies and their gradients at once
    (`working`; measured on XLA:CPU, where without remat the gradients reuse
    the layer's released activations).
    """
    if config.num_moe_layers == 0:
        return {"none": 0.0, "minimal": 0.0, "full": 0.0, "working": 0.0}
    a, tp = dtype_bytes(config.dtype), tp_degrees(layout)["mlp"]
    e, n, k = config.emb_dim, config.num_experts, config.num_experts_per_tok
    m, x = config.mlp_dim / tp, (config.moe_mlp_dim or config.mlp_dim) / tp  # the dense MLP's, an expert's width
    shared = config.num_shared_experts * x  # the shared experts: a dense SwiGLU every token runs
    rows = moe_rows_per_token(config, layout)
    none = rows * (e + 3 * x) * a + k * e * a + 2 * n * 4 + 3 * shared * a
    masked = 0.0
    if masked_ragged_dot and config.capacity_factor == 0:
        experts = layout.params(Block.EXPERTS)[0]
        masked = n / layout.group_degree(experts.dim_axes(Logical.EXP)) * rows * (2 * e + x) * a
    cp = layout.context_degree
    return {"none": (none + masked - 4 * m * a) / cp, "minimal": (n * 4 + 2 * (shared - m) * a) / cp, "full": 0.0,
            "working": masked / cp}


def layer_split(layout: Layout) -> int:
    """Into how many pieces the mesh splits the layer stack (the `stage` axis under the default rules)."""
    for t in layout.params():
        if Logical.LAYERS in t.logical:
            return layout.group_degree(t.dim_axes(Logical.LAYERS))
    return 1


def regathers_in_backward(config: Config) -> bool:
    """Whether the backward pass gathers again what the forward pass gathered (layer weights, TP-sequence inputs).

    A scan's backward loop only sees what autodiff stacked per layer, not the partitioner's gathered copies,
    and remat re-runs the forward; unscanned layers without remat keep the gathered arrays for the backward.
    """
    return config.scan_layers or config.remat_policy != "none"


def sequence_parallel(layout: Layout) -> bool:
    """TP-sequence: the residual stream is split on its length by a non-batch axis (not `context`)."""
    return bool(layout.live(a for a in layout.residual_axes[1] if a not in layout.batch_axes + layout.context_axes))


def gathered_weight_bytes(config: Config, layout: Layout) -> float:
    """FSDP-gathered copies alive at once: two decoder layers' (this and the next; all of them when kept for
    the backward pass), and the top-level weights.

    With pipeline_fsdp_ag_once a pipeline keeps its stage's whole stack gathered through the loop; with
    pipeline_fsdp_ag_per_repeat one window's blocks, two repeats' (2/R of the stage's stack).
    """
    whole_stage = layout.schedule is not None and config.pipeline_fsdp_ag_once
    per_repeat = layout.schedule is not None and config.pipeline_fsdp_ag_per_repeat
    total = 0.0
    for t in layout.params():
        batch = layout.weight_batch_axes(t)
        # An axis splitting a weight and the batch is gathered, except the experts' own (EP keeps them split).
        gathered_axes = [a for dim, axes in zip(t.logical, t.mesh_axes) if dim not in (Logical.LAYERS, Logical.EXP)
                         for a in axes if a in batch and layout.degree(a) > 1]
        if not gathered_axes or (t.block == Block.EMBEDDING and not layout.table_gathered):
            continue  # nothing to gather
        kept = layout.group_degree([a for dim, axes in zip(t.logical, t.mesh_axes) if dim != Logical.LAYERS
                                for a in axes if a not in batch or dim == Logical.EXP])
        # The table is gathered in its own dtype, and so are the stage weights gathered before the pipeline loop.
        size = t.dtype if t.block == Block.EMBEDDING or ((whole_stage or per_repeat) and t.layered) else config.dtype
        gathered = t.size / kept * dtype_bytes(size)
        # Unscanned layers without remat keep every layer's gathered weights for the backward pass.
        kept = not regathers_in_backward(config) and not sequence_parallel(layout)
        if t.layered and per_repeat:  # one window's blocks: two repeats' (1/R of the stage's stack each)
            gathered = gathered / layer_split(layout) / layout.schedule.num_repeats * 2
        elif t.layered and not kept:
            gathered = gathered / layer_split(layout) if whole_stage else gathered / config.num_decoder_layers * 2
        total += gathered
    return total


def state_bytes(layout: Layout) -> dict[str, float]:
    """One copy of the train state, summed over its shards (the seeds' "bytes per parameter" figures):
    the parameters' bytes and the optimizer state's (AdamW's two moments, in optimizer_state_dtype),
    each also per parameter."""
    count = sum(t.size for t in layout.params())
    params = sum(t.nbytes for t in layout.params())
    optimizer = sum(t.nbytes for t in layout.tensors if t.group == "optimizer")
    return {"params": params, "optimizer": optimizer, "params_per_parameter": params / count,
            "optimizer_per_parameter": optimizer / count}


def _pipelined_activation_bytes(config: Config, layout: Layout, tokens_per_microbatch: float,
                                masked_ragged_dot: bool) -> tuple[float, float]:
    """(saved, working) activation bytes of a pipelined step: every iteration keeps its block's activations of one
    pipeline microbatch, bubble included, and stage 0 holds the microbatch buffer and its gradient."""
    pipe = layout.schedule
    per_token = activation_bytes_per_token(config, layout)
    loop_tokens = tokens_per_microbatch * pipe.num_stages  # in the loop every stage sees its shard's rows
    run_tokens = loop_tokens / pipe.num_microbatches
    saved = run_tokens * per_token[config.remat_policy] * pipe.layers_per_block * pipe.num_iterations
    tp = tp_degrees(layout)
    residual = loop_tokens * config.emb_dim / (tp["length"] * tp["embed"]) * dtype_bytes(config.dtype)
    saved += 2 * residual  # stage 0's microbatch buffer and its gradient
    saved += loop_tokens * per_token[config.remat_policy] * config.first_num_dense_layers  # the prefix, before it
    working = run_tokens * _rerun_layer_bytes(config, per_token)
    if config.num_moe_layers:  # a block's MoE layers, on the same tokens
        moe = moe_activation_bytes_per_token(config, layout, masked_ragged_dot)
        moe_per_block = pipe.layers_per_block * config.num_moe_layers / config.num_stack_layers
        saved += run_tokens * moe[config.remat_policy] * moe_per_block * pipe.num_iterations
        rerun = moe["working"] if config.remat_policy != "none" else 0.0
        working += run_tokens * (moe["none"] + rerun)
    return saved, working


def _one_f_one_b_activation_bytes(config: Config, layout: Layout, tokens_per_microbatch: float,
                                  masked_ragged_dot: bool) -> tuple[float, float]:
    """(saved, working) activation bytes of pipeline_schedule=1f1b, zero_bubble or interleaved_1f1b
    (`maxpar.pipeline.one_f_one_b`): a stage keeps at most `held_inputs` block inputs (min(S, M); interleaved:
    2 (S - 1) + (R - 1) S + 1 of its R blocks, each L / (S R) layers) and as many waiting cotangents (one
    pipeline microbatch each; under zero_bubble both wait for W, and every stage holds S), and the loop's input
    and its cotangent (all M); a backward op (B, or zero_bubble's B or W) re-runs one block on one microbatch
    (the block's saved activations and one layer's re-run, transient), whatever M. The dense prefix runs
    before the executor on the loop's tokens, and keeps its activations for its backward after it."""
    pipe = layout.schedule
    per_token = activation_bytes_per_token(config, layout)
    loop_tokens = tokens_per_microbatch * pipe.num_stages  # in the loop every stage sees its shard's rows
    run_tokens = loop_tokens / pipe.num_microbatches
    residual = config.emb_dim * dtype_bytes(config.dtype)  # per token: a stage input, or its cotangent
    held = held_inputs(pipe.kind, pipe.num_stages, pipe.num_microbatches, pipe.num_repeats)
    saved = (2 * held * run_tokens + 2 * loop_tokens) * residual
    saved += loop_tokens * per_token[config.remat_policy] * config.first_num_dense_layers
    working = run_tokens * (per_token[config.remat_policy] * pipe.layers_per_block
                            + _rerun_layer_bytes(config, per_token))
    if config.num_moe_layers:  # the re-run block's MoE layers, on the same tokens
        moe = moe_activation_bytes_per_token(config, layout, masked_ragged_dot)
        moe_per_block = pipe.layers_per_block * config.num_moe_layers / config.num_stack_layers
        rerun = moe["working"] if config.remat_policy != "none" else 0.0
        working += run_tokens * (moe[config.remat_policy] * moe_per_block + moe["none"] + rerun)
    return saved, working


def _rerun_layer_bytes(config: Config, per_token: dict[str, float]) -> float:
    """Per token: one layer re-run (or kept) in the backward pass; under `minimal` its projections are already saved."""
    return per_token["none"] - (per_token["projections"] if config.remat_policy == "minimal" else 0.0)


def layer_activation_bytes(config: Config, layout: Layout, tokens_per_microbatch: float,
                           masked_ragged_dot: bool) -> tuple[float, float]:
    """(saved, working): the activations the layers keep for the backward pass, and the one layer's re-run (or
    kept) at a time, dense and MoE."""
    if layout.ops:
        return _one_f_one_b_activation_bytes(config, layout, tokens_per_microbatch, masked_ragged_dot)
    if layout.schedule:
        return _pipelined_activation_bytes(config, layout, tokens_per_microbatch, masked_ragged_dot)
    per_token = activation_bytes_per_token(config, layout)
    moe = moe_activation_bytes_per_token(config, layout, masked_ragged_dot)
    layers = config.num_decoder_layers / layer_split(layout)
    moe_layers = config.num_moe_layers / layer_split(layout)
    saved = tokens_per_microbatch * (per_token[config.remat_policy] * layers + moe[config.remat_policy] * moe_layers)
    rerun = moe["working"] if config.remat_policy != "none" else 0.0
    working = tokens_per_microbatch * (_rerun_layer_bytes(config, per_token)
                                       + (moe["none"] + rerun if moe_layers else 0.0))
    return saved, working


def mtp_activation_bytes(config: Config, layout: Layout, tokens_per_microbatch: float) -> float:
    """What the multi-token prediction modules (maxpar/model/mtp.py) hold at the start of the backward pass: each
    ran after the stack (and any pipeline) on the whole microbatch and keeps its layer's activations (remat as the
    stack's; a MoE layer's when the model has experts), its float32 logits and its projection's and head's inputs
    (3 emb); one module's layer is re-run (or kept) at a time. Their layers are in no loop, so XLA:CPU keeps no
    masked ragged_dot copies of them (measured)."""
    if not config.mtp_num_layers:
        return 0.0
    tp = tp_degrees(layout)
    per_token = activation_bytes_per_token(config, layout)
    layer, working = per_token[config.remat_policy], _rerun_layer_bytes(config, per_token)
    if config.num_experts > 1:
        moe = moe_activation_bytes_per_token(config, layout)
        layer, working = layer + moe[config.remat_policy], working + moe["none"]
    logits = config.vocab_size / tp["vocab"] / layout.context_degree * 4
    inputs = 3 * config.emb_dim / (tp["length"] * tp["embed"]) * dtype_bytes(config.dtype)
    return tokens_per_microbatch * (config.mtp_num_layers * (layer + logits + inputs) + working)


def memory_per_device(config: Config, layout: Layout, tokens_per_microbatch: float,
                      masked_ragged_dot: bool = False) -> dict[str, float]:
    """Peak bytes per device: state, gradients, saved activations and transient buffers.

    tokens_per_microbatch: tokens of one microbatch on one batch shard. `config`
    is the layout's, or a variant of it (verify uses one with float32 activations).
    masked_ragged_dot: see `moe_activation_bytes_per_token` (verify sets it on XLA:CPU).
    """
    params = sum(layout.local_bytes(t) for t in layout.params())
    reference = sum(layout.local_bytes(t) for t in layout.reference())  # DPO's frozen copy (not under LoRA)
    optimizer = sum(layout.local_bytes(t) for t in layout.tensors if t.group in ("optimizer", "step"))
    gradients = sum(layout.local_bytes(t) for t in layout.trained())  # under LoRA the adapters' only
    if config.gradient_accumulation_steps > 1:  # float32 accumulators, sharded like the parameters
        gradients += sum(layout.local_bytes(t) / dtype_bytes(t.dtype) * 4 for t in layout.trained())
    saved, working = layer_activation_bytes(config, layout, tokens_per_microbatch, masked_ragged_dot)
    logits = (tokens_per_microbatch * config.vocab_size / tp_degrees(layout)["vocab"] / layout.context_degree
              * 4 * 2)  # f32 logits and their gradient, split over the sequence too under context parallelism
    # The MTP modules' backward pass runs first and ends before the stack's: not alive with its working set.
    activations = saved + logits + max(working, mtp_activation_bytes(config, layout, tokens_per_microbatch))
    gathered = gathered_weight_bytes(config, layout)
    # Muon's whole matrices live after the backward pass, when the activations are gone
    muon = muon_working_bytes(layout)
    total = params + reference + optimizer + gradients + max(activations + gathered, muon)
    return {"params": params, "reference": reference, "gradients": gradients, "optimizer": optimizer,
            "activations": activations, "gathered_weights": gathered, "muon_working": muon, "total": total}
