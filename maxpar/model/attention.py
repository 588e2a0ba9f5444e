"""The attention core (scores, mask, softmax, weighted values), one implementation per `attention` choice.

`Attention` (layers.py) projects and rotates q, k, v and hands them here; every
choice computes the same function: causal attention that never crosses a packed
document boundary (segment ids), optionally within a sliding window of the most
recent `sliding_window` positions (Mistral), GQA, softmax in float32, q pre-scaled.

- dot_product: explicit einsums; XLA materializes the [B, heads, L, L] scores.
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

The device and sharding checks of the cuDNN choices are in `maxpar.layout`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxpar.config import CUDNN_ATTENTION, Config
from maxpar.layout import ContextLayout
from maxpar.model.context_parallel import context_attention
from maxpar.model.matmul import matmul

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


def masked_attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """q [B, Lq, H, D] (pre-scaled), k/v [B, Lk, KV, D], mask [B, 1, Lq, Lk] -> [B, Lq, H, D]; explicit scores."""
    b, length, heads, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, length, kv, heads // kv, d)
    # Both matmuls take q's dtype and accumulate in float32; their backward rounds the float32 score
    # gradient to that dtype, as flash attention's backward does (maxpar.model.matmul).
    scores = matmul("bqkgd,bskd->bkgqs", q, k, q.dtype, jnp.float32)
    scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return matmul("bkgqs,bskd->bqkgd", probs, v, v.dtype).reshape(b, length, heads, d)


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
           config: Config | None = None, context: ContextLayout | None = None) -> Array:
    """The attention core named by `choice` (a value of `config.attention`); `window` 0 = no sliding window.

    blockwise also reads its block size and context-parallel keys from `config`, and runs over the
    context shards of the layout's `context` (None: no mesh, the whole arrays).
    """
    if choice == "blockwise":
        return context_attention(q, k, v, segment_ids, config, context)
    if choice == "dot_product":
        return einsum_attention(q, k, v, segment_ids, window)
    if choice == "xla":
        return fused_attention(q, k, v, segment_ids, "xla", documents=True, window=window)
    if choice in CUDNN_ATTENTION:
        return fused_attention(q, k, v, segment_ids, "cudnn", documents=choice == "cudnn_flash", window=window)
    raise ValueError(f"unknown attention implementation {choice!r}")
