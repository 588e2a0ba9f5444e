"""Per-tensor fp8 matmuls for `quantization=fp8` (maxpar.model.matmul, the MoE experts in maxpar.model.moe_dispatch).

Forward operands go to float8_e4m3fn (3 mantissa bits, range +-448) and gradients to float8_e5m2 (2 mantissa
bits, range +-57344: gradients span more decades than they need digits). A tensor's scale maps its absolute
maximum (amax) onto the format's largest finite value, so the whole tensor uses the format's range; `quantize`
divides by the scale, clips and casts. The amax is the tensor's own (current scaling) or the largest of its recent
ones, kept in an amax history (delayed scaling, below; the MoE experts keep one per expert).

`fp8_product` is one quantized matmul y = x.w as three products on the float8 arrays themselves, each accumulating
in float32 with the product of its two operands' scales applied to its output: the forward e4m3 x e4m3, the input
gradient e5m2 (the output's gradient) x e4m3 (the weight) and the weight gradient e4m3 (the input) x e5m2. The
float8 operands reach the dot itself: XLA's GPU GEMM rewriter turns such a dot into a cuBLASLt fp8 GEMM (scalar
scales, one contracting and one free dimension per operand: a `Contraction` lays the operands out so); a
quantize-then-dequantize round trip feeding a higher-precision dot does not, and XLA may even simplify the round
trip away. XLA:CPU converts the float8 operands to float32 and runs the float32 dot: the same values.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

Array = jax.Array
E4M3 = jnp.dtype(jnp.float8_e4m3fn)  # forward operands: activations and weights
E5M2 = jnp.dtype(jnp.float8_e5m2)    # gradients (the backward's incoming cotangent)


def largest(fmt: jnp.dtype) -> float:
    """The format's largest finite value (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(fmt).max)


def scale_from_amax(amax: Array, fmt: jnp.dtype) -> Array:
    """float32 scale mapping `amax` onto the format's largest value; 1 where amax is 0 or not finite, so an
    all-zero tensor quantizes to zeros instead of 0/0 (a NaN/Inf amax is the loss guard's to catch)."""
    amax = jnp.asarray(amax, jnp.float32)
    usable = (amax > 0) & jnp.isfinite(amax)
    return jnp.where(usable, amax / largest(fmt), 1.0)


def amax_of(x: Array, axes: tuple[str, ...] = ()) -> Array:
    """max |x| in float32 (a max-all-reduce when jit shards x); under shard_map, of the whole tensor whose shard
    x is: a max over the mesh `axes` that split it."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jax.lax.pmax(amax, axes) if axes else amax


def current_scale(x: Array, fmt: jnp.dtype, axes: tuple[str, ...] = ()) -> Array:
    """Current scaling: the scale of this tensor's own amax (`amax_of`)."""
    return scale_from_amax(amax_of(x, axes), fmt)


def quantize(x: Array, fmt: jnp.dtype, scale: Array) -> Array:
    """x / scale, clipped to the format's range (fp8 casts do not saturate) and rounded to `fmt`.

    Computed as x times the scale's reciprocal: XLA rewrites a division by a broadcast scale into that product in
    some programs (a pipeline stage's, whose scale is per stage) and not in others, and the two can round a value
    to different fp8 neighbours, so the same tensor would quantize differently from one layout to the next."""
    bound = largest(fmt)
    return jnp.clip(x.astype(jnp.float32) * (1.0 / scale), -bound, bound).astype(fmt)


def dequantize(q: Array, scale: Array, dtype: jnp.dtype) -> Array:
    """q x scale in `dtype`: the value an fp8 tensor stands for (the matmuls never form it: they scale outputs)."""
    return q.astype(dtype) * scale.astype(dtype)


# ---------------------------------------------------------------- scales: current, delayed, per expert

class Quantized(NamedTuple):
    """A tensor in fp8: values = tensor / scale (clipped, rounded), with the amax the tensor held."""

    values: Array  # float8
    scale: Array   # float32: () per tensor, [experts] per expert
    amax: Array    # float32, the scale's shape: what the tensor's amax history records next


