"""The decoder-only Llama-style transformer, scanned or unrolled over layers."""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxpar.config import Config
from maxpar.model.layers import RESIDUAL, Attention, Mlp, RMSNorm, constrain
from maxpar.model.moe import MOE_STATS, MoeBlock
from maxpar.pipeline.layout import REPEATS, STAGED, merge_repeats, resolve_schedule, split_repeats
from maxpar.pipeline.spmd import pipeline, through_stage_vmap

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


def _boxed(fn):
    """Apply an array function to a leaf, or to the value of a logically partitioned (boxed) leaf."""
    def apply(leaf, names):
        if isinstance(leaf, nn.LogicallyPartitioned):
            return leaf.replace(value=fn(leaf.value), names=names(tuple(leaf.names)))
        return fn(leaf)
    return apply


def _split_repeats(repeats: int, tree):
    leaf = _boxed(lambda x: split_repeats(x, repeats))
    return jax.tree.map(lambda x: leaf(x, lambda names: (REPEATS, *names)), tree,
                        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def _merge_repeats(tree):
    leaf = _boxed(merge_repeats)
    return jax.tree.map(lambda x: leaf(x, lambda names: names[1:]), tree,
                        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def layer_stack(unit: type[nn.Module], length: int, repeats: int = 1) -> type[nn.Module]:
    """`unit` scanned over a stacked `layers` axis of `length`.

    With repeats > 1 (a circular pipeline) the parameters are stored [R, length / R, ...] with a
    leading `pipeline_repeats` axis, so that the stages can split the second axis; the scan sees
    them reshaped to [length, ...]. Layer r * length/R + i sits at [r, i]: the same initial values
    as the canonical stack, and merging the two axes gives the canonical layout back.
    """
    stack = nn.scan(unit, variable_axes={"params": 0, MOE_STATS: 0}, split_rngs={"params": True},
                    in_axes=(nn.broadcast, nn.broadcast), length=length,
                    metadata_params={nn.PARTITION_NAME: STAGED})
    if repeats == 1:
        return stack
    return nn.map_variables(stack, "params", trans_in_fn=_merge_repeats, trans_out_fn=partial(_split_repeats, repeats),
                            init=True, mutable=True)


def _rematerialized(cfg: Config, unit: type[nn.Module], under_stage_vmap: bool = False) -> type[nn.Module]:
    """The stack's unit, rematerialized per `remat_policy` (as the pipeline's vmap over stages sees it)."""
    if cfg.remat_policy == "none":
        return unit
    policy = REMAT_POLICIES[cfg.remat_policy]
    return nn.remat(unit, policy=through_stage_vmap(policy) if under_stage_vmap else policy,
                    prevent_cse=not cfg.scan_layers)


class Decoder(nn.Module):
    """The layer stack: `nn.scan` of the repeated unit with a stacked `layers` axis, or a Python loop;
    pipelined over the `stage` mesh axis when the mesh in context has more than one stage (maxpar/pipeline)."""

    config: Config

    @nn.compact
    def __call__(self, x: Array, positions: Array, segment_ids: Array) -> Array:
        cfg = self.config
        unit, count, kwargs = decoder_unit(cfg)
        layer = _rematerialized(cfg, unit)
        if not cfg.scan_layers:
            for i in range(count):
                x, _ = layer(cfg, name=f"layers_{i}", **kwargs)(x, positions, segment_ids)
            return x
        stack = layer_stack(layer, count, cfg.num_pipeline_repeats)
        rules = nn.get_logical_axis_rules()
        schedule = resolve_schedule(cfg, jax.sharding.get_abstract_mesh().shape, rules)
        if schedule is None or self.is_initializing():  # one stage, or creating the parameters: in order
            x, _ = stack(cfg, name="layers", **kwargs)(x, positions, segment_ids)
            return x
        block = layer_stack(_rematerialized(cfg, unit, under_stage_vmap=True), schedule.layers_per_block)

        def run_block(params, x, positions, segment_ids):  # (x, the block's MoE sums: {} when dense)
            (x, _), stats = block(cfg, **kwargs).apply({"params": params}, x, positions, segment_ids,
                                                       mutable=[MOE_STATS])
            return x, stats.get(MOE_STATS, {})

        abstract = jax.eval_shape(stack(cfg, **kwargs).init, jax.random.key(0), x, positions, segment_ids)
        x, stats = pipeline(run_block, self.variables["params"]["layers"], nn.get_partition_spec(abstract)["params"],
                            x, (positions, segment_ids), schedule=schedule, rules=rules, x_axes=RESIDUAL,
                            side_axes=RESIDUAL[:2], gather_once=cfg.pipeline_fsdp_ag_once,
                            gather_per_repeat=cfg.pipeline_fsdp_ag_per_repeat)
        if stats:  # blocks [R, S, units per block, ...] -> the stack's units in layer order, as the scan sows them
            self.sow(MOE_STATS, "layers", jax.tree.map(lambda a: a.reshape(-1, *a.shape[3:]), stats))
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
