"""quantization=fp8 reaches the dots: every quantized matmul of a train step is three dot_generals on float8 arrays
(forward e4m3 x e4m3, input gradient e5m2 x e4m3, weight gradient e4m3 x e5m2), read from the lowered program
(StableHLO, nothing compiled), and none on anything else (attention, router, logits stay in dtype)."""

from __future__ import annotations

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config
from maxpar.model.matmul import Einsum, matmul

E4M3, E5M2 = "f8E4M3FN", "f8E5M2"
# One dot's operand types: `stablehlo.dot_general %a, %b, ... : (tensor<2x3xf8E4M3FN>, tensor<...>) -> ...`
DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<(?:[0-9]+x)*(\w+)>, tensor<(?:[0-9]+x)*(\w+)>\)")


def dot_operand_types(text: str) -> Counter:
    """(lhs, rhs) element types of every dot_general in a lowered program's text, counted."""
    return Counter(DOT.search(line).groups() for line in text.splitlines() if DOT.search(line))


def fp8_dots(text: str) -> Counter:
    """The dots with an fp8 operand, by (lhs, rhs) type."""
    return Counter({types: n for types, n in dot_operand_types(text).items() if any("f8" in t for t in types)})


# Per quantized matmul: y = e4m3 x e4m3, dx = e5m2 (dy) x e4m3 (w), dw = e4m3 (x) x e5m2 (dy).
PER_MATMUL = Counter({(E4M3, E4M3): 1, (E5M2, E4M3): 1, (E4M3, E5M2): 1})


@pytest.mark.parametrize("spec, x_shape, w_shape", [
    ("ble,ehd->blhd", (2, 8, 32), (32, 4, 16)),    # q/k/v: one contracting dim, heads and head_dim merged as cols
    ("blhd,hde->ble", (2, 8, 4, 16), (4, 16, 32)),  # attention output: heads and head_dim contracted together
    ("ble,em->blm", (2, 8, 32), (32, 64)),
])
def test_a_quantized_matmul_is_three_2d_dots_on_fp8_operands(spec, x_shape, w_shape):
    """value_and_grad of one fp8 matmul: exactly three dots, all on fp8 operands with float32 results, and each a
    plain matrix product (2-D operands: one contracting and one free dim, what a cuBLASLt fp8 GEMM takes)."""
    x, w = jnp.ones(x_shape, jnp.bfloat16), jnp.ones(w_shape, jnp.float32)

    def loss(x, w):
        return jnp.sum(matmul(spec, x, w, jnp.bfloat16, quantization="fp8").astype(jnp.float32) ** 2)

    text = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(x, w).as_text()
    assert dot_operand_types(text) == PER_MATMUL
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert all(re.search(r"\(tensor<\d+x\d+xf8\w+>, tensor<\d+x\d+xf8\w+>\) -> tensor<\d+x\d+xf32>", d) for d in dots)


def test_the_einsum_layout_matches_einsum_forward_and_backward():
    """Einsum's transposes and merges give einsum's values for every product, rows merged or kept apart, with a
    batch dim and with a contraction whose dims are not in the weight's order."""
    def products(spec, x, w, g):
        return {merge: (Einsum(spec, merge).forward(x, w), Einsum(spec, merge).input_gradient(g, w),
                        Einsum(spec, merge).weight_gradient(x, g)) for merge in (True, False)}

    rng = np.random.default_rng(0)
    for spec, xs, ws in (("blhd,hde->ble", (2, 3, 4, 5), (4, 5, 6)), ("xte,xem->xtm", (3, 4, 5), (3, 5, 6)),
                         ("bldh,hde->ble", (2, 3, 5, 4), (4, 5, 6))):
        lhs, rhs, out = spec.replace("->", ",").split(",")
        x, w = rng.standard_normal(xs, np.float32), rng.standard_normal(ws, np.float32)
        g = rng.standard_normal(np.einsum(spec, x, w).shape, np.float32)
        want = (np.einsum(spec, x, w), np.einsum(f"{out},{rhs}->{lhs}", g, w), np.einsum(f"{lhs},{out}->{rhs}", x, g))
        for merge_rows, got in jax.jit(products, static_argnums=0)(spec, x, w, g).items():
            for a, b in zip(got, want):
                assert a.dtype == jnp.float32
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{spec} merge_rows={merge_rows}")


def lowered_train_step(*overrides: str) -> str:
    """The StableHLO text of the trainer's step for a tiny model on one device."""
    from maxpar.core.config import model_config
    from maxpar.core.mesh import build_mesh, local_mesh_shape
    from maxpar.model import Transformer
    from maxpar.training.optimizer import make_optimizer
    from maxpar.training.train_step import lower_train_step, run_layout

    config = tiny_config("quantization=fp8", "scan_layers=false", "remat_policy=none", *overrides)
    devices = jax.devices()[:1]
    layout = run_layout(config, local_mesh_shape(config, devices), check_batch=False)
    model = Transformer(model_config(config), layout.model)
    return lower_train_step(model, make_optimizer(config), layout, build_mesh(layout.mesh, devices)).as_text()


MODELS = {  # name: (overrides, quantized matmuls per layer)
    "dense_current": ((), 7),                                              # q, k, v, out; gate, up, down
    "dense_delayed": (("fp8_scaling=delayed",), 7),
    "moe_dropless_delayed": (("num_experts=4", "num_experts_per_tok=2", "fp8_scaling=delayed"), 4 + 3),
    "moe_capacity_current": (("num_experts=4", "num_experts_per_tok=2", "capacity_factor=2"), 4 + 3),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_train_step_has_three_fp8_dots_per_quantized_matmul(name):
    """Two unrolled layers, no remat (each matmul's forward once): 3 fp8 dots per quantized matmul, by operand
    types, and the rest of the step's dots (attention, the MoE router, logits) on no fp8 operand."""
    overrides, per_layer = MODELS[name]
    text = lowered_train_step(*overrides)
    matmuls = 2 * per_layer
    assert fp8_dots(text) == Counter({types: n * matmuls for types, n in PER_MATMUL.items()})
    assert sum(dot_operand_types(text).values()) > 3 * matmuls  # and others, not in fp8


def test_a_sequence_split_over_the_mesh_keeps_the_rows_apart():
    """Under context parallelism the fp8 projections keep [batch, length] as two dims (merging them would gather
    the sequence); without it they merge them into one GEMM dim."""
    from helpers import layout_on

    plain, _ = layout_on(tiny_config("quantization=fp8"), jax.devices()[:2])
    context, _ = layout_on(tiny_config("quantization=fp8", "ici_context_parallelism=2", "attention=blockwise"),
                           jax.devices()[:2])
    assert not plain.model.splits_sequence and context.model.splits_sequence
