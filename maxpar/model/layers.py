"""Building blocks of a Llama-style decoder: RMSNorm, RoPE, GQA attention, SwiGLU.

Weights carry logical axis names (`nn.with_logical_partitioning`) and
activations logical constraints; no physical mesh axis appears here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxpar.core.axes import ATTN_KV, ATTN_Q, MLP_HIDDEN, MLP_IO, RESIDUAL, Logical
from maxpar.core.config import ModelConfig, RopeScaling
from maxpar.core.layout import ModelLayout
from maxpar.core.sharding import constrain
from maxpar.model.activations import swiglu
from maxpar.model.attention import attend, cached_attention
from maxpar.model import fp8, lora
from maxpar.model.matmul import project

Array = jax.Array
CACHE = "cache"  # the KV-cache collection: decoding applies the model with it mutable (maxpar.generate)
# The feed-forward hidden layer (MLP_HIDDEN) has its own length name: under TP-sequence the residual stream is
# split on sequence, but the hidden [batch, length, mlp] stays split on mlp like its weights (all-gather in,
# reduce-scatter out).


class ModelModule(nn.Module):
    """A module of the model: the model's keys of the run's config (`maxpar.core.config.model_config`), the
    layout it runs under (None: one device, no mesh), and the dtypes it computes in (`dtype`) and stores its
    parameters in (`weight_dtype`)."""

    config: ModelConfig
    layout: ModelLayout | None = None

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.config.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.config.weight_dtype)

    def constrain(self, x: Array, logical: Sequence[str | None]) -> Array:
        """`x` constrained to these logical axes by the layout's rules over its mesh; no layout (one device, no
        mesh): the names are still checked, `x` stays as it is."""
        return self.layout.constrain(x, logical) if self.layout else constrain(x, logical, (), None)

    def project(self, spec: str, x: Array, w: Array, name: str) -> Array:
        """The weight projection `spec` of x and the module's weight `name`, in `dtype` and `quantization`; under
        fp8_scaling=delayed its scales come from the weight's amax history (`amax_history`). An fp8 projection
        merges x's batch and length into one GEMM dim unless the layout splits the sequence (Einsum.merge_rows). A
        weight of a role lora_target_roles names adds its LoRA adapter's output (maxpar.model.lora), in dtype: with
        quantization=fp8 the frozen base weight's product is the fp8 GEMM, the adapter's is not."""
        y = project(spec, x, w, self.dtype, quantization=self.config.quantization, history=amax_history(self, name),
                    merge_rows=not (self.layout is not None and self.layout.splits_sequence))
        return lora.adapted_projection(self, spec, x, w, name, y)


def amax_history(module: nn.Module, name: str, experts: int = 0) -> Array | None:
    """The fp8 amax history [OPERANDS, fp8_amax_history_length] of the module's projection `name` (created
    empty at init, in the FP8_META collection), or None: no delayed scaling, or applied without the collection
    (evaluation, sampling), where current scaling needs no history. `experts` > 0: one per expert
    [experts, OPERANDS, length], on the `exp` logical axis (maxpar.model.fp8's per-expert scaling)."""
    config = module.config
    if config.quantization != "fp8" or config.fp8_scaling != "delayed":
        return None
    if not module.is_initializing() and not module.has_variable(fp8.FP8_META, name):
        return None
    shape = (len(fp8.OPERANDS), config.fp8_amax_history_length)
    if not experts:
        return module.variable(fp8.FP8_META, name, jnp.zeros, shape, jnp.float32).value
    per_expert = nn.with_logical_partitioning(jnp.zeros, (Logical.EXP, None, None))
    return module.variable(fp8.FP8_META, name, per_expert, (experts, *shape), jnp.float32).value


def kernel(module: ModelModule, name: str, shape: Sequence[int], axes: Sequence[str],
           fan_in_axes: Sequence[int], dtype: jnp.dtype | None = None) -> Array:
    """A matmul weight with fan-in-scaled truncated-normal init and logical axes, in weight_dtype unless `dtype`."""
    fan_out_axes = tuple(i for i in range(len(shape)) if i not in tuple(fan_in_axes))
    init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                            in_axis=tuple(fan_in_axes), out_axis=fan_out_axes)
    return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape),
                        dtype or module.weight_dtype)


