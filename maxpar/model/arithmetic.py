"""The model's arithmetic: the parameters a token's matmuls use, the FLOPs of a training token, the parameter counts
of a parameter tree. One description, beside the model it counts (its roles: `maxpar.model.roles`), read by the
metrics (MFU), the planner and the benchmarks."""

from __future__ import annotations

import math
from typing import Any

import jax

from maxpar.core.config import Config
from maxpar.model.mtp import MTP
from maxpar.model.roles import Block, ParamRole, param_role, path_keys


def matmul_params(config: Config) -> int:
    """Weights that take part in a matmul per token (the output projection included, even if tied).

    Active parameters only: a mixture-of-experts layer counts its router, the
    num_experts_per_tok experts a token is routed to and its shared experts, not the others.
    Each multi-token prediction module adds its projection [2 emb, emb], one layer like the last (MoE when the
    model has experts) and the output projection.
    """
    e = config.emb_dim
    attention = attention_matmul_params(config)
    mlp = 3 * e * config.mlp_dim
    expert = 3 * e * (config.moe_mlp_dim or config.mlp_dim)  # routed and shared experts alike
    moe = (config.num_experts_per_tok + config.num_shared_experts) * expert + e * config.num_experts
    moe_layers = config.num_moe_layers
    mtp = 2 * e * e + attention + (moe if config.num_experts > 1 else mlp) + e * config.vocab_size
    return (config.num_decoder_layers * attention + (config.num_decoder_layers - moe_layers) * mlp
            + moe_layers * moe + e * config.vocab_size + config.mtp_num_layers * mtp)


def attention_matmul_params(config: Config) -> int:
    """One layer's attention projection weights: GQA's q, k, v and out; MLA's (maxpar/model/mla.py) q (direct or
    through its low rank), kv_a, kv_b and out."""
    e, h = config.emb_dim, config.num_query_heads
    if config.attention_type != "mla":
        return e * config.head_dim * (2 * h + 2 * config.num_kv_heads)
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    query = config.q_lora_rank * (e + h * qk) if config.q_lora_rank else e * h * qk
    return (query + e * (config.kv_lora_rank + config.qk_rope_head_dim)
            + config.kv_lora_rank * h * (config.qk_nope_head_dim + config.v_head_dim) + h * config.v_head_dim * e)


def attention_head_widths(config: Config) -> tuple[int, int]:
    """(q/k width, v width) of one head: head_dim twice, or MLA's qk_nope + qk_rope and v_head_dim."""
    if config.attention_type == "mla":
        return config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    return config.head_dim, config.head_dim


def attended_keys_per_query(config: Config) -> float:
    """Keys a query attends to on average: seq/2 for causal attention (the lower triangle); with a
    sliding window w < seq, w - w^2 / (2 seq) (the triangle's band of width w)."""
    seq, window = config.max_target_length, config.sliding_window
    if window <= 0 or window >= seq:
        return seq / 2
    return window - window * window / (2 * seq)


def training_flops_per_token(config: Config) -> float:
    """Forward + backward FLOPs per token: 6 * matmul params + causal attention.

    Attention scores (QK^T) and the weighted sum (PV) cost 2 * (q/k width + v width) FLOPs per
    query head per attended key. Causal attention is counted once: with seq/2 keys per query
    this is half of PaLM's 12*L*H*D*T term (less with a sliding window).
    Backward is twice forward, hence the factor 3 on both terms.
    """
    widths = sum(attention_head_widths(config))
    per_layer_attention = 2 * attended_keys_per_query(config) * config.num_query_heads * widths
    layers = config.num_decoder_layers + config.mtp_num_layers  # each MTP module attends like a layer
    return 6 * matmul_params(config) + 3 * layers * per_layer_attention


def parameter_counts(abstract_params: Any, experts_per_token: int = 1) -> dict[str, int]:
    """Total, embedding and active parameter counts of an (abstract) parameter tree.

    Active: what one token uses; of each MoE layer's experts only
    `experts_per_token` count (all of a dense model's parameters are active). `mtp` and `mtp_active`: the part of
    total and active in the multi-token prediction modules, which published model sizes leave out.
    """
    total, embedding, inactive, mtp, mtp_inactive = 0, 0, 0, 0, 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params):
        size = math.prod(leaf.shape)
        keys = path_keys(path)
        in_mtp = MTP in keys
        total += size
        mtp += size if in_mtp else 0
        role = param_role(keys)
        if role is ParamRole.EMBEDDING:
            embedding += size
        if role is not None and role.block is Block.EXPERTS:  # [..., experts, in, out]
            experts = leaf.shape[-3]
            unused = size // experts * (experts - experts_per_token)
            inactive += unused
            mtp_inactive += unused if in_mtp else 0
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding, "active": total - inactive,
            "mtp": mtp, "mtp_active": mtp - mtp_inactive}
