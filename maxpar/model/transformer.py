"""The decoder-only Llama-style transformer, scanned or unrolled over layers."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxpar.config import Config
from maxpar.model.layers import RESIDUAL, Attention, Mlp, RMSNorm, constrain
from maxpar.model.moe import MOE_STATS, MoeBlock

Array = jax.Array

REMAT_POLICIES = {
    "minimal": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "full": jax.checkpoint_policies.nothing_saveable,
}


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU block (`moe`: a routed MoE block). Returns (x, None) so nn.scan can carry it."""

    config: Config
    moe: bool = False

    @nn.compact
    def __call__(self, x: Array, positions: Array, segment_ids: Array) -> tuple[Array, None]:
        x = constrain(x, RESIDUAL)
        x = x + Attention(self.config, name="attention")(
            RMSNorm(self.config, name="pre_attention_norm")(x), positions, segment_ids)
        normed = RMSNorm(self.config, name="pre_mlp_norm")(x)
        if self.moe:
            x = x + MoeBlock(self.config, name="moe")(normed, segment_ids != 0)
        else:
            x = x + Mlp(self.config, name="mlp")(normed)
        return x, None


class DecoderBlock(nn.Module):
    """moe_layer_interval layers, the last one MoE: the repeated unit when MoE layers are interleaved."""

    config: Config

    @nn.compact
    def __call__(self, x: Array, positions: Array, segment_ids: Array) -> tuple[Array, None]:
        interval = self.config.moe_layer_interval
        for i in range(interval):
            x, _ = DecoderLayer(self.config, moe=i == interval - 1, name=f"sublayer_{i}")(x, positions, segment_ids)
        return x, None


def decoder_unit(config: Config) -> tuple[type[nn.Module], int, dict[str, bool]]:
    """(module, repeats, its keyword arguments) of the layer stack's repeated unit.

    One layer (dense, or MoE in every layer), else a block of moe_layer_interval
    layers. The unit is what `layers` stacks (scanned) or numbers (layers_i).
    """
    if config.num_experts > 1 and config.moe_layer_interval > 1:
        return DecoderBlock, config.num_decoder_layers // config.moe_layer_interval, {}
    return DecoderLayer, config.num_decoder_layers, {"moe": config.num_experts > 1}


class Decoder(nn.Module):
    """The layer stack: `nn.scan` of the repeated unit with a stacked `layers` axis, or a Python loop."""

    config: Config

    @nn.compact
    def __call__(self, x: Array, positions: Array, segment_ids: Array) -> Array:
        cfg = self.config
        layer, repeats, kwargs = decoder_unit(cfg)
        if cfg.remat_policy != "none":
            layer = nn.remat(layer, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            stack = nn.scan(layer, variable_axes={"params": 0, MOE_STATS: 0}, split_rngs={"params": True},
                            in_axes=(nn.broadcast, nn.broadcast), length=repeats,
                            metadata_params={nn.PARTITION_NAME: "layers"})
            x, _ = stack(cfg, name="layers", **kwargs)(x, positions, segment_ids)
        else:
            for i in range(repeats):
                x, _ = layer(cfg, name=f"layers_{i}", **kwargs)(x, positions, segment_ids)
        return x


class Transformer(nn.Module):
    """tokens [B, L] -> float32 logits [B, L, vocab]."""

    config: Config

    @nn.compact
    def __call__(self, tokens: Array, positions: Array, segment_ids: Array) -> Array:
        cfg = self.config
        wdt, dt = jnp.dtype(cfg.weight_dtype), jnp.dtype(cfg.dtype)
        table = self.param("token_embedding", nn.with_logical_partitioning(
            nn.initializers.normal(stddev=1.0), ("vocab", "embed")), (cfg.vocab_size, cfg.emb_dim), wdt)
        # Gather the table's embed shards first so the lookup lands batch-sharded, not embed-sharded.
        lookup_table = nn.with_logical_constraint(table, ("vocab", None))
        x = constrain(jnp.take(lookup_table, tokens, axis=0).astype(dt), RESIDUAL)
        x = Decoder(cfg, name="decoder")(x, positions, segment_ids)
        x = RMSNorm(cfg, name="final_norm")(x)
        if cfg.logits_via_embedding:
            logits = jnp.einsum("ble,ve->blv", x, table.astype(dt), preferred_element_type=jnp.float32)
        else:
            out = self.param("output", nn.with_logical_partitioning(
                nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"), ("embed", "vocab")),
                (cfg.emb_dim, cfg.vocab_size), wdt)
            logits = jnp.einsum("ble,ev->blv", x, out.astype(dt), preferred_element_type=jnp.float32)
        return constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))