def group_amax(t: Array, experts: Array | None, num_experts: int, axes: tuple[str, ...] = ()) -> Array:
    """[num_experts] float32 amaxes of t's expert groups (0 for an empty group), a max over the mesh `axes`.
    `experts`: each row's expert ([rows]; past the last expert: padding, in no group) or None (t's leading dim)."""
    if experts is None:
        amax = jnp.max(jnp.abs(t), axis=tuple(range(1, t.ndim)))
    else:
        rows = jnp.max(jnp.abs(t), axis=-1).astype(jnp.float32)
        amax = jnp.maximum(jax.ops.segment_max(rows, experts, num_segments=num_experts), 0.0)
    amax = amax.astype(jnp.float32)
    return jax.lax.pmax(amax, axes) if axes else amax


def spread(scale: Array, experts: Array | None, ndim: int) -> Array:
    """A scale onto a tensor of rank `ndim`: a per-tensor scale as it is; per-expert scales [experts] onto its
    rows' `experts` ([rows]; padding rows past the last expert take the last one's) or, None, its leading dim."""
    if scale.ndim == 0:
        return scale
    if experts is not None:
        scale = scale[jnp.minimum(experts, scale.shape[0] - 1)]
    return scale.reshape(-1, *([1] * (ndim - 1)))


def _scale_and_amax(t: Array, fmt: jnp.dtype, history: Array | None, experts: Array | None,
                    axes: tuple[str, ...]) -> tuple[Array, Array]:
    """(scale, t's amax): the scale of the largest amax in `history` (current scaling where there is none, or
    where it is still empty: the first step); a history row [experts, length] scales each expert group."""
    per_expert = history is not None and history.ndim == 2
    amax = group_amax(t, experts, history.shape[0], axes) if per_expert else amax_of(t, axes)
    past = amax if history is None else jnp.max(history, axis=-1)
    return scale_from_amax(jnp.where(past > 0, past, amax), fmt), amax


def quantize_scaled(t: Array, fmt: jnp.dtype, history: Array | None = None, experts: Array | None = None,
                    axes: tuple[str, ...] = ()) -> Quantized:
    """t in `fmt` with its current scale (history None) or the delayed one of its amax `history` row: [length]
    per tensor, [experts, length] per expert group (`experts`: `group_amax`'s). A tensor larger than its history
    saturates at the format's largest value until the history catches up. Amaxes are maxima over the mesh `axes`."""
    scale, amax = _scale_and_amax(t, fmt, history, experts, axes)
    return Quantized(quantize(t, fmt, spread(scale, experts, t.ndim)), scale, amax)


def quantize_current(x: Array, fmt: jnp.dtype) -> tuple[Array, Array]:
    """(fp8 tensor, its float32 scale) with the tensor's current scale."""
    q = quantize_scaled(x, fmt)
    return q.values, q.scale


def delayed_scale(x: Array, history: Array, fmt: jnp.dtype) -> tuple[Array, Array]:
    """(scale, x's amax) of delayed scaling with the history row [length] (`quantize_scaled`)."""
    return _scale_and_amax(x, fmt, history, None, ())


def quantize_delayed(x: Array, history: Array, fmt: jnp.dtype) -> tuple[Array, Array, Array]:
    """(fp8 tensor, its scale, x's amax to record) with the delayed scale of `history` (one row)."""
    q = quantize_scaled(x, fmt, history)
    return q.values, q.scale, q.amax


# ---------------------------------------------------------------- delayed scaling (fp8_scaling=delayed)
#
# A matmul's amax history is one float32 array [len(OPERANDS), history_length] (stacked layers: [units, ...,
# OPERANDS, length]; the MoE experts': [experts, OPERANDS, length], logical axis `exp` first, so expert parallelism
# splits it as it splits the weights: an expert's tokens and weights have their own range, which one scale for all
# experts would spend on the largest), newest amax first, kept in the train state's FP8_META collection beside the
# parameters. The matmul reads its scales from it and reports what it observed as the history's cotangent (column
# 0, the rest zeros): the backward pass is the only place the gradient's amax exists, and a cotangent is how a value
# leaves it. The train step then pushes the observed amaxes into the history (`push_amax`), never the optimizer.

FP8_META = "fp8_meta"             # the variable collection of the amax histories
OPERANDS = ("x", "w", "g")        # the history's rows: the input, the weight, the incoming gradient
FORMATS = (E4M3, E4M3, E5M2)      # the format each row's tensor is quantized to


def report(history: Array, amaxes: Sequence[Array]) -> Array:
    """The history's cotangent: the observed amax of each operand ([experts] each for a per-expert history) in
    column 0, zeros elsewhere (`observed`)."""
    return jnp.zeros_like(history).at[..., 0].set(jnp.stack(amaxes, axis=-1))


