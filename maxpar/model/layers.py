"""Building blocks of a Llama-style decoder: RMSNorm, RoPE, GQA attention, SwiGLU.

Weights carry logical axis names (`nn.with_logical_partitioning`) and
activations logical constraints; no physical mesh axis appears here.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxpar.config import Config
from maxpar.model.attention import ATTN_KV, ATTN_Q, attend

Array = jax.Array

# Logical axes of activations (attention's ATTN_Q and ATTN_KV live beside its kernels).
RESIDUAL = ("activation_batch", "activation_length", "activation_embed")
# The feed-forward hidden layer has its own length name: under TP-sequence the residual stream is split on
# sequence, but the hidden [batch, length, mlp] stays split on mlp like its weights (all-gather in, reduce-scatter out).
MLP_HIDDEN = ("activation_batch", "activation_mlp_length", "activation_mlp")


def constrain(x: Array, logical_axes: Sequence[str]) -> Array:
    return nn.with_logical_constraint(x, tuple(logical_axes))


def kernel(module: nn.Module, name: str, shape: Sequence[int], axes: Sequence[str],
           fan_in_axes: Sequence[int], weight_dtype: jnp.dtype) -> Array:
    """A matmul weight with fan-in-scaled truncated-normal init and logical axes."""
    fan_out_axes = tuple(i for i in range(len(shape)) if i not in tuple(fan_in_axes))
    init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                            in_axis=tuple(fan_in_axes), out_axis=fan_out_axes)
    return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), weight_dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32."""

    config: Config

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                           (x.shape[-1],), jnp.dtype(cfg.weight_dtype))
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.normalization_layer_epsilon)
        return (normed * scale.astype(jnp.float32)).astype(cfg.dtype)


def apply_rope(x: Array, positions: Array, theta: float) -> Array:
    """Rotary embedding in the half-split convention: x [B, L, H, D], positions [B, L]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, :, None, None] * inv_freq
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE; softmax in float32; the core per `config.attention`."""

    config: Config

    @nn.compact
    def __call__(self, x: Array, positions: Array, segment_ids: Array) -> Array:
        cfg = self.config
        wdt, dt = jnp.dtype(cfg.weight_dtype), jnp.dtype(cfg.dtype)
        e, h, kv, d = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
        wq = kernel(self, "query", (e, h, d), ("embed", "heads", "head_dim"), (0,), wdt)
        wk = kernel(self, "key", (e, kv, d), ("embed", "kv_heads", "head_dim"), (0,), wdt)
        wv = kernel(self, "value", (e, kv, d), ("embed", "kv_heads", "head_dim"), (0,), wdt)
        wo = kernel(self, "out", (h, d, e), ("heads", "head_dim", "embed"), (0, 1), wdt)

        # Positions and segment ids follow q's length sharding: under TP-sequence the [B, L] inputs are
        # gathered once (int32) rather than their rotary sin/cos and mask (float, per use) by the partitioner.
        positions, segment_ids = constrain(positions, ATTN_Q[:2]), constrain(segment_ids, ATTN_Q[:2])
        q = constrain(jnp.einsum("ble,ehd->blhd", x, wq.astype(dt)), ATTN_Q)
        k = constrain(jnp.einsum("ble,ehd->blhd", x, wk.astype(dt)), ATTN_KV)
        v = constrain(jnp.einsum("ble,ehd->blhd", x, wv.astype(dt)), ATTN_KV)
        q = apply_rope(q, positions, cfg.rope_theta) * jnp.asarray(d ** -0.5, dt)
        k = apply_rope(k, positions, cfg.rope_theta)

        # Init only needs shapes: the portable core keeps it (and the planner's abstract init) off the GPU.
        choice = "dot_product" if self.is_initializing() else cfg.attention
        out = constrain(attend(q, k, v, segment_ids, choice, cfg.sliding_window, cfg), ATTN_Q)
        return constrain(jnp.einsum("blhd,hde->ble", out, wo.astype(dt)), RESIDUAL)


class Mlp(nn.Module):
    """SwiGLU feed-forward: silu(x W_gate) * (x W_up) W_down."""

    config: Config

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        wdt, dt = jnp.dtype(cfg.weight_dtype), jnp.dtype(cfg.dtype)
        e, m = cfg.emb_dim, cfg.mlp_dim
        w_gate = kernel(self, "wi_gate", (e, m), ("embed", "mlp"), (0,), wdt)
        w_up = kernel(self, "wi_up", (e, m), ("embed", "mlp"), (0,), wdt)
        w_down = kernel(self, "wo", (m, e), ("mlp", "embed"), (0,), wdt)
        gate = constrain(x @ w_gate.astype(dt), MLP_HIDDEN)
        up = constrain(x @ w_up.astype(dt), MLP_HIDDEN)
        return constrain((nn.silu(gate) * up) @ w_down.astype(dt), RESIDUAL)
