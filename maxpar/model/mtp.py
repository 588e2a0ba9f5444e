"""DeepSeek-V3's multi-token prediction (MTP): D modules after the layer stack, module k predicting token i+k+1.

Module k combines the previous hidden state (the stack's output before the final norm, for k = 1) with the
embedding of token i+k and runs one decoder layer of the model's own kind:
    h_k = layer_k(W_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_{k-1})]),    logits_k = Out(RMSNorm_k(h_k)).
The embedding table and the output projection are the model's own; the concatenation puts the embedding first,
as the released DeepSeek-V3 checkpoint's `eh_proj` expects. The modules only add a training signal: sampling never
runs them.

The shifted tokens, targets and masks are made from the batch before anything reorders its sequence (context
parallelism's load balance), so the modules see plain per-position inputs like the rest of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from maxpar.core.axes import RESIDUAL, Logical
from maxpar.model.layers import ModelModule, RMSNorm, kernel
from maxpar.model.matmul import matmul

Array = jax.Array
MTP = "mtp"  # the modules' entry in the model's parameter tree


def _shifted(x: Array, k: int) -> Array:
    """[B, L] -> row i holds x[i + k], zeros past the end."""
    return jnp.pad(x[:, k:], ((0, 0), (0, k)))


def mtp_key(name: str, k: int) -> str:
    return f"mtp_{name}_{k}"


def with_mtp_targets(batch: dict[str, Array], num_layers: int) -> dict[str, Array]:
    """The batch plus, per module k, its input tokens t_{i+k} (`mtp_inputs_k`), targets t_{i+k+1} (`mtp_targets_k`)
    and the positions whose target lies in the same document and in the row (`mtp_mask_k`), all [B, L]."""
    segments = batch["segment_ids"]
    extra = {}
    for k in range(1, num_layers + 1):
        ahead = _shifted(segments, k)
        extra[mtp_key("inputs", k)] = _shifted(batch["inputs"], k)
        extra[mtp_key("targets", k)] = _shifted(batch["targets"], k)
        extra[mtp_key("mask", k)] = ((ahead == segments) & (segments != 0)).astype(segments.dtype)
    return {**batch, **extra}


def mtp_inputs(batch: dict[str, Array], num_layers: int) -> tuple[Array, ...] | None:
    """The modules' input tokens of a `with_mtp_targets` batch, None without MTP."""
    return tuple(batch[mtp_key("inputs", k)] for k in range(1, num_layers + 1)) or None


def mtp_loss_sum(logits: Sequence[Array], batch: dict[str, Array]) -> Array:
    """Mean over the modules of each one's summed cross-entropy over its masked positions (float32). Divided by
    the step's real tokens like the main loss, so that it sums over microbatches and pipeline stages."""
    total = jnp.zeros((), jnp.float32)
    for k, module_logits in enumerate(logits, 1):
        losses = optax.softmax_cross_entropy_with_integer_labels(module_logits, batch[mtp_key("targets", k)])
        total = total + jnp.sum(jnp.where(batch[mtp_key("mask", k)] != 0, losses, 0.0))
    return total / len(logits)


class MultiTokenPrediction(ModelModule):
    """The D MTP modules: (stack output h [B, L, E], D token arrays) -> D float32 logits [B, L, V].

    `layer` is the decoder layer class the model stacks (rematerialized as the stack's), `moe` its kind: that of
    the model's last layer."""

    layer: Any = None
    moe: bool = False

    @nn.compact
    def __call__(self, h: Array, tokens: Sequence[Array], positions: Array, segment_ids: Array,
                 embed: Callable[[Array], Array], head: Callable[[Array], Array]) -> list[Array]:
        cfg, layout = self.config, self.layout
        logits = []
        for k, module_tokens in enumerate(tokens, 1):
            h, module_logits = MtpModule(cfg, layout, layer=self.layer, moe=self.moe, name=f"module_{k}")(
                h, embed(module_tokens), positions, segment_ids, head)
            logits.append(module_logits)
        return logits


class MtpModule(ModelModule):
    """One MTP module: (h_{k-1}, Emb(t_{i+k})) -> (h_k, logits_k)."""

    layer: Any = None
    moe: bool = False

    @nn.compact
    def __call__(self, h: Array, embedded: Array, positions: Array, segment_ids: Array,
                 head: Callable[[Array], Array]) -> tuple[Array, Array]:
        cfg, layout = self.config, self.layout
        joined = jnp.concatenate([RMSNorm(cfg, layout, name="embedding_norm")(embedded),
                                  RMSNorm(cfg, layout, name="hidden_norm")(h)], axis=-1)
        w = MtpProjection(cfg, layout, name="projection")()
        x = self.constrain(matmul("blc,ce->ble", joined, w, self.dtype), RESIDUAL)
        x, _ = self.layer(cfg, layout, moe=self.moe, name="layer")(x, positions, segment_ids)
        return x, head(RMSNorm(cfg, layout, name="head_norm")(x))


class MtpProjection(ModelModule):
    """W_k [2 emb, emb]: its own module so that its role is named by (`projection`, `kernel`)."""

    @nn.compact
    def __call__(self) -> Array:
        e = self.config.emb_dim
        return kernel(self, "kernel", (2 * e, e), (None, Logical.EMBED), fan_in_axes=(0,))
