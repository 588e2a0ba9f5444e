"""AdamW with linear warm-up, cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import optax

from maxpar.config import Config


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
    transforms.append(optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2,
                                  eps=config.adam_eps, weight_decay=config.adam_weight_decay,
                                  mask=decay_mask))
    return optax.chain(*transforms)


def decay_mask(params):
    """Weight decay on matmul weights and embeddings, not on norm scales."""
    def is_decayed(path, _):
        return not any(getattr(key, "key", None) == "scale" for key in path)
    return jax.tree_util.tree_map_with_path(is_decayed, params)
