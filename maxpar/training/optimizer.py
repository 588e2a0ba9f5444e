"""The optimizer: AdamW or Muon (opt_type), a warm-up then cosine or warmup-stable-decay schedule, global-norm
clipping, and the bad-step guard's statistics in its state."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from maxpar.core.config import Config
from maxpar.core.layout import is_spec
from maxpar.model.roles import ParamRole, param_role
from maxpar.training.guards import StepGuard
from maxpar.training.muon import (CHOSEN, MuonSharding, Orthogonalization, dict_keys, is_muon_parameter,
                                  scale_by_muon)

if TYPE_CHECKING:
    from maxpar.core.layout import RunLayout

# How the warmup-stable-decay schedule's decay phase falls from the peak to the final rate, over progress p in [0, 1].
WSD_DECAY_SHAPES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + jnp.cos(math.pi * p)),
    "1-sqrt": lambda p: 1.0 - jnp.sqrt(p),  # Hägele et al. 2024: a fast start and a long, low tail
}


def learning_rate_schedule(config: Config) -> optax.Schedule:
    """0 -> learning_rate over warmup_steps, then (lr_schedule_type) cosine to learning_rate_final_fraction at
    `steps`, or constant until the last wsd_decay_steps_fraction of `steps` and then down to the final fraction in
    the wsd_decay_style shape. WSD's decay is placed by `steps`: resuming with a larger `steps` before it started
    lengthens the stable phase. The schedule counts applied updates (a skipped step does not advance it)."""
    peak = config.learning_rate
    warmup = optax.linear_schedule(0.0, peak, max(config.warmup_steps, 1))
    if config.lr_schedule_type == "cosine":
        decay_steps = max(config.steps - config.warmup_steps, 1)
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.learning_rate_final_fraction)
        return optax.join_schedules([warmup, decay], [config.warmup_steps])
    final = peak * config.learning_rate_final_fraction
    decay_steps = round(config.wsd_decay_steps_fraction * config.steps)
    decay_start = max(config.steps - decay_steps, config.warmup_steps)
    shape = WSD_DECAY_SHAPES[config.wsd_decay_style]

    def stable_then_decay(count: jax.Array) -> jax.Array:
        progress = jnp.clip((count - decay_start) / max(decay_steps, 1), 0.0, 1.0)
        return final + (peak - final) * shape(progress)

    return lambda count: jnp.where(count < config.warmup_steps, warmup(count), stable_then_decay(count))


class OptimizerState(NamedTuple):
    """The train state's optimizer part: the update rule's (AdamW's moments, Muon's momentum, their step count)
    and the bad-step guard's statistics, which the train step reads and updates itself
    (`maxpar.training.guards.judge_step`); keeping them here checkpoints and restores them with the moments."""

    rule: Any
    guard: StepGuard


def make_optimizer(config: Config, layout: RunLayout | None = None,
                   orthogonalization: Orthogonalization = CHOSEN) -> optax.GradientTransformation:
    """The run's optimizer; its update leaves the guard's statistics as they are. `layout`: the run layout
    under whose update shardings Muon orthogonalizes its matrices, as `orthogonalization` says (None: as the
    partitioner likes; enough for shapes and one device)."""
    transforms = []
    if config.gradient_clipping_threshold > 0:
        transforms.append(optax.clip_by_global_norm(config.gradient_clipping_threshold))
    rule = (adamw(config) if config.opt_type == "adamw" else
            muon(config, muon_sharding(layout, orthogonalization)))
    transforms.append(state_in_dtype(rule, jnp.dtype(config.moments_dtype)))
    if config.routed_bias:
        transforms.append(optax.masked(optax.set_to_zero(), not_optimized_mask))
    return with_guard(optax.chain(*transforms))


def with_guard(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` with a fresh `StepGuard` beside its state (`OptimizerState`)."""
    def init(params: Any) -> OptimizerState:
        return OptimizerState(rule=without_boxed_holes(inner.init(params)), guard=StepGuard.fresh())

    def update(updates: Any, state: OptimizerState, params: Any = None) -> tuple[Any, OptimizerState]:
        updates, rule = inner.update(updates, state.rule, params)
        return updates, state._replace(rule=rule)

    return optax.GradientTransformation(init, update)


