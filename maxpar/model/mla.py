"""Multi-head latent attention (DeepSeek-V2/V3, `attention_type: mla`).

Keys and values come from one compressed latent per token: wkv_a x = [latent (kv_lora_rank) | k_rope
(qk_rope_head_dim)], the latent RMSNorm'd and expanded per head by wkv_b into [k_nope | v]. Position enters
only through the rope parts: q's per head and k_rope, which all heads share. What a token leaves in the
KV cache is therefore its latent and k_rope, not per-head keys and values.

The rotation is the half-split one of `apply_rope`. Hugging Face's DeepSeek-V3 with `rope_interleave` (its
default) reads the rope features as interleaved pairs (x0, x1), (x2, x3), ... and writes them half-split; its
result equals `apply_rope` on the features reordered evens-then-odds. A converter therefore permutes, within
each head's rope block of q's weight and within the rope block of wkv_a's output, the columns [0, 2, 4, ...,
1, 3, 5, ...]; without `rope_interleave` nothing is permuted.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxpar.core.axes import ATTN_KV, ATTN_Q, RESIDUAL, Logical
from maxpar.core.config import ModelConfig
from maxpar.model.attention import attend, cached_attention
from maxpar.model.layers import CACHE, ModelModule, RMSNorm, apply_rope, kernel, yarn_mscale

Array = jax.Array
LATENT_CACHE = (Logical.BATCH, Logical.ATTN_LENGTH, None)  # the cached latent and k_rope, [B, S, width]


def softmax_scale(config: ModelConfig) -> float:
    """(qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn scaling with mscale_all_dim set
    (DeepSeek-V3): the longer context's sharper softmax."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling
    if scaling is not None and scaling.kind == "yarn" and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


class MultiHeadLatentAttention(ModelModule):
    """Causal MLA with decoupled RoPE; the core per `config.attention` (dot_product or blockwise)."""

    @nn.compact
    def __call__(self, x: Array, positions: Array, segment_ids: Array) -> Array:
        cfg = self.config
        e, h, rank = cfg.emb_dim, cfg.num_query_heads, cfg.kv_lora_rank
        nope, rope, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        w_kv_a = kernel(self, "key_value_a", (e, rank + rope), (Logical.EMBED, Logical.LORA), (0,))
        w_kv_b = kernel(self, "key_value_b", (rank, h, nope + dv), (Logical.LORA, Logical.HEADS, Logical.HEAD_DIM),
                        (0,))
        w_out = kernel(self, "out", (h, dv, e), (Logical.HEADS, Logical.HEAD_DIM, Logical.EMBED), (0, 1))

        positions, segment_ids = self.constrain(positions, ATTN_Q[:2]), self.constrain(segment_ids, ATTN_Q[:2])
        q = self.constrain(self._query(x), ATTN_Q)
        compressed = self.project("ble,ec->blc", x, w_kv_a, "key_value_a")
        latent = RMSNorm(cfg, self.layout, axis=Logical.LORA, name="key_value_a_norm")(compressed[..., :rank])
        k_rope = apply_rope(compressed[..., None, rank:], positions, cfg.rope_theta, cfg.rope_scaling)[:, :, 0]
        q_rope = apply_rope(q[..., nope:], positions, cfg.rope_theta, cfg.rope_scaling)
        q = jnp.concatenate([q[..., :nope], q_rope], axis=-1) * jnp.asarray(softmax_scale(cfg), self.dtype)

        if self.is_mutable_collection(CACHE) and not self.is_initializing():
            latent, k_rope = self._cache(latent, k_rope, positions)
            k, v = self._keys_values(latent, k_rope, w_kv_b)
            out = cached_attention(q, k, v, positions, cfg.sliding_window)
        else:
            k, v = self._keys_values(latent, k_rope, w_kv_b)
            choice = "dot_product" if self.is_initializing() else cfg.attention
            context = self.layout.context if self.layout else None
            out = attend(q, k, v, segment_ids, choice, cfg.sliding_window, cfg, context)
        out = self.constrain(out, ATTN_Q)
        return self.constrain(self.project("blhd,hde->ble", out, w_out, "out"), RESIDUAL)

    def _query(self, x: Array) -> Array:
        """[B, L, H, qk_nope + qk_rope]: projected directly (q_lora_rank 0) or through the RMSNorm'd low rank."""
        cfg = self.config
        e, h, qk = cfg.emb_dim, cfg.num_query_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if not cfg.q_lora_rank:
            w_q = kernel(self, "query", (e, h, qk), (Logical.EMBED, Logical.HEADS, Logical.HEAD_DIM), (0,))
            return self.project("ble,ehd->blhd", x, w_q, "query")
        w_q_a = kernel(self, "query_a", (e, cfg.q_lora_rank), (Logical.EMBED, Logical.LORA), (0,))
        w_q_b = kernel(self, "query_b", (cfg.q_lora_rank, h, qk), (Logical.LORA, Logical.HEADS, Logical.HEAD_DIM),
                       (0,))
        low = RMSNorm(self.config, self.layout, axis=Logical.LORA, name="query_a_norm")(
            self.project("ble,er->blr", x, w_q_a, "query_a"))
        return self.project("blr,rhd->blhd", low, w_q_b, "query_b")

    def _keys_values(self, latent: Array, k_rope: Array, w_kv_b: Array) -> tuple[Array, Array]:
        """Per-head k [B, S, H, qk_nope + qk_rope] (k_rope shared by every head) and v [B, S, H, v_head_dim]."""
        nope = self.config.qk_nope_head_dim
        kv = self.project("blr,rhd->blhd", latent, w_kv_b, "key_value_b")
        k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (*kv.shape[:3], k_rope.shape[-1])).astype(kv.dtype)
        k = self.constrain(jnp.concatenate([kv[..., :nope], k_rope], axis=-1), ATTN_KV)
        return k, self.constrain(kv[..., nope:], ATTN_KV)

    def _cache(self, latent: Array, k_rope: Array, positions: Array) -> tuple[Array, Array]:
        """Decoding: write this call's latent [B, L, kv_lora_rank] and k_rope [B, L, qk_rope_head_dim] at each row's
        positions into the layer's cache [B, max_target_length, ...]; return the whole cache."""
        b, length = latent.shape[0], self.config.max_target_length
        latent_cache = self.variable(CACHE, "latent", jnp.zeros, (b, length, latent.shape[-1]), latent.dtype)
        rope_cache = self.variable(CACHE, "key_rope", jnp.zeros, (b, length, k_rope.shape[-1]), k_rope.dtype)
        write = jax.vmap(lambda cache, new, start: jax.lax.dynamic_update_slice(cache, new, (start, 0)))
        latent_cache.value = self.constrain(write(latent_cache.value, latent, positions[:, 0]), LATENT_CACHE)
        rope_cache.value = self.constrain(write(rope_cache.value, k_rope, positions[:, 0]), LATENT_CACHE)
        return latent_cache.value, rope_cache.value
