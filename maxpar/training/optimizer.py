"""AdamW with linear warm-up, cosine decay and global-norm clipping."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from maxpar.core.config import Config
from maxpar.model.roles import ParamRole, param_role


def learning_rate_schedule(config: Config) -> optax.Schedule:
    """0 -> learning_rate over warmup_steps, then cosine to learning_rate_final_fraction."""
    peak = config.learning_rate
    warmup = optax.linear_schedule(0.0, peak, max(config.warmup_steps, 1))
    decay_steps = max(config.steps - config.warmup_steps, 1)
    decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.learning_rate_final_fraction)
    return optax.join_schedules([warmup, decay], [config.warmup_steps])


def make_optimizer(config: Config) -> optax.GradientTransformation:
    transforms = []
    if config.gradient_clipping_threshold > 0:
        transforms.append(optax.clip_by_global_norm(config.gradient_clipping_threshold))
    adamw = optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2,
                        eps=config.adam_eps, weight_decay=config.adam_weight_decay, mask=decay_mask)
    transforms.append(state_in_dtype(adamw, jnp.dtype(config.moments_dtype)))
    if config.routed_bias:
        transforms.append(optax.masked(optax.set_to_zero(), not_optimized_mask))
    return optax.chain(*transforms)


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
