"""The attention core (scores, mask, softmax, weighted values), one implementation per `attention` choice.

`Attention` (layers.py) projects and rotates q, k, v and hands them here; every
choice computes the same function: causal attention that never crosses a packed
document boundary (segment ids), optionally within a sliding window of the most
recent `sliding_window` positions (Mistral), GQA, softmax in float32, q pre-scaled.

- dot_product: explicit einsums; XLA materializes the [B, heads, L, L] scores. Its backward is flash
  attention's on the whole matrices (a custom VJP).
- xla: `jax.nn.dot_product_attention(implementation="xla")`, the same math behind
  JAX's fused-attention interface; it runs on any backend, so the CPU tests check
  on it the call (layout, GQA, causal flag, segment mask) that the cuDNN choices share.
- cudnn_flash: cuDNN flash attention (GPU, bf16/fp16). The kernel applies the causal
  mask itself and skips the tiles above the diagonal. The public API has no segment
  ids, so the packed-document mask goes in as the boolean `mask`, which cuDNN adds as
  a dense [B, 1, L, L] bias: exact for packed rows, at the cost of that bias's memory
  traffic (and its gradient, which the JAX wrapper always computes).
- cudnn_flash_causal: the same kernel with the causal mask only, no bias. Exact only
  when every row is one document (`validate` refuses it for dataset_type=text).
- blockwise: pure-JAX flash attention (maxpar/model/blockwise.py): blocks of
  `attention_block_size`, online softmax, masked blocks skipped, a recomputing custom VJP;
  on a mesh with a `context` axis it runs context-parallel (maxpar/model/context_parallel.py).
- splash: JAX's Pallas TPU splash attention kernel (maxpar/model/splash.py): blocks of `sa_block_q` x
  `sa_block_kv`, masked blocks skipped, no scores kept; per device under shard_map on a mesh, context-parallel
  with the all_gather strategy. TPU only.

The device and sharding checks of the cuDNN and splash choices are in `maxpar.core.layout`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxpar.core.config import CUDNN_ATTENTION, ModelConfig
from maxpar.core.layout import ContextLayout
from maxpar.model.context_parallel import context_attention
from maxpar.model.splash import splash_core

Array = jax.Array


def document_mask(segment_ids: Array) -> Array:
    """[B, 1, Lq, Lk]: True where query and key belong to the same packed document."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def causal_document_mask(segment_ids: Array, window: int = 0) -> Array:
    """[B, 1, Lq, Lk]: causal, and only within the same packed document.

    With a `window` (Mistral's sliding window) a query sees only the `window` most recent
    positions, its own included: key index > query index - window, as in Hugging Face.
    """
    length = segment_ids.shape[1]
    offset = jnp.arange(length)[:, None] - jnp.arange(length)[None, :]
    causal = (offset >= 0) & (offset < window) if window else offset >= 0
    return causal[None, None] & document_mask(segment_ids)


