"""The mixture-of-experts feed-forward block (Mixtral-style) and its per-step statistics.

Parameters (a contract: the Hugging Face Mixtral and DeepSeek-V3 converters map onto these):
`router` [emb, experts] (float32), `wi_gate` and `wi_up` [experts, emb, mlp], `wo`
[experts, mlp, emb] (mlp = moe_mlp_dim); the expert weights carry the logical axis
`exp` on their leading dim (the rules map it to the `expert` mesh axis). With
num_shared_experts, `shared_experts` is a dense SwiGLU (`maxpar.model.layers.Mlp`,
TP-sharded as the MLP is). With routed_bias, `routing_bias` [experts] (float32,
replicated) shifts the top-k choice; the forward reads it under stop_gradient and
the train step, not the optimizer, moves it (`routing_bias_update`).

Each MoE layer sows its load-balancing loss and drop counts into the
`moe_stats` collection; `moe_totals` sums them over the layers for the loss and
the metrics, whatever the layer layout (scanned, unrolled, blocks).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxpar.core.axes import RESIDUAL, Logical
from maxpar.model import lora
from maxpar.model.context_parallel import sequence_layout
from maxpar.model.layers import Mlp, ModelModule, amax_history, kernel
from maxpar.model.matmul import PROJECTION
from maxpar.model.moe_dispatch import capacity_local, dropless_local, expert_parallel, on_token_shards
from maxpar.model.routing import (Routing, balance_loss_from_sums, balance_sums, capacity_slots, expert_capacity,
                                  route)

Array = jax.Array

MOE_STATS = "moe_stats"
STATS = ("load_balance_loss", "dropped", "routed")
# What a layer sows for its balance loss: sums over its tokens (maxpar.model.routing.balance_sums), so that a
# pipeline can add them over its microbatches and still give the loss of the whole batch.
BALANCE_SUMS = ("expert_routed", "expert_probability", "balance_tokens")
ROUTING_BIAS = "routing_bias"


class MoeBlock(ModelModule):
    """Router, top-k, SwiGLU experts: x [B, L, emb], valid [B, L] (False = padding) -> [B, L, emb]."""

    @nn.compact
    def __call__(self, x: Array, valid: Array) -> Array:
        cfg, dt = self.config, self.dtype
        axes = self.layout.experts if self.layout else None
        e, m, n, k = cfg.emb_dim, cfg.moe_mlp_dim or cfg.mlp_dim, cfg.num_experts, cfg.num_experts_per_tok
        # float32 whatever weight_dtype, as DeepSeek-V3's checkpoints keep it: a narrower copy would round it.
        router = kernel(self, "router", (e, n), (Logical.EMBED, None), (0,), dtype=jnp.float32)
        w_gate = kernel(self, "wi_gate", (n, e, m), (Logical.EXP, Logical.EMBED, Logical.MLP), (1,))
        w_up = kernel(self, "wi_up", (n, e, m), (Logical.EXP, Logical.EMBED, Logical.MLP), (1,))
        w_down = kernel(self, "wo", (n, m, e), (Logical.EXP, Logical.MLP, Logical.EMBED), (1,))
        # LoRA adapters of the experts' weights (maxpar.model.lora): merged before the dispatch
        w_gate, w_up, w_down = (lora.adapted_weight(self, name, w)
                                for name, w in (("wi_gate", w_gate), ("wi_up", w_up), ("wo", w_down)))
        bias = (self.param(ROUTING_BIAS, nn.with_logical_partitioning(nn.initializers.zeros, (None,)), (n,),
                           jnp.float32),) if cfg.routed_bias else ()
        shared = (Mlp(cfg, self.layout, width=cfg.num_shared_experts * m, name="shared_experts")
                  if cfg.num_shared_experts else None)
        # fp8_scaling=delayed: a history per expert of each expert matmul (maxpar.model.fp8's per-expert scaling)
        histories = tuple(amax_history(self, name, n) for name in ("wi_gate", "wi_up", "wo"))
        if self.is_initializing():  # init needs the parameters only (and its 1-row batch would not shard)
            if shared is not None:
                shared(x)
            return jnp.zeros_like(x)

        logits = checkpoint_name(jnp.einsum("ble,ex->blx", x, router.astype(dt), preferred_element_type=jnp.float32),
                                 PROJECTION)  # saved by remat_policy=minimal
        router_fn = functools.partial(
            _route, k=k, renormalize=cfg.norm_topk_prob, score_func=cfg.routed_score_func,
            scaling=cfg.routed_scaling_factor, groups=cfg.n_routing_groups, topk_groups=cfg.topk_routing_group)
        routing = on_token_shards(router_fn, axes, logits, whole=bias)
        weights = (w_gate.astype(dt), w_up.astype(dt), w_down.astype(dt))
        routed = jnp.sum(valid).astype(jnp.float32) * k
        fp8 = cfg.quantization == "fp8"  # the experts' matmuls: current scales, or delayed ones from `histories`
        if cfg.capacity_factor > 0:
            capacity = expert_capacity(x.shape[1], k, n, cfg.capacity_factor)
            # A row's tokens compete for its capacity in sequence order: the whole row, in its original order.
            context = self.layout.context if self.layout else None
            order = sequence_layout(x.shape[1], context.degree, True) if context and context.balanced else None
            slots, kept = on_token_shards(functools.partial(capacity_slots, num_experts=n, capacity=capacity,
                                                            order=order),
                                          axes, routing.experts, valid, whole_rows=True)
            combine = jnp.where(kept, routing.weights, 0.0)
            y = expert_parallel(capacity_local, axes, x, (routing.experts, slots, combine), *weights, flat_tokens=False,
                                fp8=fp8, histories=histories, num_experts=n, capacity=capacity)
            dropped = routed - jnp.sum(kept).astype(jnp.float32)
        else:
            y = expert_parallel(dropless_local, axes, x, (routing.experts, routing.weights), *weights, flat_tokens=True,
                                fp8=fp8, histories=histories, num_experts=n)
            dropped = jnp.zeros((), jnp.float32)
        for name, value in zip(BALANCE_SUMS, balance_sums(routing, valid)):
            self.sow(MOE_STATS, name, value)
        self.sow(MOE_STATS, "dropped", dropped)
        self.sow(MOE_STATS, "routed", routed)
        if shared is not None:
            y = y + shared(x)
        return self.constrain(y, RESIDUAL)


def _route(*args: Array, **kwargs: Any) -> Routing:
    """`route` of (logits) or (bias, logits): the order `on_token_shards` passes them in."""
    *bias, logits = args
    return route(logits, bias=bias[0] if bias else None, **kwargs)


def moe_totals(stats: Any) -> dict[str, Array]:
    """Each statistic summed over every MoE layer of a `moe_stats` collection (any nesting or stacking):
    dropped and routed copies, and the load-balancing loss computed per layer from its sums."""
    totals = {name: jnp.zeros((), jnp.float32) for name in STATS}
    sums: dict[tuple[str, ...], dict[str, Array]] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(stats):
        keys = [str(getattr(key, "key", getattr(key, "idx", ""))) for key in path]
        name = next(k for k in keys if k in STATS + BALANCE_SUMS)
        if name in BALANCE_SUMS:  # one layer (or a stack of layers) per path prefix
            sums.setdefault(tuple(keys[:keys.index(name)]), {})[name] = leaf
        else:
            totals[name] = totals[name] + jnp.sum(leaf)
    for layer in sums.values():
        loss = balance_loss_from_sums(*(layer[name] for name in BALANCE_SUMS))
        totals["load_balance_loss"] = totals["load_balance_loss"] + jnp.sum(loss)
    return totals


def _dict_keys(path: Any) -> tuple[str, ...]:
    """The dictionary keys of a tree path (a sown value's tuple index and a box's attribute dropped)."""
    return tuple(str(key.key) for key in path if hasattr(key, "key"))


def routed_counts(stats: Any) -> dict[str, Array]:
    """Each MoE layer's (or layer stack's) routed token copies per expert [..., E] from a `moe_stats` collection,
    keyed by its MoE block's path ("decoder/layers/moe"): what `routing_bias_update` matches to the biases."""
    return {"/".join(keys[:-1]): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(stats)
            if (keys := _dict_keys(path))[-1] == "expert_routed"}


