"""The mixture-of-experts feed-forward block (Mixtral-style) and its per-step statistics.

Parameters (a contract: the Hugging Face Mixtral converter maps onto these):
`router` [emb, experts], `wi_gate` and `wi_up` [experts, emb, mlp], `wo`
[experts, mlp, emb]; the expert weights carry the logical axis `exp` on their
leading dim (the rules map it to the `expert` mesh axis).

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
from maxpar.model.layers import ModelModule, kernel
from maxpar.model.matmul import PROJECTION
from maxpar.model.moe_dispatch import capacity_local, dropless_local, expert_parallel, on_token_shards
from maxpar.model.routing import balance_loss_from_sums, balance_sums, capacity_slots, expert_capacity, route

Array = jax.Array

MOE_STATS = "moe_stats"
STATS = ("load_balance_loss", "dropped", "routed")
# What a layer sows for its balance loss: sums over its tokens (maxpar.model.routing.balance_sums), so that a
# pipeline can add them over its microbatches and still give the loss of the whole batch.
BALANCE_SUMS = ("expert_routed", "expert_probability", "balance_tokens")


class MoeBlock(ModelModule):
    """Router, top-k, SwiGLU experts: x [B, L, emb], valid [B, L] (False = padding) -> [B, L, emb]."""

    @nn.compact
    def __call__(self, x: Array, valid: Array) -> Array:
        cfg, dt = self.config, self.dtype
        axes = self.layout.experts if self.layout else None
        e, m, n, k = cfg.emb_dim, cfg.mlp_dim, cfg.num_experts, cfg.num_experts_per_tok
        router = kernel(self, "router", (e, n), (Logical.EMBED, None), (0,))
        w_gate = kernel(self, "wi_gate", (n, e, m), (Logical.EXP, Logical.EMBED, Logical.MLP), (1,))
        w_up = kernel(self, "wi_up", (n, e, m), (Logical.EXP, Logical.EMBED, Logical.MLP), (1,))
        w_down = kernel(self, "wo", (n, m, e), (Logical.EXP, Logical.MLP, Logical.EMBED), (1,))
        if self.is_initializing():  # init needs the parameters only (and its 1-row batch would not shard)
            return jnp.zeros_like(x)

        logits = checkpoint_name(jnp.einsum("ble,ex->blx", x, router.astype(dt), preferred_element_type=jnp.float32),
                                 PROJECTION)  # saved by remat_policy=minimal
        routing = on_token_shards(functools.partial(route, k=k, renormalize=cfg.norm_topk_prob), axes, logits)
        weights = (w_gate.astype(dt), w_up.astype(dt), w_down.astype(dt))
        routed = jnp.sum(valid).astype(jnp.float32) * k
        fp8 = cfg.quantization == "fp8"  # the experts' matmuls, with current scales whatever fp8_scaling says
        if cfg.capacity_factor > 0:
            capacity = expert_capacity(x.shape[1], k, n, cfg.capacity_factor)
            slots, kept = on_token_shards(functools.partial(capacity_slots, num_experts=n, capacity=capacity),
                                          axes, routing.experts, valid)
            combine = jnp.where(kept, routing.weights, 0.0)
            y = expert_parallel(capacity_local, axes, x, (routing.experts, slots, combine), *weights, flat_tokens=False,
                                fp8=fp8, num_experts=n, capacity=capacity)
            dropped = routed - jnp.sum(kept).astype(jnp.float32)
        else:
            y = expert_parallel(dropless_local, axes, x, (routing.experts, routing.weights), *weights, flat_tokens=True,
                                fp8=fp8, num_experts=n)
            dropped = jnp.zeros((), jnp.float32)
        for name, value in zip(BALANCE_SUMS, balance_sums(routing, valid)):
            self.sow(MOE_STATS, name, value)
        self.sow(MOE_STATS, "dropped", dropped)
        self.sow(MOE_STATS, "routed", routed)
        return self.constrain(y, RESIDUAL)


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
