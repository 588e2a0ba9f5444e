"""Mixture-of-experts layers under context parallelism: each device routes its own share of every row's tokens,
and the compiled train step equals the one-device step (4 steps on a fixed batch).

Per step: the loss, the gradient norm, the balance loss and the max/mean expert load (global routed counts), and in
capacity mode the dropped copies (a row's tokens compete for its capacity in their original order, whatever the
load-balancing reorder of the context shards). DeepSeek's MoE (and its routing bias) under CP:
tests/test_deepseek_parallel.py.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import MICRO, one_device_steps, step_metrics
from maxpar.model.context_parallel import sequence_layout
from maxpar.model.moe_dispatch import capacity_local, dropless_local
from maxpar.model.routing import capacity_slots
from maxpar.plan.__main__ import run as plan_run

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
BASE = str(Path(__file__).resolve().parents[1] / "configs" / "base.yml")

STEPS = 4
BLOCKWISE = ("attention=blockwise", "attention_block_size=4")
MOE_METRICS = ("loss", "grad_norm", "moe_load_balance_loss", "moe_load_max_over_mean", "moe_dropped_tokens")
# name -> (capacity_factor, mesh); every mesh sees the same 8-row global batch.
MIXTRAL = {
    "dropless_cp2_ep2_fsdp2_ring": (0.0, ["ici_context_parallelism=2", "ici_expert_parallelism=2",
                                          "ici_fsdp_parallelism=2", "context_parallel_strategy=ring"]),
    # A row's capacity (10 slots per expert) exceeds a shard's 8 tokens: the shards' buffers are packed.
    "capacity_cp4_ep2_gather": (1.25, ["ici_context_parallelism=4", "ici_expert_parallelism=2",
                                       "ici_fsdp_parallelism=1"]),
}


def one_device(capacity_factor: float) -> dict[str, np.ndarray]:
    """The one-device run (dot_product attention) at `capacity_factor`, once per session (tests/test_moe_parallel.py
    compares with the dropless one too)."""
    return one_device_steps(STEPS, "per_device_batch_size=8", "model_name=tiny-moe",
                            f"capacity_factor={capacity_factor}").metrics


@pytest.mark.parametrize("name", list(MIXTRAL))
def test_mixtral_style_moe_trains_context_parallel_equal_to_one_device(name):
    capacity_factor, mesh = MIXTRAL[name]
    want = one_device(capacity_factor)
    got = step_metrics(jax.devices(), STEPS, "model_name=tiny-moe", f"capacity_factor={capacity_factor}",
                       "per_device_batch_size=1", *BLOCKWISE, *mesh, metrics=MOE_METRICS)
    assert want["loss"][-1] < want["loss"][0]
    if capacity_factor:
        assert np.all(want["moe_dropped_tokens"] > 0)  # the capacity rule bites
    for metric in MOE_METRICS:
        np.testing.assert_allclose(got[metric], want[metric], rtol=1e-5, err_msg=metric)


def test_capacity_priority_follows_the_original_order_of_a_reordered_row():
    """The load-balancing reorder of a row does not change which copies keep their slots, nor the slots."""
    rng = np.random.default_rng(0)
    experts = rng.integers(0, 4, (2, 16, 2)).astype(np.int32)
    experts[..., 1] = (experts[..., 0] + 1) % 4
    valid = np.ones((2, 16), bool)
    valid[1, 12:] = False
    want_slot, want_kept = capacity_slots(experts, valid, 4, capacity=3)
    order = sequence_layout(16, 2, True)
    slot, kept = capacity_slots(experts[:, order], valid[:, order], 4, capacity=3, order=order)
    np.testing.assert_array_equal(slot, np.asarray(want_slot)[:, order])
    np.testing.assert_array_equal(kept, np.asarray(want_kept)[:, order])
    assert not np.all(want_kept) and np.any(want_kept)
    # Without the order, the reordered row gives its slots to other copies.
    plain, _ = capacity_slots(experts[:, order], valid[:, order], 4, capacity=3)
    assert np.any(np.asarray(plain) != np.asarray(want_slot)[:, order])


def test_packed_capacity_buffers_compute_the_kept_copies():
    """A shard of 8 tokens against a row capacity of 10 slots: its kept copies, packed into 8 slots per expert,
    give what the dropless dispatch gives with the dropped copies' weights at zero."""
    rng = np.random.default_rng(1)
    experts = np.stack([rng.integers(0, 4, (2, 8)), rng.integers(0, 4, (2, 8))], -1).astype(np.int32)
    experts[..., 1] = np.where(experts[..., 1] == experts[..., 0], (experts[..., 0] + 1) % 4, experts[..., 1])
    slots = rng.integers(0, 12, (2, 8, 2)).astype(np.int32)       # row slots of a longer row; >= 10: dropped
    kept = slots < 10
    weights = np.where(kept, rng.uniform(0.1, 1.0, (2, 8, 2)), 0.0).astype(np.float32)
    x = rng.normal(size=(2, 8, 16)).astype(np.float32)
    w_gate, w_up = (rng.normal(size=(4, 16, 8)).astype(np.float32) for _ in range(2))
    w_down = rng.normal(size=(4, 8, 16)).astype(np.float32)
    got = capacity_local(x, experts, slots, weights, w_gate, w_up, w_down, num_experts=4, capacity=10)
    want = dropless_local(x.reshape(16, 16), experts.reshape(16, 2), weights.reshape(16, 2), w_gate, w_up, w_down,
                          num_experts=4)
    assert 0 < kept.sum() < kept.size
    np.testing.assert_allclose(np.asarray(got).reshape(16, 16), want, rtol=1e-5, atol=1e-5)


def test_plan_verify_passes_for_context_and_expert_parallelism():
    """The experts' weights gathered over context (their gradients reduce-scattered back), a context shard's
    tokens exchanged over expert, the MoE activations of L/C tokens per device: predicted as compiled."""
    result, text, status = plan_run([BASE, *MICRO, "model_name=tiny-moe", "per_device_batch_size=4",
                                     "hardware=tpu-v5p", *BLOCKWISE, "ici_context_parallelism=4",
                                     "ici_expert_parallelism=2", "ici_fsdp_parallelism=1", "--verify"])
    assert status == 0 and result["verify"]["passed"], text
    buckets = {(b["axis"], b["collective"]): b for b in result["verify"]["buckets"]}
    for key in (("expert", "all-to-all"), ("context", "all-gather"), ("context", "reduce-scatter")):
        assert buckets[key]["status"] == "ok" and buckets[key]["measured_bytes"] > 0, key
