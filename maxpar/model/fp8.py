"""Per-tensor fp8 quantization for `quantization=fp8` matmuls (maxpar.model.matmul).

Forward operands go to float8_e4m3fn (3 mantissa bits, range +-448) and gradients to float8_e5m2 (2 mantissa
bits, range +-57344: gradients span more decades than they need digits). A tensor's scale maps its absolute
maximum (amax) onto the format's largest finite value, so the whole tensor uses the format's range; `quantize`
divides by the scale, clips and casts, `dequantize` casts back and multiplies by it. The amax is the tensor's own
(current scaling) or the largest of its recent ones, kept in an amax history (delayed scaling, below; the MoE
experts keep one per expert).

The dequantize is written as XLA's GPU GEMM rewriter expects it: a convert from fp8 to the compute dtype
followed by a multiply with a broadcast scalar, feeding the dot. On Hopper the rewriter folds that pattern
into a cuBLASLt fp8 GEMM that takes the fp8 operands and the two scales (float32 accumulation); elsewhere
(XLA:CPU) the same program runs the dot on the dequantized values, which are exactly the fp8 values times
the scale, so the numerics are the fp8 GEMM's up to the accumulation order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

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
    """x / scale, clipped to the format's range (fp8 casts do not saturate) and rounded to `fmt`."""
    bound = largest(fmt)
    return jnp.clip(x.astype(jnp.float32) / scale, -bound, bound).astype(fmt)


def dequantize(q: Array, scale: Array, dtype: jnp.dtype) -> Array:
    """q x scale in `dtype`: the convert-then-multiply that the GPU GEMM rewriter folds into an fp8 GEMM."""
    return q.astype(dtype) * scale.astype(dtype)


def quantize_current(x: Array, fmt: jnp.dtype) -> tuple[Array, Array]:
    """(fp8 tensor, its float32 scale) with the tensor's current scale."""
    scale = current_scale(x, fmt)
    return quantize(x, fmt, scale), scale


# ---------------------------------------------------------------- fp8 round trips (the MoE experts' matmuls)
#
# The experts' grouped and batched matmuls (maxpar.model.moe_dispatch) run on one device's shard under shard_map,
# through jax's own gradients of ragged_dot and einsum: there fp8 is a round trip of each operand to e4m3 (the
# gradient passes straight through it) and of the output's incoming gradient to e5m2, which gives the products of
# the fp8 matmul above. `axes` are the mesh axes the shard_map splits the tensors over: the amax is a max over them.