def without_boxed_holes(state: Any) -> Any:
    """optax.partition leaves a MaskedNode (no array) where a group keeps no state for a parameter; initialized from
    boxed parameters, the node keeps the parameter's box, whose logical axes would then name an array that is not
    there. Unbox those."""
    def unbox(node: Any) -> Any:
        return node.value if isinstance(node, nn.Partitioned) and isinstance(node.value, optax.MaskedNode) else node
    return jax.tree.map(unbox, state, is_leaf=lambda node: isinstance(node, nn.Partitioned))


def adamw(config: Config) -> optax.GradientTransformation:
    return optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
                       weight_decay=config.adam_weight_decay, mask=decay_mask)


def muon(config: Config, sharding: MuonSharding | None) -> optax.GradientTransformation:
    """Muon (`maxpar.training.muon`) for the hidden matrices, AdamW for the rest. Muon's weight decay is decoupled
    and scaled by the learning rate as AdamW's: W <- W - lr (update + muon_weight_decay W)."""
    matrices = optax.chain(scale_by_muon(config.muon_beta, config.muon_consistent_rms, sharding),
                           optax.add_decayed_weights(config.muon_weight_decay),
                           optax.scale_by_learning_rate(learning_rate_schedule(config)))
    return optax.partition({"muon": matrices, "adamw": adamw(config)}, muon_labels)


def muon_labels(params: Any) -> Any:
    """"muon" for the hidden matrices (`maxpar.training.muon.MUON_ROLES`), "adamw" for every other parameter."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "muon" if is_muon_parameter(dict_keys(path)) else "adamw", params)


def muon_sharding(layout: RunLayout | None, how: Orthogonalization = CHOSEN) -> MuonSharding | None:
    """The update PartitionSpec of every parameter of `layout` (ZeRO-1's where it splits them), by path."""
    if layout is None:
        return None
    specs = layout.state_specs.params if layout.update_specs is None else layout.update_specs
    by_path = {dict_keys(path): spec for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_spec)}
    return MuonSharding(mesh=layout.model.mesh.abstract(), specs=by_path, how=how)


def state_in_dtype(inner: optax.GradientTransformation, dtype: Any) -> optax.GradientTransformation:
    """`inner` with its floating-point state stored in `dtype` and its update computed in float32.

    optax's adamw keeps only the first moment in a chosen dtype (`mu_dtype`); the second follows the
    parameters. This keeps both moments in `dtype` (e.g. float32 under bfloat16 weights, the seeds'
    2 + 4 + 4 bytes per parameter), and computes the update from float32 gradients, moments and
    parameters, so the moments never round through the weights' dtype. The updates come back in each
    parameter's dtype.
    """
    def to_float32(tree: Any) -> Any:
        return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def init(params: Any) -> Any:
        state = inner.init(params)
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        new_updates, new_state = inner.update(to_float32(updates), to_float32(state),
                                              None if params is None else to_float32(params))
        # Every state leaf keeps the dtype it was created with (a stable state tree across steps).
        new_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_state, state)
        new_updates = jax.tree.map(lambda u, g: u.astype(g.dtype), new_updates, updates)
        return new_updates, new_state

    return optax.GradientTransformation(init, update)


# Parameters the train step sets itself, outside the gradient (their gradient is zero): no update, no weight decay.
# Their moments stay in the state (zeros), so that the state has one structure for every sharding and pipeline.
NOT_OPTIMIZED = (ParamRole.ROUTING_BIAS,)


def not_optimized_mask(params: Any) -> Any:
    """True for the parameters (boxed or not) of a NOT_OPTIMIZED role: the last transform zeroes their updates."""
    def frozen(path, _):
        return param_role(tuple(str(key.key) for key in path if hasattr(key, "key"))) in NOT_OPTIMIZED
    return jax.tree_util.tree_map_with_path(frozen, params)


def decay_mask(params):
    """Weight decay on matmul weights and embeddings, not on norm scales nor on what the optimizer leaves alone."""
    def is_decayed(path, _, is_frozen):
        return not is_frozen and not any(getattr(key, "key", None) == "scale" for key in path)
    return jax.tree_util.tree_map_with_path(is_decayed, params, not_optimized_mask(params))
