"""Matmuls in the compute dtype that accumulate in float32, forward and backward.

`matmul(spec, x, w, dtype)` is `einsum(spec, x, w)` with both operands in `dtype` (bfloat16 in mixed
precision) and float32 accumulation, rounded once to the output dtype. Its custom gradient keeps that
contract in the backward pass: the incoming cotangent is rounded to `dtype` (what a TPU's matrix unit does
with a float32 operand at default precision), both gradient matmuls take `dtype` operands and accumulate in
float32, and the weight gradient comes out in the weight's own dtype without passing through `dtype`.

Why not plain `jnp.einsum`: autodiff of a float32-output einsum makes mixed float32 x bfloat16 matmuls in the
backward pass (XLA:CPU then runs them in float32, at half the speed), and a bfloat16-output einsum rounds each
weight gradient to bfloat16 before it is reduced. On XLA:CPU this made the one-device step much faster
(docs/performance.md, "Levers"); on accelerators the arithmetic is the same as theirs.
The logits use `matmul` (float32 out); the attention core has its own VJP (maxpar.model.attention).

`quantization="fp8"` (config `quantization`) swaps in the fp8 matmul: both operands quantized to e4m3 with
per-tensor current scales, the backward's cotangent to e5m2 with its own, each dot fed by a dequantize that the
GPU compiler folds into an fp8 GEMM (maxpar.model.fp8); accumulation and output dtypes as above. With an amax
`history` (fp8_scaling=delayed) the scales come from it instead, and the history's cotangent reports the amaxes
the matmul observed.

`project` is the same for a weight projection (q, k, v, attention output, the MLP's gate/up/down, the MoE
router), whose output it names `PROJECTION` for `remat_policy=minimal` to save.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxpar.model import fp8

Array = jax.Array
PROJECTION = "projection"  # the name remat_policy=minimal saves (maxpar.model.transformer.REMAT_POLICIES)


def _operands(spec: str) -> tuple[str, str, str]:
    """'ble,ehd->blhd' -> ('ble', 'ehd', 'blhd'): explicit two-operand specs only (no ellipsis)."""
    inputs, out = spec.split("->")
    lhs, rhs = inputs.split(",")
    if "." in spec or set(lhs) - set(rhs + out) or set(rhs) - set(lhs + out):
        raise ValueError(f"matmul spec {spec!r}: every index must appear in two of its three terms")
    return lhs, rhs, out


def _accumulate(spec: str, a: Array, b: Array) -> Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _matmul_fwd(spec, dtype, out_dtype, x, w):
    w_compute = w.astype(dtype)
    # Zero-size stand-in carrying w's dtype: the weight gradient is returned in it.
    return _accumulate(spec, x, w_compute).astype(out_dtype), (x, w_compute, jnp.zeros((0,), w.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _matmul(spec: str, dtype: jnp.dtype, out_dtype: jnp.dtype, x: Array, w: Array) -> Array:
    return _matmul_fwd(spec, dtype, out_dtype, x, w)[0]


def _weight_gradient(lhs: str, rhs: str, out: str, x: Array, g: Array) -> Array:
    """einsum(lhs,out->rhs) of x and g: a matmul contracting both operands' leading (token) dims.

    XLA:CPU makes a transposed copy of such a matmul's first operand, so the smaller of x and g goes first
    (the down projection's [tokens, mlp] input is 4x its [tokens, emb] gradient) and the result, the weight's
    size, is transposed. The barrier keeps the matmul's output in
    its natural layout: folding the transpose into it would take the matmul out of XLA:CPU's YNNPACK fusion,
    whose fallback has no bfloat16 x bfloat16 -> float32 kernel.
    """
    batched = set(lhs) & set(rhs) & set(out)
    if batched or x.size <= g.size:
        return _accumulate(f"{lhs},{out}->{rhs}", x, g)
    swapped = "".join(i for i in out if i in rhs) + "".join(i for i in lhs if i in rhs)
    return jnp.einsum(f"{swapped}->{rhs}", jax.lax.optimization_barrier(_accumulate(f"{out},{lhs}->{swapped}", g, x)))


def _gradients(spec: str, x: Array, w: Array, g: Array, w_dtype: jnp.dtype) -> tuple[Array, Array]:
    """(dx, dw) of einsum(spec, x, w) from operands and cotangent already in the compute dtype: dx in x's
    dtype, dw in `w_dtype` (float32 accumulation throughout)."""
    lhs, rhs, out = _operands(spec)
    dx = _accumulate(f"{out},{rhs}->{lhs}", g, w).astype(x.dtype)
    return dx, _weight_gradient(lhs, rhs, out, x, g).astype(w_dtype)


def _matmul_bwd(spec, dtype, out_dtype, residuals, g):
    x, w_compute, w_like = residuals
    return _gradients(spec, x, w_compute, g.astype(dtype), w_like.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _fp8_matmul_fwd(spec, dtype, out_dtype, x, w):
    (xq, x_scale), (wq, w_scale) = fp8.quantize_current(x, fp8.E4M3), fp8.quantize_current(w, fp8.E4M3)
    y = _accumulate(spec, fp8.dequantize(xq, x_scale, dtype), fp8.dequantize(wq, w_scale, dtype))
    # The residuals are the fp8 operands and their scales: a quarter of float32 x and w, half of bfloat16.
    return y.astype(out_dtype), (xq, x_scale, wq, w_scale, jnp.zeros((0,), w.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8_matmul(spec: str, dtype: jnp.dtype, out_dtype: jnp.dtype, x: Array, w: Array) -> Array:
    return _fp8_matmul_fwd(spec, dtype, out_dtype, x, w)[0]


def _fp8_matmul_bwd(spec, dtype, out_dtype, residuals, g):
    """Both gradient matmuls take the cotangent in e5m2 with its own current scale and the saved e4m3 operands."""
    xq, x_scale, wq, w_scale, w_like = residuals
    gq, g_scale = fp8.quantize_current(g, fp8.E5M2)
    return _gradients(spec, fp8.dequantize(xq, x_scale, dtype), fp8.dequantize(wq, w_scale, dtype),
                      fp8.dequantize(gq, g_scale, dtype), w_like.dtype)


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)
QUANTIZED = {"": _matmul, "fp8": _fp8_matmul}  # config key `quantization` -> the matmul it selects


def _fp8_delayed_fwd(spec, dtype, out_dtype, x, w, history):
    (xq, x_scale, x_amax), (wq, w_scale, w_amax) = (fp8.quantize_delayed(t, row, fp8.E4M3)
                                                    for t, row in ((x, history[0]), (w, history[1])))
    y = _accumulate(spec, fp8.dequantize(xq, x_scale, dtype), fp8.dequantize(wq, w_scale, dtype))
    return y.astype(out_dtype), (xq, x_scale, wq, w_scale, jnp.zeros((0,), w.dtype), history, x_amax, w_amax)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8_delayed_matmul(spec: str, dtype: jnp.dtype, out_dtype: jnp.dtype, x: Array, w: Array,
                        history: Array) -> Array:
    """The fp8 matmul with delayed scales read from `history` [OPERANDS, length] (maxpar.model.fp8)."""
    return _fp8_delayed_fwd(spec, dtype, out_dtype, x, w, history)[0]


def _fp8_delayed_bwd(spec, dtype, out_dtype, residuals, g):
    """As `_fp8_matmul_bwd`, the cotangent scaled by its history; the history's cotangent reports the three
    amaxes this matmul observed (fp8.report), for the train step to push into the history."""
    xq, x_scale, wq, w_scale, w_like, history, x_amax, w_amax = residuals
    gq, g_scale, g_amax = fp8.quantize_delayed(g, history[2], fp8.E5M2)
    dx, dw = _gradients(spec, fp8.dequantize(xq, x_scale, dtype), fp8.dequantize(wq, w_scale, dtype),
                        fp8.dequantize(gq, g_scale, dtype), w_like.dtype)
    return dx, dw, fp8.report(history, (x_amax, w_amax, g_amax))


_fp8_delayed_matmul.defvjp(_fp8_delayed_fwd, _fp8_delayed_bwd)


def matmul(spec: str, x: Array, w: Array, dtype: jnp.dtype, out_dtype: jnp.dtype | None = None,
           quantization: str = "", history: Array | None = None) -> Array:
    """einsum(spec, x, w) with `dtype` operands and float32 accumulation, in `out_dtype` (default `dtype`);
    `quantization="fp8"`: the operands in fp8 with per-tensor scales (maxpar.model.fp8) instead, current ones,
    or delayed ones from `history` (fp8_scaling=delayed; None: current)."""
    _operands(spec)
    dtype, out_dtype = jnp.dtype(dtype), jnp.dtype(out_dtype or dtype)
    if history is not None:
        if quantization != "fp8":
            raise ValueError(f"an amax history needs quantization='fp8', got {quantization!r}")
        return _fp8_delayed_matmul(spec, dtype, out_dtype, x.astype(dtype), w, history)
    return QUANTIZED[quantization](spec, dtype, out_dtype, x.astype(dtype), w)


def project(spec: str, x: Array, w: Array, dtype: jnp.dtype, out_dtype: jnp.dtype | None = None,
            quantization: str = "", history: Array | None = None) -> Array:
    """A weight projection: `matmul`, its output named for remat_policy=minimal to save."""
    return checkpoint_name(matmul(spec, x, w, dtype, out_dtype, quantization, history), PROJECTION)