class RMSNorm(ModelModule):
    """Root-mean-square norm over the last dim, computed in float32. `axis` names the scale's logical axis: the
    residual's norms use `norm`, Qwen3's per-head q/k norms `head_dim` (maxpar/model/roles.py)."""

    axis: str = Logical.NORM

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis,)),
                           (x.shape[-1],), self.weight_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.normalization_layer_epsilon)
        return (normed * scale.astype(jnp.float32)).astype(cfg.dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction of attention for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What yarn multiplies the rotated features by (both q's and k's, so their product by its square); 1 else."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def yarn_inv_freq(half: int, theta: float, scaling: RopeScaling) -> Array:
    """[half] YaRN inverse frequencies: pairs that turn more than beta_fast times over the original context keep
    their frequency, those turning fewer than beta_slow times are divided by `factor`, a linear ramp between (the
    bounds rounded outwards to whole pairs, as DeepSeek-V3 and Hugging Face do)."""
    dim = 2 * half
    original = scaling.original_max_position_embeddings

    def pair_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(pair_of(scaling.beta_fast)), 0), min(math.ceil(pair_of(scaling.beta_slow)), dim - 1)
    ramp = jnp.clip((jnp.arange(half, dtype=jnp.float32) - low) / ((high - low) or 0.001), 0, 1)
    pos_freqs = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    keep = 1 - ramp
    return 1.0 / (scaling.factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def rope_inv_freq(half: int, theta: float, scaling: RopeScaling | None = None) -> Array:
    """[half] float32 inverse frequencies of the rotary pairs; with `scaling` (Llama 3.1+'s `llama3` type)
    the long wavelengths are stretched by `factor` so the model reaches past the context it was pretrained on
    (`yarn`: `yarn_inv_freq`).

    Wavelengths shorter than original/high_freq_factor keep their frequency, those longer than
    original/low_freq_factor are divided by `factor`, and the band between interpolates smoothly.
    """
    if scaling is not None and scaling.kind == "yarn":
        return yarn_inv_freq(half, theta, scaling)
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling[:4]
    wavelen = 2 * jnp.pi / inv_freq
    scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(x: Array, positions: Array, theta: float, scaling: RopeScaling | None = None) -> Array:
    """Rotary embedding in the half-split convention: x [B, L, H, D], positions [B, L]; yarn scales the result
    by its attention factor."""
    half = x.shape[-1] // 2
    angle = positions.astype(jnp.float32)[:, :, None, None] * rope_inv_freq(half, theta, scaling)
    factor = rope_attention_factor(scaling)
    sin, cos = jnp.sin(angle) * factor, jnp.cos(angle) * factor
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(ModelModule):
    """Causal grouped-query attention with RoPE; softmax in float32; the core per `config.attention`."""

    @nn.compact
    def __call__(self, x: Array, positions: Array, segment_ids: Array) -> Array:
        cfg, dt = self.config, self.dtype
        e, h, kv, d = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
        wq = kernel(self, "query", (e, h, d), (Logical.EMBED, Logical.HEADS, Logical.HEAD_DIM), (0,))
        wk = kernel(self, "key", (e, kv, d), (Logical.EMBED, Logical.KV_HEADS, Logical.HEAD_DIM), (0,))
        wv = kernel(self, "value", (e, kv, d), (Logical.EMBED, Logical.KV_HEADS, Logical.HEAD_DIM), (0,))
        wo = kernel(self, "out", (h, d, e), (Logical.HEADS, Logical.HEAD_DIM, Logical.EMBED), (0, 1))

        # Positions and segment ids follow q's length sharding: under TP-sequence the [B, L] inputs are
        # gathered once (int32) rather than their rotary sin/cos and mask (float, per use) by the partitioner.
        positions, segment_ids = self.constrain(positions, ATTN_Q[:2]), self.constrain(segment_ids, ATTN_Q[:2])
        q = self.constrain(self.project("ble,ehd->blhd", x, wq, "query"), ATTN_Q)
        k = self.constrain(self.project("ble,ehd->blhd", x, wk, "key"), ATTN_KV)
        v = self.constrain(self.project("ble,ehd->blhd", x, wv, "value"), ATTN_KV)
        if cfg.qk_norm:  # Qwen3: each head's q and k normalized over head_dim, before the rotation
            q = RMSNorm(cfg, self.layout, axis=Logical.HEAD_DIM, name="query_norm")(q)
            k = RMSNorm(cfg, self.layout, axis=Logical.HEAD_DIM, name="key_norm")(k)
        q = apply_rope(q, positions, cfg.rope_theta, cfg.rope_scaling) * jnp.asarray(d ** -0.5, dt)
        k = apply_rope(k, positions, cfg.rope_theta, cfg.rope_scaling)

        if self.is_mutable_collection(CACHE) and not self.is_initializing():
            out = self.constrain(self._attend_cached(q, k, v, positions), ATTN_Q)
            return self.constrain(self.project("blhd,hde->ble", out, wo, "out"), RESIDUAL)
        # Init only needs shapes: the portable core keeps it (and the planner's abstract init) off the GPU.
        choice = "dot_product" if self.is_initializing() else cfg.attention
        context = self.layout.context if self.layout else None
        out = self.constrain(attend(q, k, v, segment_ids, choice, cfg.sliding_window, cfg, context), ATTN_Q)
        return self.constrain(self.project("blhd,hde->ble", out, wo, "out"), RESIDUAL)


    def _attend_cached(self, q: Array, k: Array, v: Array, positions: Array) -> Array:
        """Decoding (the `cache` collection is mutable): write this call's k/v into the layer's KV cache
        [B, max_target_length, KV, D] at each row's positions (contiguous per row: a prompt, or one new token),
        then attend over the cache. Sharded by the same logical rules as k/v."""
        b, _, kv, d = k.shape
        shape = (b, self.config.max_target_length, kv, d)
        k_cache = self.variable(CACHE, "key", jnp.zeros, shape, k.dtype)
        v_cache = self.variable(CACHE, "value", jnp.zeros, shape, v.dtype)
        write = jax.vmap(lambda cache, new, start: jax.lax.dynamic_update_slice(cache, new, (start, 0, 0)))
        k_cache.value = self.constrain(write(k_cache.value, k, positions[:, 0]), ATTN_KV)
        v_cache.value = self.constrain(write(v_cache.value, v, positions[:, 0]), ATTN_KV)
        return cached_attention(q, k_cache.value, v_cache.value, positions, self.config.sliding_window)


class Mlp(ModelModule):
    """SwiGLU feed-forward: silu(x W_gate) * (x W_up) W_down; `width` 0 = mlp_dim (the MoE's shared experts
    set their own)."""

    width: int = 0

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        e, m = cfg.emb_dim, self.width or cfg.mlp_dim
        # `mlp_embed`: the feed-forward weights' embed dim has its own name, so that a preset can shard it
        # apart from the other weights' (TP-transpose, configs/tp_transpose.yml); by default it follows `embed`.
        w_gate = kernel(self, "wi_gate", (e, m), (Logical.MLP_EMBED, Logical.MLP), (0,))
        w_up = kernel(self, "wi_up", (e, m), (Logical.MLP_EMBED, Logical.MLP), (0,))
        w_down = kernel(self, "wo", (m, e), (Logical.MLP, Logical.MLP_EMBED), (0,))
        x = self.constrain(x, MLP_IO)
        gate = self.constrain(self.project("ble,em->blm", x, w_gate, "wi_gate"), MLP_HIDDEN)
        up = self.constrain(self.project("ble,em->blm", x, w_up, "wi_up"), MLP_HIDDEN)
        down = self.project("blm,me->ble", swiglu(gate, up), w_down, "wo")
        return self.constrain(self.constrain(down, MLP_IO), RESIDUAL)
