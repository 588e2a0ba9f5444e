"""attention=splash (JAX's Pallas TPU splash attention kernel): forward and gradients equal attention=dot_product's
in Pallas interpret mode on CPU, on one device and under the layout's shard_map (context parallelism, tensor
parallelism, FSDP); refused without a TPU; the model compiled for a TPU topology by libtpu (skipped without it)."""

from __future__ import annotations

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import layout_on, micro_config
from maxpar.core.config import ConfigError, model_config
from maxpar.core.layout import check_context
from maxpar.model.attention import einsum_attention
from maxpar.model.context_parallel import sequence_layout
from maxpar.model.splash import SplashBlocks, sharded_splash_attention, splash_attention, splash_blocks
from maxpar.train import setup_run

B, L, H, KV, D = 2, 256, 4, 2, 16  # GQA; the kernel's blocks are multiples of 128 tokens
BLOCKS = SplashBlocks(q=128, kv=128)


def random_inputs(value_dim: int = D):
    """q (pre-scaled), k, v, a cotangent of the output, and packed segment ids (3 documents and padding; one)."""
    rng = np.random.default_rng(0)
    q, k, v, w = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in (
        (B, L, H, D), (B, L, KV, D), (B, L, KV, value_dim), (B, L, H, value_dim)))
    segments = jnp.array([[1] * 100 + [2] * 120 + [3] * 30 + [0] * 6, [1] * L], jnp.int32)
    return q * D ** -0.5, k, v, w, segments


def value_and_grads(fn, q, k, v, w):
    return fn(q, k, v), jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=(0, 1, 2))(q, k, v)


