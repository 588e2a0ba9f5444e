"""Per-tensor fp8 quantization for `quantization=fp8` matmuls (maxpar.model.matmul).

Forward operands go to float8_e4m3fn (3 mantissa bits, range +-448) and gradients to float8_e5m2 (2 mantissa
bits, range +-57344: gradients span more decades than they need digits). A tensor's scale maps its absolute
maximum (amax) onto the format's largest finite value, so the whole tensor uses the format's range; `quantize`
divides by the scale, clips and casts, `dequantize` casts back and multiplies by it.

The dequantize is written as XLA's GPU GEMM rewriter expects it: a convert from fp8 to the compute dtype
followed by a multiply with a broadcast scalar, feeding the dot. On Hopper the rewriter folds that pattern
into a cuBLASLt fp8 GEMM that takes the fp8 operands and the two scales (float32 accumulation); elsewhere
(XLA:CPU) the same program runs the dot on the dequantized values, which are exactly the fp8 values times
the scale, so the numerics are the fp8 GEMM's up to the accumulation order.
"""

from __future__ import annotations

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


def current_scale(x: Array, fmt: jnp.dtype) -> Array:
    """Current scaling: the scale of this tensor's own amax (one reduction; a max-all-reduce when sharded)."""
    return scale_from_amax(jnp.max(jnp.abs(x)), fmt)


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