def load_max_over_mean(routed: dict[str, Array]) -> Array:
    """The busiest expert's load over the mean load, one figure per MoE layer [layers] (1 = perfectly even, experts
    / top-k = every token chose the same expert), from `routed_counts`: what the balancing methods bound."""
    loads = [counts.reshape(-1, counts.shape[-1]) for _, counts in sorted(routed.items())]
    load = jnp.concatenate(loads).astype(jnp.float32)
    mean = jnp.mean(load, axis=-1)
    return jnp.where(mean > 0, jnp.max(load, axis=-1) / jnp.where(mean > 0, mean, 1.0), 1.0)


def routing_bias_update(params: Any, routed: dict[str, Array], rate: float) -> Any:
    """`params` with every `routing_bias` moved by rate x sign(mean load - load) from its layers' routed counts
    (aux-loss-free balancing, DeepSeek-V3): an under-loaded expert gains, an over-loaded one loses. The biases
    and the counts share their layers' order (scanned, unrolled or pipelined), so a stack updates as a whole."""
    def update(path, bias):
        keys = _dict_keys(path)
        if keys[-1] != ROUTING_BIAS:
            return bias
        block = "/".join(keys[:-1])
        if block not in routed:
            raise ValueError(f"routing_bias at {block} has no routed counts in the step's moe_stats "
                             f"(have: {sorted(routed)})")
        load = routed[block].reshape(-1, bias.shape[-1])
        step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        return bias + step.reshape(bias.shape).astype(bias.dtype)
    return jax.tree_util.tree_map_with_path(update, params)
