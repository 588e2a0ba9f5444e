"""Token-to-expert routing: Mixtral's and DeepSeek-V3's top-k, the load-balancing loss, and capacity slots.

Pure functions of per-token arrays with leading dims [batch, length]; they
contain no collective and no mesh axis, so under jit the partitioner keeps
them on each token's own device. `maxpar.model.moe_dispatch` moves the tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


class Routing(NamedTuple):
    """Where each token goes: router probabilities, its top-k experts and their combine weights."""

    probs: Array    # [..., num_experts] float32: the scores as a distribution (what the balance loss reads)
    experts: Array  # [..., k] int32: chosen experts, best (bias included) first
    weights: Array  # [..., k] float32: their combine weights


def route(logits: Array, k: int, renormalize: bool = True, *, score_func: str = "softmax",
          bias: Array | None = None, scaling: float = 1.0, groups: int = 0, topk_groups: int = 0) -> Routing:
    """Top-k routing of Mixtral (softmax) and DeepSeek-V3 (sigmoid, bias, groups) from the router's logits.

    Scores: softmax over the experts, or each expert's sigmoid. `bias` [E] is added to the scores for the
    choice only (aux-loss-free balancing); the combine weights are the unbiased scores of the chosen experts,
    renormalized to sum to 1 (`renormalize`, Qwen3-MoE's norm_topk_prob) and times `scaling`. With `groups`
    > 1 the experts form equal groups, a group scores the sum of its two best biased scores, and a token
    chooses among the experts of its `topk_groups` best groups. `probs` is the scores normalized to sum to 1
    (softmax's own; sigmoid's divided by their sum, as DeepSeek's sequence-wise balance loss does).
    Ties go to the lower index (`jax.lax.top_k`).
    """
    logits = logits.astype(jnp.float32)
    if score_func == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    choice = scores if bias is None else scores + jax.lax.stop_gradient(bias).astype(jnp.float32)
    if groups > 1:
        choice = _within_best_groups(choice, groups, topk_groups)
    _, experts = jax.lax.top_k(choice, k)
    top = jnp.take_along_axis(scores, experts, axis=-1)
    if renormalize:
        top = top / (jnp.sum(top, axis=-1, keepdims=True) + 1e-20)
    return Routing(probs, experts.astype(jnp.int32), top * scaling)


def _within_best_groups(choice: Array, groups: int, keep: int) -> Array:
    """`choice` [..., E] with every expert outside the token's `keep` best groups at -inf."""
    grouped = choice.reshape(*choice.shape[:-1], groups, choice.shape[-1] // groups)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, best = jax.lax.top_k(group_scores, keep)
    kept = jnp.sum(jax.nn.one_hot(best, groups, dtype=jnp.int32), axis=-2) > 0
    return jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)


def load_balance_loss(routing: Routing, valid: Array) -> Array:
    """num_experts x sum_i f_i P_i over the real tokens (Switch Transformer; Hugging Face Mixtral).

    f_i is the fraction of tokens routed to expert i (counting every one of the k
    choices, so sum_i f_i = k) and P_i the mean router probability of expert i.
    Only f depends on the top-k choice, so the gradient flows through P.
    A perfectly balanced router (f_i = k / E, P_i = 1 / E) scores k, the value the
    loss pushes towards; sending every token to the same k experts with
    certainty scores E, the worst.
    `valid` [...] masks padding tokens out of both means.
    """
    return balance_loss_from_sums(*balance_sums(routing, valid))


def balance_sums(routing: Routing, valid: Array) -> tuple[Array, Array, Array]:
    """The load-balancing loss's sufficient statistics over the real tokens: per expert the routed copies
    and the summed router probability [E], and the token count. Sums add over microbatches and pipeline
    iterations, so the loss of a whole step can be computed from its pieces' sums."""
    num_experts = routing.probs.shape[-1]
    mask = valid.astype(jnp.float32)
    chosen = jnp.sum(jax.nn.one_hot(routing.experts, num_experts, dtype=jnp.float32), axis=-2)  # [..., E]
    reduce = tuple(range(mask.ndim))
    return (jnp.sum(chosen * mask[..., None], axis=reduce), jnp.sum(routing.probs * mask[..., None], axis=reduce),
            jnp.sum(mask))


def balance_loss_from_sums(routed: Array, probability: Array, tokens: Array) -> Array:
    """num_experts x sum_i f_i P_i from `balance_sums` (leading dims: one loss per entry, e.g. per layer)."""
    tokens = jnp.maximum(tokens, 1.0)[..., None]
    return routed.shape[-1] * jnp.sum((routed / tokens) * (probability / tokens), axis=-1)


def expert_capacity(row_length: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert takes from one row: ceil(capacity_factor x row_length x k / num_experts), at least 1.

    The group whose tokens compete for capacity is one row (sequence), so which
    tokens drop depends on the data only, never on how the batch is sharded.
    """
    return max(1, math.ceil(capacity_factor * row_length * k / num_experts - 1e-9))


def capacity_slots(experts: Array, valid: Array, num_experts: int, capacity: int,
                   order: np.ndarray | None = None) -> tuple[Array, Array]:
    """(slot [B, L, k] int32, kept [B, L, k] bool): each assignment's place in its expert's buffer of the row.

    Priority within a row: every token's first choice (in sequence order) before
    any second choice, and so on (GShard's rule: a token keeps its best expert
    before others keep their k-th). Assignments beyond `capacity` are dropped;
    padding tokens (`valid` False) take no capacity and are dropped too. A
    dropped assignment's slot is `capacity` (one past the buffer).
    `order` [L]: each row position's token index in the original sequence (context parallelism's load-balancing
    reorder), whose order is the priority, so the same tokens drop as in the unreordered row; None: the identity.
    """
    if order is not None:
        back = np.argsort(order)  # the row position of each original token
        slot, kept = capacity_slots(jnp.take(experts, back, axis=1), jnp.take(valid, back, axis=1), num_experts,
                                    capacity)
        return jnp.take(slot, order, axis=1), jnp.take(kept, order, axis=1)
    batch, length, k = experts.shape
    onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32) * valid[:, :, None, None].astype(jnp.int32)
    by_priority = onehot.transpose(0, 2, 1, 3).reshape(batch, k * length, num_experts)
    taken_before = jnp.cumsum(by_priority, axis=1) - by_priority
    position = taken_before.reshape(batch, k, length, num_experts).transpose(0, 2, 1, 3)
    slot = jnp.sum(position * onehot, axis=-1)
    kept = valid[:, :, None] & (slot < capacity)
    return jnp.where(kept, slot, capacity).astype(jnp.int32), kept
