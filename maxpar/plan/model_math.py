"""Parameters, FLOPs and per-device memory of a config on a layout.

FLOPs come from `maxpar.metrics` (the same numbers the trainer logs); the
parameter breakdown and memory come from the traced train state and its
shardings, so they follow the model code and the logical axis rules as they are.
"""

from __future__ import annotations

import math

import numpy as np

from maxpar.config import Config
from maxpar.metrics import matmul_params, parameter_counts, training_flops_per_token
from maxpar.plan.layout import Layout, ModelState


def param_breakdown(state: ModelState, layout: Layout) -> dict[str, int]:
    """total, embedding (token table), attention, mlp, output projection, norms, active (all: dense)."""
    counts = parameter_counts(state.abstract.params)
    by_role = {role: sum(t.size for t in layout.params(role)) for role in ("attention", "mlp", "output", "norm")}
    return {"total": counts["total"], "embedding": counts["embedding"], **by_role,
            # Every parameter takes part in every token of a dense model; a mixture-of-experts
            # layer would count only experts_per_token of its experts here.
            "active": counts["total"]}


def attention_flops_per_token(config: Config) -> float:
    """Training FLOPs per token of the causal attention scores and weighted sum (fwd + bwd)."""
    return training_flops_per_token(config) - 6 * matmul_params(config)


def dtype_bytes(name: str) -> int:
    return np.dtype(name).itemsize


def _degree(layout: Layout, axes) -> int:
    return math.prod(layout.degree(a) for a in axes)


def tp_degrees(layout: Layout) -> dict[str, int]:
    """How many ways the feature dims that activations carry are split (by non-batch axes)."""
    def of(name: str, logical: str) -> int:
        tensor = layout.param(name)
        if tensor is None:
            return 1
        return _degree(layout, [a for a in tensor.dim_axes(logical) if a not in layout.batch_axes])
    table = layout.param("['output']") or layout.param("['token_embedding']")
    return {"heads": of("['query']", "heads"), "kv_heads": of("['key']", "kv_heads"), "mlp": of("['wi_gate']", "mlp"),
            "vocab": _degree(layout, [a for a in table.dim_axes("vocab") if a not in layout.batch_axes]),
            "length": _degree(layout, [a for a in layout.residual_axes[1] if a not in layout.batch_axes]),
            "embed": _degree(layout, [a for a in layout.residual_axes[2] if a not in layout.batch_axes])}


def activation_bytes_per_token(config: Config, layout: Layout) -> dict[str, float]:
    """Bytes per local token kept for the backward pass, per layer, under each remat policy.

    `none` keeps what autodiff needs: the residual stream and norm outputs (4 x emb),
    q/k/v, the attention probabilities (float32 and `dtype`, seq per head: maxpar
    materialises the full causal score matrix) and mask, the attention output, and
    gate/up/silu/product of the MLP. `minimal` (dots without batch dims saved) keeps
    the projections' outputs and the layer input; `full` keeps only the layer input.
    """
    tp = tp_degrees(layout)
    a = dtype_bytes(config.dtype)
    e = config.emb_dim / (tp["length"] * tp["embed"])
    hd = config.num_query_heads * config.head_dim / tp["heads"]
    kvd = config.num_kv_heads * config.head_dim / tp["kv_heads"]
    heads, m, s = config.num_query_heads / tp["heads"], config.mlp_dim / tp["mlp"], config.max_target_length
    none = (4 * e + hd + 2 * kvd + hd + 4 * m) * a + heads * s * (4 + a) + s + 2 * 4
    minimal = (hd + 2 * kvd + 2 * m + 3 * e) * a
    full = e * a
    return {"none": none, "minimal": minimal, "full": full}


def layer_split(layout: Layout) -> int:
    """Into how many pieces the mesh splits the layer stack (the `stage` axis under the default rules)."""
    for t in layout.params():
        if "layers" in t.logical:
            return _degree(layout, t.dim_axes("layers"))
    return 1


def gathered_weight_bytes(config: Config, layout: Layout) -> float:
    """FSDP-gathered copies alive at once: two decoder layers' (this and the next), and the top-level weights.

    With pipeline_fsdp_ag_once a pipeline keeps its stage's whole stack gathered through the loop.
    """
    whole_stage = layout.pipeline is not None and config.pipeline_fsdp_ag_once
    total = 0.0
    for t in layout.params():
        batch = layout.weight_batch_axes(t)
        if not any(a in batch and layout.degree(a) > 1 for a in t.axes):
            continue  # nothing to gather
        kept = _degree(layout, [a for dim, axes in zip(t.logical, t.mesh_axes) if dim != "layers"
                                for a in axes if a not in batch])
        # The table is gathered in its own dtype, and so are the stage weights gathered before the pipeline loop.
        size = t.dtype if t.role == "embedding" or (whole_stage and t.layered) else config.dtype
        gathered = t.size / kept * dtype_bytes(size)
        if t.layered:
            gathered = gathered / layer_split(layout) if whole_stage else gathered / config.num_decoder_layers * 2
        total += gathered
    return total


def memory_per_device(config: Config, layout: Layout, tokens_per_microbatch: float) -> dict[str, float]:
    """Peak bytes per device: state, gradients, saved activations and transient buffers.

    tokens_per_microbatch: tokens of one microbatch on one batch shard. `config`
    is the layout's, or a variant of it (verify uses one with float32 activations).
    """
    params = sum(layout.local_bytes(t) for t in layout.params())
    optimizer = sum(layout.local_bytes(t) for t in layout.tensors if t.group != "params")
    gradients = params
    if config.gradient_accumulation_steps > 1:  # float32 accumulators, sharded like the parameters
        gradients += sum(layout.local_bytes(t) / dtype_bytes(t.dtype) * 4 for t in layout.params())
    per_token = activation_bytes_per_token(config, layout)
    pipe = layout.pipeline
    if pipe:  # every iteration keeps its block's activations of one pipeline microbatch, bubble included
        loop_tokens = tokens_per_microbatch * pipe.num_stages  # in the loop every stage sees its shard's rows
        run_tokens = loop_tokens / pipe.num_microbatches
        saved = run_tokens * per_token[config.remat_policy] * pipe.layers_per_block * pipe.num_iterations
        tp = tp_degrees(layout)
        residual = loop_tokens * config.emb_dim / (tp["length"] * tp["embed"]) * dtype_bytes(config.dtype)
        saved += 2 * residual  # stage 0's microbatch buffer and its gradient
    else:
        run_tokens = tokens_per_microbatch
        saved = tokens_per_microbatch * per_token[config.remat_policy] * config.num_decoder_layers / layer_split(layout)
    working = run_tokens * per_token["none"]  # one layer re-run (or kept) in the backward pass
    logits = tokens_per_microbatch * config.vocab_size / tp_degrees(layout)["vocab"] * 4 * 2  # f32 logits, gradient
    activations = saved + working + logits
    gathered = gathered_weight_bytes(config, layout)
    total = params + optimizer + gradients + activations + gathered
    return {"params": params, "gradients": gradients, "optimizer": optimizer, "activations": activations,
            "gathered_weights": gathered, "total": total}
