"""The decoder-only Llama-style transformer: scanned, unrolled or pipelined over its layers.

How the layers are stored is `maxpar.model.stack`'s; whether they are pipelined, and over which
mesh axes, the run layout says (`ModelLayout`, handed in: the model never inspects the mesh).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxpar.core.axes import LOGITS, RESIDUAL, Logical
from maxpar.core.config import ModelConfig
from maxpar.core.layout import ModelLayout
from maxpar.core.sharding import constrain
from maxpar.model.layers import CACHE, Attention, Mlp, ModelModule, RMSNorm
from maxpar.model.fp8 import FP8_META
from maxpar.model.matmul import PROJECTION, matmul
from maxpar.model.mla import MultiHeadLatentAttention
from maxpar.model.moe import MOE_STATS, MoeBlock
from maxpar.model.mtp import MTP, MultiTokenPrediction
from maxpar.model.stack import DENSE, STACKED, layer_stack, num_units, unrolled_name
from maxpar.pipeline.spmd import pipeline

Array = jax.Array

# minimal: the weight projections' outputs (q, k, v, attention output, gate, up, down; the MoE router logits),
# MaxText's `minimal` list; attention scores and elementwise work are recomputed.
REMAT_POLICIES = {
    "minimal": jax.checkpoint_policies.save_only_these_names(PROJECTION),
    "full": jax.checkpoint_policies.nothing_saveable,
}


class DecoderLayer(ModelModule):
    """Pre-norm attention + SwiGLU block (`moe`: a routed MoE block). Returns (x, None) so nn.scan can carry it."""

    moe: bool = False

    @nn.compact
    def __call__(self, x: Array, positions: Array, segment_ids: Array) -> tuple[Array, None]:
        cfg, layout = self.config, self.layout
        x = self.constrain(x, RESIDUAL)
        attention = MultiHeadLatentAttention if cfg.attention_type == "mla" else Attention
        x = x + attention(cfg, layout, name="attention")(
            RMSNorm(cfg, layout, name="pre_attention_norm")(x), positions, segment_ids)
        normed = RMSNorm(cfg, layout, name="pre_mlp_norm")(x)
        if self.moe:
            x = x + MoeBlock(cfg, layout, name="moe")(normed, segment_ids != 0)
        else:
            x = x + Mlp(cfg, layout, name="mlp")(normed)
        return x, None


class DecoderBlock(ModelModule):
    """moe_layer_interval layers, the last one MoE: the repeated unit when MoE layers are interleaved."""

    @nn.compact
    def __call__(self, x: Array, positions: Array, segment_ids: Array) -> tuple[Array, None]:
        interval = self.config.moe_layer_interval
        for i in range(interval):
            x, _ = DecoderLayer(self.config, self.layout, moe=i == interval - 1, name=f"sublayer_{i}")(
                x, positions, segment_ids)
        return x, None


def decoder_unit(config: ModelConfig) -> tuple[type[nn.Module], dict[str, bool]]:
    """(module, its keyword arguments) of the `layers` stack's repeated unit: one layer (dense, or MoE in
    every layer), else a block of moe_layer_interval layers. The dense prefix's unit is a dense DecoderLayer."""
    if config.num_experts > 1 and config.moe_layer_interval > 1:
        return DecoderBlock, {}
    return DecoderLayer, {"moe": config.num_experts > 1}


def rematerialized(cfg: ModelConfig, unit: type[nn.Module]) -> type[nn.Module]:
    """The stack's unit, rematerialized per `remat_policy`. `minimal` saves what is named, so it saves the
    same tensors under the pipeline's vmap over stages (which gives every matmul a batch dimension)."""
    if cfg.remat_policy == "none":
        return unit
    return nn.remat(unit, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=not cfg.scan_layers)


# The model's top-level parameters (`DECODER` holds the layer stacks): named here once, read by the explicit-backward
# pipelines' pieces (`maxpar.model.staged`) and, by their Hugging Face names, the converter's mappings.
TOKEN_EMBEDDING, FINAL_NORM, OUTPUT = "token_embedding", "final_norm", "output"