def observed(cotangent: Array) -> Array:
    """The amaxes a step observed, from its histories' cotangent: [..., OPERANDS]."""
    return cotangent[..., 0]


def push_amax(history: Array, amax: Array) -> Array:
    """The history after one step: `amax` [..., OPERANDS] in front, the oldest entry dropped."""
    return jnp.concatenate([amax[..., None].astype(history.dtype), history[..., :-1]], axis=-1)


def update_histories(meta: Any, cotangents: Any) -> Any:
    """Every matmul's history after the step whose histories' cotangents (what the matmuls observed) are given."""
    return jax.tree.map(lambda h, c: push_amax(h, observed(c)), meta, cotangents)


def combine_observed(a: Any, b: Any) -> Any:
    """Two microbatches' observations of the same step: amaxes combine by max (a cotangent sum would add them)."""
    return jax.tree.map(jnp.maximum, a, b)


# ---------------------------------------------------------------- the fp8 matmul: three products on fp8 arrays

class Contraction(Protocol):
    """The three products of a matmul y = x.w on fp8 operands, each accumulating in float32 (a pytree: it may
    carry arrays, such as a grouped matmul's group sizes). maxpar.model.matmul.Einsum (the projections, the
    capacity experts) and maxpar.model.moe_dispatch.Grouped (the dropless experts) are the two."""

    def forward(self, x: Array, w: Array) -> Array:
        """y from x and w."""

    def input_gradient(self, g: Array, w: Array) -> Array:
        """dx from y's gradient g and w."""

    def weight_gradient(self, x: Array, g: Array) -> Array:
        """dw from x and y's gradient g."""


class _Saved(NamedTuple):
    """What the backward pass of `fp8_product` keeps: the fp8 operands (a quarter of float32 x and w) and scales."""

    contraction: Any
    x: Quantized
    w: Quantized
    history: Array | None
    experts: Array | None
    x_like: Array  # zero-size stand-ins carrying x's and w's dtypes: the gradients are returned in them
    w_like: Array


def _row(history: Array | None, operand: int) -> Array | None:
    return None if history is None else history[..., operand, :]


def _product_fwd(axes, contraction, x, w, history, experts):
    xq = quantize_scaled(x, E4M3, _row(history, 0), experts, axes)
    wq = quantize_scaled(w, E4M3, _row(history, 1), None, axes)
    y = contraction.forward(xq.values, wq.values)
    y = y * spread(xq.scale * wq.scale, experts, y.ndim)
    return y, _Saved(contraction, xq, wq, history, experts, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _product(axes, contraction, x, w, history, experts):
    return _product_fwd(axes, contraction, x, w, history, experts)[0]


def _product_bwd(axes, saved: _Saved, g):
    """Both gradients from the cotangent in e5m2 and the saved e4m3 operands; a history's cotangent reports the
    three amaxes this matmul observed (`report`), for the train step to push into the history."""
    gq = quantize_scaled(g, E5M2, _row(saved.history, 2), saved.experts, axes)
    dx = saved.contraction.input_gradient(gq.values, saved.w.values)
    dx = dx * spread(gq.scale * saved.w.scale, saved.experts, dx.ndim)
    dw = saved.contraction.weight_gradient(saved.x.values, gq.values)
    dw = dw * spread(saved.x.scale * gq.scale, None, dw.ndim)
    seen = None if saved.history is None else report(saved.history, (saved.x.amax, saved.w.amax, gq.amax))
    return None, dx.astype(saved.x_like.dtype), dw.astype(saved.w_like.dtype), seen, None


_product.defvjp(_product_fwd, _product_bwd)


def fp8_product(contraction: Contraction, x: Array, w: Array, axes: tuple[str, ...] = (),
                history: Array | None = None, experts: Array | None = None) -> Array:
    """x.w (float32) as `contraction`'s products on fp8 operands: x and w in e4m3, y's gradient in e5m2, each
    product scaled by its operands' scales. Current scales (history None), or the delayed ones of `history`
    [OPERANDS, length] (per tensor) or [experts, OPERANDS, length] (per expert: x's rows' `experts`, or None: x's
    leading dim; w's leading dim is the expert), whose cotangent reports what was observed. Amaxes are maxima over
    the mesh `axes` (under shard_map). The gradients come back in x's and w's dtypes."""
    return _product(tuple(axes), contraction, x, w, history, experts)
