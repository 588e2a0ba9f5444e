"""maxpar.model.matmul: operands in the compute dtype, float32 accumulation, forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxpar.model.matmul import matmul

SPEC = "ble,ehd->blhd"


def operands(seed: int = 0):
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (2, 5, 16), jnp.float32)
    w = jax.random.normal(kw, (16, 3, 4), jnp.float32) / 4
    g = jax.random.normal(kg, (2, 5, 3, 4), jnp.float32)
    return x, w, g


def test_float32_is_the_plain_einsum_and_its_gradient():
    x, w, g = operands()
    expected, pullback = jax.vjp(lambda x, w: jnp.einsum(SPEC, x, w), x, w)
    got, our_pullback = jax.vjp(lambda x, w: matmul(SPEC, x, w, jnp.float32), x, w)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(our_pullback(g), pullback(g)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_bfloat16_rounds_operands_and_results_once_and_keeps_the_weight_gradient_in_float32():
    x, w, g = operands(1)
    bf = jnp.bfloat16
    as_bf16 = lambda a: a.astype(bf).astype(jnp.float32)  # noqa: E731
    y, pullback = jax.vjp(lambda x, w: matmul(SPEC, x, w, bf), x.astype(bf), w)
    assert y.dtype == bf
    close = lambda a, b: np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=2**-7, atol=1e-6)  # noqa: E731
    close(y, jnp.einsum(SPEC, as_bf16(x), as_bf16(w)).astype(bf))
    dx, dw = pullback(g.astype(bf))
    assert dx.dtype == bf and dw.dtype == jnp.float32  # the weight gradient never passes through bfloat16
    close(dx, jnp.einsum("blhd,ehd->ble", as_bf16(g), as_bf16(w)).astype(bf))
    np.testing.assert_allclose(dw, jnp.einsum("ble,blhd->ehd", as_bf16(x), as_bf16(g)), rtol=1e-5, atol=1e-5)
    assert not np.array_equal(dw, as_bf16(dw))


def test_float32_output_of_bfloat16_operands_takes_a_bfloat16_cotangent():
    """Logits: float32 out; the backward matmuls take the cotangent rounded to bfloat16, both operands alike."""
    x, w, g = operands(2)
    y, pullback = jax.vjp(lambda x, w: matmul(SPEC, x, w, jnp.bfloat16, jnp.float32), x, w)
    assert y.dtype == jnp.float32
    dx, dw = pullback(g)
    assert dx.dtype == dw.dtype == jnp.float32
    g16 = g.astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_allclose(dw, jnp.einsum("ble,blhd->ehd", x.astype(jnp.bfloat16).astype(jnp.float32), g16),
                               rtol=1e-5, atol=1e-5)


def test_a_spec_it_cannot_differentiate_is_refused():
    x, w, _ = operands()
    with pytest.raises(ValueError, match="two of its three terms"):
        matmul("ble,ehd->blh", x, w, jnp.float32)


# XLA:CPU runs a bfloat16 x bfloat16 -> float32 dot only inside its YNNPACK fusions (its plain dot thunk refuses
# that type combination at run time), so every layout's bfloat16 step is run, not just compiled. One device's:
# tests/test_fp8.py::test_fp8_trains_like_bfloat16 runs 40 bfloat16 steps there.
BF16_LAYOUTS = {
    "FSDP(8) unscanned": (8, ["scan_layers=false", "remat_policy=full"]),
    "DP(2)xFSDP(2)xTP(2) minimal": (8, ["ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                                         "ici_tensor_parallelism=2", "remat_policy=minimal"]),
    "TP-sequence(2)xFSDP(4)": (8, ["configs/tp_sequence.yml", "ici_tensor_parallelism=2"]),
    "TP-transpose(2)xFSDP(4)": (8, ["configs/tp_transpose.yml", "ici_tensor_parallelism=2"]),
    "CP(2) ring x FSDP(4)": (8, ["attention=blockwise", "ici_context_parallelism=2",
                                  "context_parallel_strategy=ring", "attention_block_size=8"]),
    "PP(2)xFSDP(4) tied": (8, ["ici_stage_parallelism=2", "num_pipeline_microbatches=2", "logits_via_embedding=true"]),
    "MoE EP(2)xFSDP(4)": (8, ["num_experts=4", "num_experts_per_tok=2", "ici_expert_parallelism=2"]),
}


@pytest.mark.parametrize("name", BF16_LAYOUTS)
def test_bfloat16_steps_run_on_every_layout(name):
    from helpers import micro_config
    from maxpar.train import global_batch, setup_run
    from maxpar.training.train_step import create_state

    devices, overrides = BF16_LAYOUTS[name]
    files = [o for o in overrides if o.endswith(".yml")]
    config = micro_config("dtype=bfloat16", "dataset_type=synthetic", "per_device_batch_size=2", "steps=2",
                         *[o for o in overrides if o not in files],
                         **({"config_file": files[0]} if files else {}))
    run = setup_run(config, jax.devices()[:devices])
    state = create_state(run.model, run.tx, run.layout, run.mesh)
    step = run.compile_train_step()
    batches = iter(run.train_data)
    losses = []
    for _ in range(2):
        state, metrics = step(state, global_batch(next(batches), run.in_sharding))
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[1] < losses[0] + 0.5, losses