def round_trip(x: Array, fmt: jnp.dtype, axes: tuple[str, ...]) -> Array:
    """x rounded to `fmt` with its current scale (of the whole tensor: `amax_of`), back in x's dtype."""
    scale = current_scale(x, fmt, axes)
    return dequantize(quantize(x, fmt, scale), scale, x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def as_e4m3(x: Array, axes: tuple[str, ...]) -> Array:
    """A matmul operand in e4m3; its gradient passes straight through (the matmul's own is then the fp8 one)."""
    return round_trip(x, E4M3, axes)


as_e4m3.defvjp(lambda x, axes: (round_trip(x, E4M3, axes), None), lambda axes, _, g: (g,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def e5m2_gradient(y: Array, axes: tuple[str, ...]) -> Array:
    """y unchanged; its incoming gradient rounded to e5m2, as both gradient matmuls take it."""
    return y


e5m2_gradient.defvjp(lambda y, axes: (y, None), lambda axes, _, g: (round_trip(g, E5M2, axes),))


def fp8_product(dot: Callable[[Array, Array], Array], x: Array, w: Array, axes: tuple[str, ...]) -> Array:
    """dot(x, w) with both operands in e4m3 and the gradient of its output in e5m2 (current global scales)."""
    return e5m2_gradient(dot(as_e4m3(x, axes), as_e4m3(w, axes)), axes)


# ---------------------------------------------------------------- delayed scaling (fp8_scaling=delayed)
#
# A matmul's amax history is one float32 array [len(OPERANDS), history_length] (stacked layers: [units, ...,
# OPERANDS, length]), newest amax first, kept in the train state's FP8_META collection beside the parameters.
# The matmul reads its scales from it and reports what it observed as the history's cotangent (column 0, the
# rest zeros): the backward pass is the only place the gradient's amax exists, and a cotangent is how a value
# leaves it. The train step then pushes the observed amaxes into the history (`push_amax`), never the optimizer.

FP8_META = "fp8_meta"             # the variable collection of the amax histories
OPERANDS = ("x", "w", "g")        # the history's rows: the input, the weight, the incoming gradient
FORMATS = (E4M3, E4M3, E5M2)      # the format each row's tensor is quantized to


def delayed_scale(x: Array, history: Array, fmt: jnp.dtype) -> tuple[Array, Array]:
    """(scale, x's amax): the scale of the largest amax in `history` (one row), so it is known before x is;
    x's own amax where the history is still empty (all zeros: the first step), which is current scaling.
    A tensor larger than its history saturates at the format's largest value until the history catches up."""
    amax = amax_of(x)
    past = jnp.max(history)
    return scale_from_amax(jnp.where(past > 0, past, amax), fmt), amax


def quantize_delayed(x: Array, history: Array, fmt: jnp.dtype) -> tuple[Array, Array, Array]:
    """(fp8 tensor, its scale, x's amax to record) with the delayed scale of `history` (one row)."""
    scale, amax = delayed_scale(x, history, fmt)
    return quantize(x, fmt, scale), scale, amax


def report(history: Array, amaxes: Sequence[Array]) -> Array:
    """The history's cotangent: the observed amax of each operand in column 0, zeros elsewhere (`observed`)."""
    return jnp.zeros_like(history).at[:, 0].set(jnp.stack(amaxes))


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


# ---------------------------------------------------------------- per-expert delayed scaling (the MoE experts)
#
# Under fp8_scaling=delayed an expert matmul keeps one history per expert, [experts, OPERANDS, length] (logical
# axis `exp` first, so expert parallelism splits it as it splits the weights): an expert's tokens and weights have
# their own range, which one scale for all experts would spend on the largest. The round trips take one row of it,
# [experts, length], and the tensor's expert groups: `experts` gives each row's expert ([rows]: the grouped
# matmul's sorted copies; past the last expert: padding, scaled by the last one's history) or is None (the leading
# dim is the expert: the weights and the capacity buffers). Each group reports its own amax through the row's
# cotangent, a max over `axes`: the mesh axes that split a group's tokens or its weight (never the experts').

def group_amax(t: Array, experts: Array | None, num_experts: int, axes: tuple[str, ...] = ()) -> Array:
    """[num_experts] float32 amaxes of t's expert groups (0 for an empty group), a max over the mesh `axes`."""
    if experts is None:
        amax = jnp.max(jnp.abs(t), axis=tuple(range(1, t.ndim)))
    else:
        rows = jnp.max(jnp.abs(t), axis=-1).astype(jnp.float32)
        amax = jnp.maximum(jax.ops.segment_max(rows, experts, num_segments=num_experts), 0.0)
    amax = amax.astype(jnp.float32)
    return jax.lax.pmax(amax, axes) if axes else amax


def _group_round_trip(t: Array, history: Array, experts: Array | None, fmt: jnp.dtype,
                      axes: tuple[str, ...]) -> tuple[Array, Array]:
    """(t rounded to `fmt` with each group's delayed scale, back in t's dtype; the groups' amaxes)."""
    amax = group_amax(t, experts, history.shape[0], axes)
    past = jnp.max(history, axis=-1)
    scale = scale_from_amax(jnp.where(past > 0, past, amax), fmt)
    if experts is None:
        scale = scale.reshape(-1, *([1] * (t.ndim - 1)))
    else:
        scale = scale[jnp.minimum(experts, history.shape[0] - 1)][:, None]
    return dequantize(quantize(t, fmt, scale), scale, t.dtype), amax


def _row_report(history: Array, amax: Array) -> Array:
    """One row's cotangent: each expert's observed amax in column 0, zeros elsewhere (as `report`)."""
    return jnp.zeros_like(history).at[:, 0].set(amax)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def as_e4m3_per_expert(x: Array, history: Array, experts: Array | None, axes: tuple[str, ...]) -> Array:
    """x in e4m3, each expert group with the delayed scale of its `history` row; the gradient passes straight
    through and the history's cotangent reports the groups' amaxes."""
    return _group_round_trip(x, history, experts, E4M3, axes)[0]


def _as_e4m3_per_expert_fwd(x, history, experts, axes):
    y, amax = _group_round_trip(x, history, experts, E4M3, axes)
    return y, (history, amax)


as_e4m3_per_expert.defvjp(_as_e4m3_per_expert_fwd,
                          lambda axes, res, g: (g, _row_report(res[0], res[1]), None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def e5m2_gradient_per_expert(y: Array, history: Array, experts: Array | None, axes: tuple[str, ...]) -> Array:
    """y unchanged; its incoming gradient rounded to e5m2 per expert group with the delayed scales of `history`,
    whose cotangent reports the gradient groups' amaxes."""
    return y


def _e5m2_gradient_per_expert_bwd(axes, res, g):
    history, experts = res
    rounded, amax = _group_round_trip(g, history, experts, E5M2, axes)
    return rounded, _row_report(history, amax), None


e5m2_gradient_per_expert.defvjp(lambda y, history, experts, axes: (y, (history, experts)),
                                _e5m2_gradient_per_expert_bwd)


def fp8_expert_product(dot: Callable[[Array, Array], Array], x: Array, w: Array, history: Array,
                       experts: Array | None, axes: tuple[str, ...]) -> Array:
    """dot(x, w) of expert-grouped x (rows' `experts`, or None: x's leading dim) and w [experts, ...], with the
    per-expert delayed scales of `history` [experts, OPERANDS, length]; its cotangent reports what was observed."""
    xq = as_e4m3_per_expert(x, history[:, 0], experts, axes)
    wq = as_e4m3_per_expert(w, history[:, 1], None, axes)
    return e5m2_gradient_per_expert(dot(xq, wq), history[:, 2], experts, axes)
