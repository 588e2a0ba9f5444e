"""Direct preference optimization: the pair loss against a frozen reference model, and its reward metrics.

A DPO batch packs whole pairs into rows (maxpar.io.data.conversations): pair k of a row is its segments 2k - 1
(prompt + chosen response) and 2k (prompt + rejected response), and `loss_mask` marks the response targets. A
sequence's log-probability is the sum of its response targets' log-probabilities, under the policy (the trained
model) and under the reference (the starting parameters, frozen: `maxpar.training.trainable.reference`, no
gradient). With the log-ratios r = policy - reference of the chosen and the rejected sequence,
    loss = -(1 - eps) log sigmoid(beta (r_chosen - r_rejected)) - eps log sigmoid(-beta (r_chosen - r_rejected))
(eps = dpo_label_smoothing), the mean over the step's pairs, as TRL's DPOTrainer computes it; the rewards are
beta r, the reward accuracy the share of pairs whose chosen reward is the larger, the margin their difference.

Sums, not means, leave here (`loss_sum` and the reward sums over the pairs, `tokens` = the pair count), so that
microbatches and pipeline stages add up and the step divides once, as for the language-model loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from maxpar.core.config import Config
from maxpar.model.fp8 import FP8_META
from maxpar.model.moe import MOE_STATS

Array = jax.Array
Batch = dict[str, Array]
# (the model's moe_stats, the loss's count) -> (the balance loss's part of the objective, the MoE metric sums)
BalanceSums = Callable[[Any, Array], tuple[Array, dict[str, Array]]]
SUMS = ("accuracy", "margin", "chosen_reward", "rejected_reward", "chosen_logps", "rejected_logps")


def sequence_logps(logits: Array, batch: Batch) -> Array:
    """[B, L + 1]: per row, each segment's summed float32 log-probability of its `loss_mask` targets (index =
    segment id; 0 collects nothing). A scatter-add, so the order of a row's tokens does not matter (context
    parallelism's load balance reorders them)."""
    token = -optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    token = jnp.where(batch["loss_mask"] != 0, token, 0.0)
    rows, length = batch["segment_ids"].shape
    return jnp.zeros((rows, length + 1), jnp.float32).at[jnp.arange(rows)[:, None], batch["segment_ids"]].add(token)


def pairs(per_segment: Array, segment_ids: Array) -> tuple[Array, Array, Array]:
    """(chosen [B, P], rejected [B, P], which pairs exist [B, P]) from a [B, L + 1] per-segment array, P = L // 2."""
    rows, length = segment_ids.shape
    present = jnp.zeros((rows, length + 1), jnp.bool_).at[jnp.arange(rows)[:, None], segment_ids].max(segment_ids > 0)
    count = length // 2
    return per_segment[:, 1::2][:, :count], per_segment[:, 2::2][:, :count], present[:, 2::2][:, :count]


def pair_sums(policy: Array, reference: Array, segment_ids: Array, beta: float, smoothing: float
              ) -> dict[str, Array]:
    """The loss and reward sums over a batch's pairs from per-segment log-probabilities."""
    chosen, rejected, exists = pairs(policy, segment_ids)
    ref_chosen, ref_rejected, _ = pairs(reference, segment_ids)
    chosen_reward, rejected_reward = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    margin = chosen_reward - rejected_reward
    loss = -(1.0 - smoothing) * jax.nn.log_sigmoid(margin) - smoothing * jax.nn.log_sigmoid(-margin)

    def total(x: Array) -> Array:
        return jnp.sum(jnp.where(exists, x, 0.0))
    values = {"accuracy": (chosen_reward > rejected_reward).astype(jnp.float32), "margin": margin,
              "chosen_reward": chosen_reward, "rejected_reward": rejected_reward, "chosen_logps": chosen,
              "rejected_logps": rejected}
    return {"loss_sum": total(loss), "tokens": jnp.sum(exists).astype(jnp.float32),
            **{f"dpo_{name}_sum": total(values[name]) for name in SUMS}}


def objective(params: Any, reference: Any, fp8_meta: Any, batch: Batch, *, model: nn.Module, config: Config,
              balance: BalanceSums | None = None) -> tuple[Array, dict[str, Array]]:
    """(the summed pair loss (plus the MoE balance term), the sums) of one microbatch of pairs; the gradient flows
    through `params` only. `balance`: the MoE layers' part of the objective and their metric sums."""
    moe = config.num_experts > 1 and balance is not None
    inputs = (batch["inputs"], batch["positions"], batch["segment_ids"])
    variables = {"params": params, FP8_META: fp8_meta} if fp8_meta else {"params": params}
    logits, stats = model.apply(variables, *inputs, mutable=[MOE_STATS] if moe else [])
    reference_logits = model.apply({"params": jax.lax.stop_gradient(reference)}, *inputs)
    sums = pair_sums(sequence_logps(logits, batch), jax.lax.stop_gradient(sequence_logps(reference_logits, batch)),
                     batch["segment_ids"], config.dpo_beta, config.dpo_label_smoothing)
    if not moe:
        return sums["loss_sum"], sums
    balance_sum, moe_sums = balance(stats[MOE_STATS], sums["tokens"])
    return sums["loss_sum"] + config.load_balance_loss_weight * balance_sum, sums | moe_sums


def metrics(sums: dict[str, Array], pairs_count: Array) -> dict[str, Array]:
    """The step's DPO metrics (none for another objective): the mean reward accuracy, margin, rewards and
    log-probabilities over its pairs."""
    if "dpo_accuracy_sum" not in sums:
        return {}
    names = {"accuracy": "dpo_reward_accuracy", "margin": "dpo_reward_margin", "chosen_reward": "dpo_chosen_reward",
             "rejected_reward": "dpo_rejected_reward", "chosen_logps": "dpo_chosen_logps",
             "rejected_logps": "dpo_rejected_logps"}
    return {metric: sums[f"dpo_{name}_sum"] / pairs_count for name, metric in names.items()}