def token_lookup(table: Array, ids: Array, dtype: Any) -> Array:
    """The embedding rows of `ids` in the compute dtype."""
    return jnp.take(table, ids, axis=0).astype(dtype)


def embed(cfg: ModelConfig, layout: ModelLayout | None, table: Array, ids: Array) -> Array:
    """The model's input: the token lookup, the table's embed shards gathered first where the layout says so
    (`ModelLayout.gather_lookup_table` says why); `Transformer`'s and the explicit-backward pipelines' alike."""
    if layout is None:
        return constrain(token_lookup(table, ids, cfg.dtype), RESIDUAL, (), None)
    table = layout.constrain(table, (Logical.VOCAB, None)) if layout.gather_lookup_table else table
    return layout.constrain(token_lookup(table, ids, cfg.dtype), RESIDUAL)


def dense_prefix(cfg: ModelConfig) -> type[nn.Module]:
    """The scanned stack of the first_num_dense_layers dense layers, which run before the (pipelined) stack."""
    return layer_stack(rematerialized(cfg, DecoderLayer), cfg.first_num_dense_layers,
                       collections=(CACHE, FP8_META), axis=DENSE)


def output_weight(cfg: ModelConfig, params: dict) -> Array:
    """The output projection among the model's top-level `params`: the embedding table when logits_via_embedding."""
    return params[TOKEN_EMBEDDING if cfg.logits_via_embedding else OUTPUT]


def embedding_init(cfg: ModelConfig) -> nn.initializers.Initializer:
    """The token table's initializer. Untied: std 1, so the residual stream starts at unit scale. Tied
    (logits_via_embedding): the table is also the output projection, and the final norm hands it unit-scale
    features, so std 1 gives logits of std sqrt(emb_dim) and a first loss far above ln(vocab) (~200 at
    emb_dim 1024). It gets std 1/sqrt(emb_dim) instead, the fan-in variance of the untied `output`, so tied and
    untied models start at the same logit scale, near ln(vocab). HF's Qwen3/Gemma (std 0.02 for every weight)
    start there too; MaxText divides tied logits by sqrt(emb_dim), which would change imported models' arithmetic.
    The input side needs no unit scale: the first layer's pre-norm rescales it."""
    return nn.initializers.normal(stddev=cfg.emb_dim ** -0.5 if cfg.logits_via_embedding else 1.0)


def output_logits(cfg: ModelConfig, x: Array, out: Array) -> Array:
    """float32 logits of the normed final hidden state: x times the output projection [emb, vocab], or times
    the embedding table [vocab, emb] transposed when logits_via_embedding (also `maxpar.model.staged`'s head)."""
    spec = "ble,ve->blv" if cfg.logits_via_embedding else "ble,ev->blv"
    return matmul(spec, x, out, cfg.dtype, jnp.float32)


