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

from helpers import micro_config
from maxpar.model.matmul import Einsum, matmul
from maxpar.tools.bench_gpu import dot_operand_types, f8_dots, fp8_gemms, unrewritten_f8_dots

E4M3, E5M2 = "f8E4M3FN", "f8E5M2"


def fp8_dots(text: str) -> Counter:
    """The dots of a lowered program with an fp8 operand, by (lhs, rhs) type."""
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


def lowered_train_step(*overrides: str, devices: int = 1) -> str:
    """The StableHLO text of the trainer's step for a tiny model on `devices` devices."""
    from maxpar.core.config import model_config
    from maxpar.core.mesh import build_mesh, local_mesh_shape
    from maxpar.model import Transformer
    from maxpar.training.optimizer import make_optimizer
    from maxpar.training.train_step import lower_train_step, run_layout

    config = micro_config("quantization=fp8", "scan_layers=false", "remat_policy=none", *overrides)
    devices = jax.devices()[:devices]
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


def fp8_dot_ranks(text: str) -> Counter:
    """The ranks of the fp8 dots' first operands in a lowered program."""
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    return Counter(len(re.search(r": \(tensor<([^>]*)>", d)[1].split("x")) - 1 for d in dots if "xf8" in d.split(":")[-1])


def test_a_sequence_split_over_the_mesh_keeps_the_rows_apart():
    """Under context parallelism the fp8 projections keep [batch, length] as two dims (merging them would gather
    the sequence: the forward's x and the gradients' dy are rank 3); without it every fp8 dot is a 2-D GEMM."""
    from helpers import layout_on

    context = ("ici_context_parallelism=2", "attention=blockwise", "ici_fsdp_parallelism=1")
    plain, _ = layout_on(micro_config("quantization=fp8"), jax.devices()[:2])
    split, _ = layout_on(micro_config("quantization=fp8", *context), jax.devices()[:2])
    assert not plain.model.splits_sequence and split.model.splits_sequence
    assert set(fp8_dot_ranks(lowered_train_step())) == {2}
    assert 3 in fp8_dot_ranks(lowered_train_step(*context, devices=2))


def test_the_gpu_benchmark_reads_fp8_gemms_and_leftover_fp8_dots_off_a_compiled_program():
    """The counts end_to_end/bench_gpu_fp8.py records: cuBLASLt fp8 GEMM calls, and dots (a fusion's too) that
    still take an fp8 operand after compilation, whose operand types the HLO text gives only where they are defined."""
    hlo = """
%fused_dot (p0: f8e4m3fn[16,32], p1: f8e5m2[32,8]) -> f32[16,8] {
  %p0.1 = f8e4m3fn[16,32]{1,0} parameter(0)
  %p1.2 = f8e5m2[32,8]{1,0} parameter(1)
  ROOT %dot.3 = f32[16,8]{1,0} dot(%p0.1, %p1.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
ENTRY %main {
  %a = f8e4m3fn[16,32]{1,0} parameter(0)
  %b = f8e4m3fn[32,8]{1,0} parameter(1)
  %x = f32[16,32]{1,0} convert(%a)
  %y = f32[32,8]{1,0} parameter(2)
  %plain = f32[16,8]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %gemm = (f32[16,8]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8"
}"""
    assert fp8_gemms(hlo) == 1 and unrewritten_f8_dots(hlo) == 1
    x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 16), jnp.float32)

    def loss(x, w):
        return jnp.sum(matmul("te,em->tm", x, w, jnp.bfloat16, quantization="fp8").astype(jnp.float32))

    lowered = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(x, w)
    assert f8_dots(lowered.as_text()) == 3