def assert_equal_to_dot_product(got, q, k, v, w, segments, window):
    want = value_and_grads(lambda *a: einsum_attention(*a, segments, window), q, k, v, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    for name, g, e in zip("qkv", got[1], want[1]):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("window, value_dim", [(0, D), (60, 8)])
def test_forward_and_gradients_equal_dot_product(window, value_dim):
    """Causal, packed documents, GQA; a sliding window with values narrower than q and k (MLA's case)."""
    q, k, v, w, segments = random_inputs(value_dim)
    got = jax.jit(lambda q, k, v: value_and_grads(
        lambda *a: splash_attention(*a, segments, window, BLOCKS, interpret=True), q, k, v, w))(q, k, v)
    assert_equal_to_dot_product(got, q, k, v, w, segments, window)


def test_sharded_over_context_heads_and_batch_equals_dot_product():
    """The model's shard_map: CP 2 (all_gather, load-balanced rows), TP 2 (heads), FSDP 2 (rows), sliding window."""
    window = 60
    config = micro_config("attention=splash", f"max_target_length={L}", "ici_context_parallelism=2",
                         "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2", "context_parallel_strategy=all_gather",
                         f"sliding_window={window}", "sa_block_q=128", "sa_block_kv=128")
    layout, mesh = layout_on(config)
    context = layout.model.context
    assert (context.degree, context.load_balance) == (2, True)
    blocks = splash_blocks(model_config(config), L // 2, L)
    order = sequence_layout(L, 2, True)  # the rows as the trainer reorders them (`reorder_batch`)
    back = np.argsort(order)
    q, k, v, w, segments = random_inputs()

    def sharded(q, k, v):
        return sharded_splash_attention(q[:, order], k[:, order], v[:, order], segments[:, order], window, blocks,
                                        context, interpret=True)[:, back]

    placed = jax.device_put((q, k, v), NamedSharding(mesh, P()))
    got = jax.jit(lambda q, k, v: value_and_grads(sharded, q, k, v, w))(*placed)
    assert_equal_to_dot_product(got, q, k, v, w, segments, window)


def test_refused_without_a_tpu():
    config = micro_config("attention=splash", "max_target_length=128")
    with pytest.raises(ConfigError, match="attention=splash: the Pallas splash attention kernel needs TPU devices, "
                                          "these are cpu; use attention=dot_product or attention=blockwise here"):
        setup_run(config, jax.devices()[:1])


@pytest.mark.parametrize("overrides, degree, stages, message", [
    (["context_parallel_strategy=ring"], 2, 1, "context_parallel_strategy=ring: the splash kernel cannot carry"),
    (["sa_block_q=192"], 1, 1, "sa_block_q=192: the splash kernel's blocks are multiples of 128"),
    (["max_target_length=192"], 1, 1, "sa_block_q=512: the splash kernel cuts the 192 queries"),
    (["max_target_length=256"], 4, 1, "cuts the 64 queries \\(max_target_length=256 / context degree 4\\)"),
    (["ici_stage_parallelism=2"], 1, 2, "attention=splash with ici_stage_parallelism=2, .* do not run inside "
                                        "pipeline stages yet"),
])
def test_what_the_kernel_cannot_run_is_a_config_error(overrides, degree, stages, message):
    with pytest.raises(ConfigError, match=message):
        check_context(micro_config("attention=splash", "max_target_length=512", *overrides), degree, stages)


def test_the_planner_counts_splash_like_blockwise():
    """No seq x seq scores: the same planned memory and attention FLOPs as blockwise with the same blocks, and
    context parallelism's all_gather collectives."""
    from maxpar.plan.hardware import load_hardware
    from maxpar.plan.predict import Target, attention_overwork, make_plan

    def planned(attention, *overrides):
        config = micro_config(f"attention={attention}", "max_target_length=1024", "attention_block_size=256",
                             "sa_block_q=256", "sa_block_kv=256", *overrides)
        plan = make_plan(config, Target(hardware=load_hardware("tpu-v5p"), num_devices=8, num_slices=1))
        return plan["memory_per_device_bytes"], attention_overwork(config), plan.collectives

    dense, blockwise, splash = (planned(a) for a in ("dot_product", "blockwise", "splash"))
    assert splash == blockwise and splash[0]["activations"] < dense[0]["activations"] and splash[1] == 0.25
    cp = ("ici_context_parallelism=2", "context_parallel_strategy=all_gather")
    splash_cp = planned("splash", *cp)
    assert splash_cp == planned("blockwise", *cp)
    assert any(c.pattern == "CP k all-gather (forward)" for c in splash_cp[2])


# ---------------------------------------------------------------- compiled for a TPU by libtpu

@pytest.fixture(scope="module")
def tpu_devices():
    """The 8 chips of a v5p:2x2x2 topology, for compiling only (no TPU needed; libtpu compiles for them)."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'jax[tpu]')")
    from maxpar.host.topology import parse_topology, topology_devices

    # v5p-16 is v5p:2x2x2; topology_devices keeps libtpu's warning text out of TPU_WORKER_ID, which the worker's
    # later subprocesses (tests/test_train.py's command-line run) would inherit and read as their worker id
    return topology_devices(parse_topology("v5p-16"))


@pytest.mark.parametrize("mesh", [
    ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"],
    ["ici_context_parallelism=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=2", "num_experts=4",
     "num_experts_per_tok=2", "sliding_window=100"],
], ids=["fsdp4_tp2", "cp2_ep2_fsdp2_moe_window"])
def test_the_train_step_compiles_for_tpu(tpu_devices, mesh):
    """The trainer's step with the kernel's three Mosaic calls in it (forward, dq, dkv; segmented: the packed
    documents' ids), as the TPU compiler builds it."""
    from maxpar.plan.verify import compile_train_step

    config = micro_config("attention=splash", "max_target_length=256", "dtype=bfloat16", "per_device_batch_size=1",
                         "num_slices=1", *mesh)
    compiled = compile_train_step(config, tpu_devices)
    assert compiled.platform == "tpu"
    assert set(re.findall(r"splash_mha_\w+", compiled.text)) == {
        "splash_mha_fwd_segmented_residuals", "splash_mha_dq_segmented_no_residuals",
        "splash_mha_dkv_segmented_no_residuals"}
