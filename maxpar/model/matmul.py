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

`quantization="fp8"` (config `quantization`) swaps in the fp8 matmul (maxpar.model.fp8.fp8_product): both
operands quantized to e4m3 with per-tensor current scales, the backward's cotangent to e5m2 with its own, and each
of the three products a dot on the fp8 arrays themselves (float32 accumulation, the two scales applied to its
output), which the GPU compiler turns into cuBLASLt fp8 GEMMs. `Einsum` lays a spec's operands out as such a GEMM
takes them: one contracting and one free dimension each (the batch dimensions aside), e.g. the attention output
projection's heads and head_dim merged into one. With an amax `history` (fp8_scaling=delayed) the scales come
from it instead, and the history's cotangent reports the amaxes the matmul observed.

`project` is the same for a weight projection (q, k, v, attention output, the MLP's gate/up/down, the MoE
router), whose output it names `PROJECTION` for `remat_policy=minimal` to save.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

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


# ---------------------------------------------------------------- fp8: an einsum as fp8 GEMMs

def _matrix(t: Array, labels: str, groups: tuple[str, ...]) -> Array:
    """t, whose dims are `labels`, transposed to the order of `groups` and each group's dims merged into one."""
    size = dict(zip(labels, t.shape))
    t = jax.lax.transpose(t, tuple(labels.index(i) for group in groups for i in group))
    return t.reshape([math.prod(size[i] for i in group) for group in groups])


def _unmatrix(m: Array, size: dict[str, int], groups: tuple[str, ...], labels: str) -> Array:
    """The inverse of `_matrix`: m, one dim per group, split into the groups' dims and transposed to `labels`."""
    order = "".join(groups)
    return jax.lax.transpose(m.reshape([size[i] for i in order]), tuple(order.index(i) for i in labels))


def _dot(a: Array, b: Array, contract: tuple[int, int], batch: int) -> Array:
    """dot_general contracting dim contract[0] of a with contract[1] of b, the first `batch` dims batched, float32
    accumulation and output."""
    dims = tuple(range(batch))
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), (dims, dims)),
                               preferred_element_type=jnp.float32)


class _GemmDims(NamedTuple):
    """An einsum's labels grouped as a GEMM takes them: each batch dim alone, then one group of rows (or one per
    row dim: `Einsum.merge_rows`), of contracted (inner) dims and of the weight's free dims (cols)."""

    lhs: str
    rhs: str
    out: str
    batch: tuple[str, ...]
    rows: tuple[str, ...]
    inner: str
    cols: str

    @property
    def x(self) -> tuple[str, ...]:
        return (*self.batch, *self.rows, self.inner)

    @property
    def w(self) -> tuple[str, ...]:
        return (*self.batch, self.inner, self.cols)

    @property
    def y(self) -> tuple[str, ...]:
        return (*self.batch, *self.rows, self.cols)


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=["spec", "merge_rows"])
@dataclasses.dataclass(frozen=True)
class Einsum:
    """The products of einsum(spec, x, w) as dot_generals of at most one contracting and one free dim per operand
    besides the batch dims (what a cuBLASLt fp8 GEMM takes: maxpar.model.fp8.Contraction): x [batch, rows, inner],
    w [batch, inner, cols], y [batch, rows, cols], each group of dims merged into one ('blhd,hde->ble': rows = b l,
    inner = h d, cols = e). merge_rows=False keeps x's row dims apart (the dot then has several free dims):
    merging a sequence split over the mesh with the batch rows would gather the sequence first (context
    parallelism; `ModelLayout.splits_sequence`)."""

    spec: str
    merge_rows: bool = True

    def _dims(self) -> _GemmDims:
        lhs, rhs, out = _operands(self.spec)
        rows = "".join(i for i in lhs if i not in rhs)
        return _GemmDims(lhs, rhs, out, batch=tuple(i for i in lhs if i in rhs and i in out),
                         rows=(rows,) if self.merge_rows else tuple(rows),
                         inner="".join(i for i in lhs if i in rhs and i not in out),
                         cols="".join(i for i in rhs if i not in lhs))

    def forward(self, x: Array, w: Array) -> Array:
        d = self._dims()
        size = {**dict(zip(d.lhs, x.shape)), **dict(zip(d.rhs, w.shape))}
        y = _dot(_matrix(x, d.lhs, d.x), _matrix(w, d.rhs, d.w), (len(d.x) - 1, len(d.batch)), len(d.batch))
        return _unmatrix(y, size, d.y, d.out)

    def input_gradient(self, g: Array, w: Array) -> Array:
        d = self._dims()
        size = {**dict(zip(d.out, g.shape)), **dict(zip(d.rhs, w.shape))}
        dx = _dot(_matrix(g, d.out, d.y), _matrix(w, d.rhs, d.w), (len(d.y) - 1, len(d.w) - 1), len(d.batch))
        return _unmatrix(dx, size, d.x, d.lhs)

    def weight_gradient(self, x: Array, g: Array) -> Array:
        d = self._dims()
        size = {**dict(zip(d.lhs, x.shape)), **dict(zip(d.out, g.shape))}
        batch, rows = tuple(range(len(d.batch))), tuple(range(len(d.batch), len(d.batch) + len(d.rows)))
        dw = jax.lax.dot_general(_matrix(x, d.lhs, d.x), _matrix(g, d.out, d.y), ((rows, rows), (batch, batch)),
                                 preferred_element_type=jnp.float32)
        return _unmatrix(dw, size, d.w, d.rhs)


def matmul(spec: str, x: Array, w: Array, dtype: jnp.dtype, out_dtype: jnp.dtype | None = None,
           quantization: str = "", history: Array | None = None, merge_rows: bool = True) -> Array:
    """einsum(spec, x, w) with `dtype` operands and float32 accumulation, in `out_dtype` (default `dtype`);
    `quantization="fp8"`: the operands in fp8 with per-tensor scales (maxpar.model.fp8) instead, current ones,
    or delayed ones from `history` (fp8_scaling=delayed; None: current); `merge_rows`: see `Einsum`."""
    _operands(spec)
    dtype, out_dtype = jnp.dtype(dtype), jnp.dtype(out_dtype or dtype)
    if quantization == "fp8":
        return fp8.fp8_product(Einsum(spec, merge_rows), x.astype(dtype), w, history=history).astype(out_dtype)
    if quantization:
        raise ValueError(f"quantization {quantization!r}: expected '' or 'fp8'")
    if history is not None:
        raise ValueError(f"an amax history needs quantization='fp8', got {quantization!r}")
    return _matmul(spec, dtype, out_dtype, x.astype(dtype), w)


def project(spec: str, x: Array, w: Array, dtype: jnp.dtype, out_dtype: jnp.dtype | None = None,
            quantization: str = "", history: Array | None = None, merge_rows: bool = True) -> Array:
    """A weight projection: `matmul`, its output named for remat_policy=minimal to save."""
    return checkpoint_name(matmul(spec, x, w, dtype, out_dtype, quantization, history, merge_rows), PROJECTION)