def _grouped(q: Array, kv: int) -> Array:
    """[B, L, H, D] -> [B, L, KV, G, D]: the query heads that share each k/v head."""
    b, length, heads, d = q.shape
    return q.reshape(b, length, kv, heads // kv, d)


def _scores_and_output(q: Array, k: Array, v: Array, mask: Array) -> tuple[Array, Array]:
    """(float32 probabilities [B, KV, G, Lq, Lk], output [B, Lq, KV, G, D] in q's dtype). Both matmuls take the
    operands' dtype and accumulate in float32."""
    scores = jnp.einsum("bqkgd,bskd->bkgqs", _grouped(q, k.shape[2]), k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min), axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return probs, out.astype(q.dtype)


@jax.custom_vjp
def masked_attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """q [B, Lq, H, D] (pre-scaled), k [B, Lk, KV, D], v [B, Lk, KV, Dv], mask [B, 1, Lq, Lk] -> [B, Lq, H, Dv];
    explicit scores.

    The gradient is flash attention's, on the whole matrices: the softmax's row sums come from the output
    (rowsum(dO * O), over D) instead of the [Lq, Lk] probabilities, and the float32 score gradient is rounded
    to the compute dtype before its two matmuls. (XLA:CPU turned autodiff's [Lq, Lk] row sum into a slow
    reduce-window fusion, a large share of a one-device step.)
    """
    return _scores_and_output(q, k, v, mask)[1].reshape(q.shape[:-1] + v.shape[-1:])


def _masked_attention_fwd(q, k, v, mask):
    probs, out = _scores_and_output(q, k, v, mask)
    return out.reshape(q.shape[:-1] + v.shape[-1:]), (q, k, v, mask, probs, out)


def _masked_attention_bwd(residuals, d_out):
    q, k, v, mask, probs, out = residuals
    d_out = d_out.reshape(out.shape).astype(v.dtype)
    d_v = jnp.einsum("bkgqs,bqkgd->bskd", probs.astype(v.dtype), d_out, preferred_element_type=jnp.float32)
    d_probs = jnp.einsum("bqkgd,bskd->bkgqs", d_out, v, preferred_element_type=jnp.float32)
    row = jnp.einsum("bqkgd,bqkgd->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    d_scores = (probs * (d_probs - row[..., None])).astype(q.dtype)
    d_q = jnp.einsum("bkgqs,bskd->bqkgd", d_scores, k, preferred_element_type=jnp.float32)
    d_k = jnp.einsum("bkgqs,bqkgd->bskd", d_scores, _grouped(q, k.shape[2]), preferred_element_type=jnp.float32)
    return d_q.reshape(q.shape).astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None


masked_attention.defvjp(_masked_attention_fwd, _masked_attention_bwd)


def einsum_attention(q: Array, k: Array, v: Array, segment_ids: Array, window: int = 0) -> Array:
    """q [B, L, H, D] (pre-scaled), k/v [B, L, KV, D] -> [B, L, H, D]; the scores are explicit."""
    return masked_attention(q, k, v, causal_document_mask(segment_ids, window))


def cached_attention(q: Array, k_cache: Array, v_cache: Array, positions: Array, window: int = 0) -> Array:
    """Decoding: q [B, Lq, H, D] at `positions` [B, Lq] against a KV cache [B, S, KV, D] whose slot s holds
    position s. A query sees the slots at or before its position (within the window), so slots a row has
    not written yet, or padding written past its prompt, never count."""
    offset = positions[:, :, None] - jnp.arange(k_cache.shape[1])[None, None, :]
    mask = (offset >= 0) & (offset < window) if window else offset >= 0
    return masked_attention(q, k_cache, v_cache, mask[:, None])


def fused_attention(q: Array, k: Array, v: Array, segment_ids: Array, implementation: str,
                    documents: bool, window: int = 0) -> Array:
    """`jax.nn.dot_product_attention` with the causal flag (and a left window of `window` - 1 earlier
    positions when set); the document mask only if `documents`."""
    mask = document_mask(segment_ids) if documents else None
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=1.0, is_causal=True,
                                        local_window_size=(window - 1, 0) if window else None,
                                        implementation=implementation)


def attend(q: Array, k: Array, v: Array, segment_ids: Array, choice: str, window: int = 0,
           config: ModelConfig | None = None, context: ContextLayout | None = None) -> Array:
    """The attention core named by `choice` (a value of `config.attention`); `window` 0 = no sliding window.

    blockwise and splash run per device over the layout's `context`, which holds the batch, head and
    context-parallel splits (None: no mesh, the whole arrays in the config's blocks).
    """
    if choice == "blockwise":
        return context_attention(q, k, v, segment_ids, config, context)
    if choice == "splash":
        return splash_core(q, k, v, segment_ids, window, config, context)
    if choice == "dot_product":
        return einsum_attention(q, k, v, segment_ids, window)
    if choice == "xla":
        return fused_attention(q, k, v, segment_ids, "xla", documents=True, window=window)
    if choice in CUDNN_ATTENTION:
        return fused_attention(q, k, v, segment_ids, "cudnn", documents=choice == "cudnn_flash", window=window)
    raise ValueError(f"unknown attention implementation {choice!r}")
