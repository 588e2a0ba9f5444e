"""quantization=fp8: per-tensor scaling, the fp8 matmul forward and backward, and training with it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config
from maxpar.core.config import ConfigError
from maxpar.model import fp8
from maxpar.model.matmul import matmul
from test_matmul import SPEC, operands  # the same operands as the bfloat16 matmul's tests

# (format, relative rounding bound of a normal value: half an ulp, smallest subnormal)
FORMATS = {"e4m3": (fp8.E4M3, 2.0**-4, 2.0**-9), "e5m2": (fp8.E5M2, 2.0**-3, 2.0**-16)}


def qdq(x, fmt):
    q, scale = fp8.quantize_current(x, fmt)
    return fp8.dequantize(q, scale, jnp.float32)


@pytest.mark.parametrize("name", FORMATS)
def test_quantize_dequantize_error_is_half_an_ulp_of_the_scaled_format(name):
    fmt, relative, subnormal = FORMATS[name]
    x = jax.random.normal(jax.random.key(1), (4096,), jnp.float32) * 3.0
    scale = fp8.current_scale(x, fmt)
    error = np.abs(np.asarray(qdq(x, fmt) - x))
    # Normal values round to within half an ulp; the smallest ones to within half the subnormal spacing.
    bound = np.maximum(relative * np.abs(np.asarray(x)), float(scale) * subnormal / 2)
    assert (error <= bound * (1 + 1e-6)).all()
    assert error.max() > 0  # it really rounds


@pytest.mark.parametrize("name", FORMATS)
def test_the_scale_maps_amax_onto_the_largest_value_and_saturates_beyond(name):
    fmt = FORMATS[name][0]
    x = jnp.array([-5.0, 0.25, 2.0, 1e-3], jnp.float32)
    q, scale = fp8.quantize_current(x, fmt)
    assert scale.dtype == jnp.float32 and float(scale) == pytest.approx(5.0 / fp8.largest(fmt))
    assert float(q[0]) == -fp8.largest(fmt)  # amax lands exactly on the format's largest value
    # A tensor larger than the scale was made for saturates at the largest value (a plain cast would be NaN/inf).
    assert np.asarray(fp8.quantize(x * 4, fmt, scale), np.float32)[0] == -fp8.largest(fmt)


def test_per_tensor_scaling_is_invariant_to_the_tensor_magnitude():
    x = jax.random.normal(jax.random.key(2), (256,), jnp.float32)
    for factor in (2.0**-20, 2.0**-3, 2.0**12):
        np.testing.assert_array_equal(qdq(x * factor, fp8.E4M3), qdq(x, fp8.E4M3) * factor)


def test_zeros_quantize_to_zeros_with_a_unit_scale():
    for fmt in (fp8.E4M3, fp8.E5M2):
        q, scale = fp8.quantize_current(jnp.zeros((3, 4)), fmt)
        assert float(scale) == 1.0
        np.testing.assert_array_equal(np.asarray(q, np.float32), 0.0)


def test_fp8_matmul_is_the_matmul_of_the_quantized_operands_forward_and_backward():
    """Forward: e4m3 x and w; backward: the e5m2 cotangent against the saved e4m3 operands, for dx and dw."""
    x, w, g = operands()
    y, pullback = jax.vjp(lambda x, w: matmul(SPEC, x, w, jnp.float32, quantization="fp8"), x, w)
    xq, wq, gq = qdq(x, fp8.E4M3), qdq(w, fp8.E4M3), qdq(g, fp8.E5M2)
    np.testing.assert_allclose(y, jnp.einsum(SPEC, xq, wq), rtol=1e-5, atol=1e-5)
    dx, dw = pullback(g)
    np.testing.assert_allclose(dx, jnp.einsum("blhd,ehd->ble", gq, wq), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, jnp.einsum("ble,blhd->ehd", xq, gq), rtol=1e-5, atol=1e-5)


def test_fp8_matmul_is_close_to_float32_within_fp8_precision():
    x, w, g = operands(1)
    y, pullback = jax.vjp(lambda x, w: matmul(SPEC, x, w, jnp.bfloat16, quantization="fp8"), x.astype(jnp.bfloat16), w)
    want, want_pullback = jax.vjp(lambda x, w: jnp.einsum(SPEC, x, w), x, w)
    relative = lambda a, b: float(jnp.linalg.norm(jnp.float32(a) - b) / jnp.linalg.norm(b))  # noqa: E731
    assert y.dtype == jnp.bfloat16 and relative(y, want) < 0.06  # e4m3: 2^-4 per operand at worst
    dx, dw = pullback(g.astype(jnp.bfloat16))
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32  # the weight gradient in the weight's dtype
    for got, expected in zip((dx, dw), want_pullback(g)):
        assert relative(got, expected) < 0.12  # e5m2 cotangent: 2^-3 at worst


def test_the_program_really_casts_to_both_fp8_formats():
    x, w, _ = operands()
    loss = lambda x, w: matmul(SPEC, x, w, jnp.bfloat16, quantization="fp8").astype(jnp.float32).sum()  # noqa: E731
    text = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).as_text()
    assert "f8E4M3FN" in text and "f8E5M2" in text


def test_delayed_scaling_is_refused_until_it_exists():
    with pytest.raises(ConfigError, match="delayed scaling is not implemented"):
        tiny_config("quantization=fp8", "fp8_scaling=delayed")
    tiny_config("fp8_scaling=delayed")  # without fp8 the recipe is not used


# ---------------------------------------------------------------- training

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from helpers import write_corpus
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_fp8_on_fsdp8_equals_fp8_on_one_device(tmp_path, corpus):
    """Per-tensor amaxes are global maxima, the same however a tensor is split: FSDP(8) quantizes as one device.

    The first step's loss (the same parameters) matches at the suite's tolerance. Its backward and the later
    steps do not: float32 rounding-order differences of the sharded step (last bits) move a few values across an
    fp8 rounding boundary, where they change by a whole fp8 ulp (2^-4 or 2^-3 relative), so losses and gradient
    norms agree to 0.5% (measured: 7e-4), not to 1e-5.
    """
    from test_equivalence import run_metrics

    single = run_metrics(tmp_path / "one", corpus, jax.devices()[:1], "per_device_batch_size=8", "quantization=fp8")
    sharded = run_metrics(tmp_path / "eight", corpus, jax.devices(), "per_device_batch_size=1", "quantization=fp8",
                          "ici_fsdp_parallelism=8")
    assert single["loss"][-1] < single["loss"][0] - 1  # it is really training
    np.testing.assert_allclose(sharded["loss"][0], single["loss"][0], rtol=1e-5)
    for name in single:
        np.testing.assert_allclose(sharded[name], single[name], rtol=5e-3, err_msg=name)


def test_bfloat16_fp8_steps_run_with_tensor_parallel_shards():
    """bfloat16 compute (XLA:CPU runs its dots only inside its own fusions) with the amaxes of TP-split activations
    and weights: DP(2) x FSDP(2) x TP(2), remat_policy=minimal (the fp8 residuals are saved)."""
    from maxpar.train import global_batch, setup_run
    from maxpar.training.train_step import create_state

    config = tiny_config("quantization=fp8", "dtype=bfloat16", "dataset_type=synthetic", "per_device_batch_size=2",
                         "steps=2", "ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                         "remat_policy=minimal")
    run = setup_run(config, jax.devices())
    state = create_state(run.model, run.tx, run.layout, run.mesh)
    step, batches, losses = run.compile_train_step(), iter(run.train_data), []
    for _ in range(2):
        state, metrics = step(state, global_batch(next(batches), run.in_sharding))
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[1] < losses[0], losses


def test_fp8_trains_like_bfloat16(tmp_path, corpus):
    """Looser than end_to_end/fp8.py (300 steps, 2%): 60 steps of the tiny model, the last losses within 3%."""
    from maxpar.train import train
    from helpers import read_metrics

    def last_losses(name, *overrides):
        config = tiny_config("steps=60", "dataset_type=text", f"dataset_path={corpus}", "eval_fraction=0",
                             "dtype=bfloat16", "per_device_batch_size=8", *overrides)
        train(config, devices=jax.devices()[:1], run_dir=tmp_path / name)
        return np.mean([row["loss"] for row in read_metrics(tmp_path / name)[-10:]])

    bf16, fp8_loss = last_losses("bf16"), last_losses("fp8", "quantization=fp8")
    assert bf16 < 3.0  # it learned something (uniform over the vocabulary: ln 264 = 5.6)
    assert abs(fp8_loss / bf16 - 1) < 0.03, (fp8_loss, bf16)


# ---------------------------------------------------------------- planner

def test_planner_counts_the_quantized_matmuls_at_the_fp8_peak():
    from maxpar.io.metrics import matmul_params
    from maxpar.plan.hardware import load_hardware
    from maxpar.plan.model_math import fp8_matmul_params
    from maxpar.plan.predict import PHASES, compute_flops, compute_seconds, fp8_flops

    config = tiny_config("quantization=fp8")
    e = config.emb_dim
    layer = e * config.head_dim * 2 * (config.num_query_heads + config.num_kv_heads) + 3 * e * config.mlp_dim
    assert fp8_matmul_params(config) == config.num_decoder_layers * layer  # not the output projection
    assert fp8_matmul_params(tiny_config()) == 0
    moe = tiny_config("quantization=fp8", "num_experts=4", "num_experts_per_tok=2")
    assert fp8_matmul_params(moe) == config.num_decoder_layers * (layer - 3 * e * config.mlp_dim)  # experts stay
    assert fp8_matmul_params(config) < matmul_params(config)

    tokens = 1000.0
    flops, quantized = compute_flops(config, tokens), fp8_flops(config, tokens)
    assert quantized["backward"] == 2 * quantized["forward"]
    h100, v5p = load_hardware("h100"), load_hardware("tpu-v5p")
    assert h100.peak_fp8_flops == pytest.approx(2 * h100.peak_flops, rel=1e-3) and v5p.peak_fp8_flops == v5p.peak_flops
    for phase in PHASES:
        saved = compute_seconds(flops, fp8_flops(tiny_config(), tokens), h100)[phase] - \
            compute_seconds(flops, quantized, h100)[phase]
        assert saved == pytest.approx(quantized[phase] * (1 / h100.peak_flops - 1 / h100.peak_fp8_flops))
        assert compute_seconds(flops, quantized, v5p)[phase] == pytest.approx(flops[phase] / v5p.peak_flops)