class Decoder(ModelModule):
    """The layer stack: `nn.scan` of the repeated unit, or a Python loop; pipelined over the stages when
    the layout has a pipeline schedule (maxpar/pipeline). A dense prefix (first_num_dense_layers) is a stack of
    its own that runs first, outside any pipeline: on every stage's devices, sharded by the outer rules."""

    @nn.compact
    def __call__(self, x: Array, positions: Array, segment_ids: Array) -> Array:
        cfg, layout = self.config, self.layout
        dense, num_dense = rematerialized(cfg, DecoderLayer), cfg.first_num_dense_layers
        if num_dense and cfg.scan_layers:
            x, _ = dense_prefix(cfg)(cfg, layout, name=DENSE)(x, positions, segment_ids)
        elif num_dense:
            for i in range(num_dense):
                x, _ = dense(cfg, layout, name=unrolled_name(i, DENSE))(x, positions, segment_ids)
        unit, kwargs = decoder_unit(cfg)
        layer = rematerialized(cfg, unit)
        if not cfg.scan_layers:
            for i in range(num_units(cfg)):
                x, _ = layer(cfg, layout, name=unrolled_name(i), **kwargs)(x, positions, segment_ids)
            return x
        stack = layer_stack(layer, num_units(cfg), cfg.num_pipeline_repeats, collections=(MOE_STATS, CACHE, FP8_META))
        if layout is None or not layout.pipelined or self.is_initializing():  # creating the parameters: in order
            x, _ = stack(cfg, layout, name=STACKED, **kwargs)(x, positions, segment_ids)
            return x
        block = layer_stack(rematerialized(cfg, unit), layout.pipeline.schedule.layers_per_block,
                            collections=(MOE_STATS, FP8_META))

        def run_block(params, histories, x, positions, segment_ids, layout):  # (x, the block's MoE sums: {} when dense)
            variables = {"params": params, FP8_META: histories} if histories else {"params": params}
            (x, _), stats = block(cfg, layout, **kwargs).apply(
                variables, x, positions, segment_ids, mutable=[MOE_STATS])
            return x, stats.get(MOE_STATS, {})

        histories = self.variables.get(FP8_META, {}).get(STACKED, {})  # fp8_scaling=delayed: read, max-reported
        x, stats = pipeline(run_block, self.variables["params"][STACKED], x, (positions, segment_ids), layout=layout,
                            x_axes=RESIDUAL, side_axes=RESIDUAL[:2], histories=histories)
        if stats:  # blocks [R, S, units per block, ...] -> the stack's units in layer order, as the scan sows them
            self.sow(MOE_STATS, STACKED, jax.tree.map(lambda a: a.reshape(-1, *a.shape[3:]), stats))
        return x


DECODER = "decoder"  # the layer stack's module in the parameter tree


def stacked_layers(params: dict) -> Any:
    """The scanned layer stack's subtree of the model's parameters (what a pipeline splits into stages), or None
    (scan_layers=false)."""
    return params[DECODER].get(STACKED)


class Transformer(ModelModule):
    """tokens [B, L] -> float32 logits [B, L, vocab]; with `mtp_tokens` (training with mtp_num_layers > 0: each
    MTP module's input tokens, maxpar.model.mtp) -> (logits, the modules' logits). Without them the MTP modules
    do not run (sampling, evaluation); initialization creates their parameters."""

    @nn.compact
    def __call__(self, tokens: Array, positions: Array, segment_ids: Array,
                 mtp_tokens: Sequence[Array] | None = None) -> Array | tuple[Array, list[Array]]:
        cfg, layout, wdt = self.config, self.layout, self.weight_dtype
        table = self.param(TOKEN_EMBEDDING, nn.with_logical_partitioning(
            embedding_init(cfg), (Logical.VOCAB, Logical.EMBED)), (cfg.vocab_size, cfg.emb_dim), wdt)
        lookup = partial(embed, cfg, layout, table)
        hidden = Decoder(cfg, layout, name=DECODER)(lookup(tokens), positions, segment_ids)
        x = RMSNorm(cfg, layout, name=FINAL_NORM)(hidden)
        out = table if cfg.logits_via_embedding else self.param(OUTPUT, nn.with_logical_partitioning(
            nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"), (Logical.EMBED, Logical.VOCAB)),
            (cfg.emb_dim, cfg.vocab_size), wdt)

        def head(x: Array) -> Array:
            return self.constrain(output_logits(cfg, x, out), LOGITS)

        logits = head(x)
        if cfg.mtp_num_layers and mtp_tokens is None and self.is_initializing():
            mtp_tokens = (tokens,) * cfg.mtp_num_layers
        if not cfg.mtp_num_layers or mtp_tokens is None:
            return logits
        mtp = MultiTokenPrediction(cfg, layout, layer=rematerialized(cfg, DecoderLayer), moe=cfg.num_experts > 1,
                                   name=MTP)
        return logits, mtp(hidden, mtp_tokens, positions, segment_ids, lookup, head)
