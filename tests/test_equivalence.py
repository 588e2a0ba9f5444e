"""The backbone: sharded runs reproduce the single-device run's per-step losses."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import read_metrics, tiny_config, write_corpus
from maxpar.train import train

STEPS = 4
STRATEGIES = {
    "dp8": ("configs/base.yml", ["ici_data_parallelism=8", "ici_fsdp_parallelism=1"]),
    "fsdp8": ("configs/base.yml", ["ici_fsdp_parallelism=8"]),
    "fsdp4_tp2": ("configs/base.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    "dp2_fsdp2_tp2": ("configs/base.yml", ["ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                                           "ici_tensor_parallelism=2"]),
    "fsdp_transpose": ("configs/fsdp_transpose.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    "tp_sequence": ("configs/tp_sequence.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    "tp_transpose": ("configs/tp_transpose.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    # ZeRO-1: the AdamW moments split over data too; gradients reduce-scattered, parameters all-gathered.
    "dp8_zero1": ("configs/base.yml", ["ici_data_parallelism=8", "ici_fsdp_parallelism=1",
                                       "shard_optimizer_over_data=true"]),
    "dp2_fsdp2_tp2_zero1": ("configs/base.yml", ["ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                                                 "ici_tensor_parallelism=2", "shard_optimizer_over_data=true"]),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def losses(tmp_path, corpus, devices, *overrides, config_file="configs/base.yml", metric="loss"):
    config = tiny_config(f"steps={STEPS}", "dataset_type=text", f"dataset_path={corpus}", "eval_fraction=0",
                         *overrides, config_file=config_file)
    run_dir = tmp_path / "run"
    train(config, devices=devices, run_dir=run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return np.array([r["loss"] for r in rows]), np.array([r.get(metric) for r in rows], dtype=float)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    return losses(tmp_path_factory.mktemp("ref"), corpus, jax.devices()[:1], "per_device_batch_size=8")[0]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_matches_single_device(name, tmp_path, corpus, reference):
    config_file, overrides = STRATEGIES[name]
    sharded = losses(tmp_path, corpus, jax.devices(), "per_device_batch_size=1", *overrides,
                     config_file=config_file)[0]
    assert reference[-1] < reference[0]  # it is really training
    np.testing.assert_allclose(sharded, reference, rtol=1e-5)


# Settings that change the numbers themselves: each is compared with the same settings on one device.
OWN_REFERENCE = {
    # bfloat16 parameters, float32 AdamW moments (the seeds' 2 + 8 bytes per parameter), FSDP(8).
    "bf16_weights_fp32_moments": ("configs/base.yml", ["weight_dtype=bfloat16", "optimizer_state_dtype=float32"],
                                  ["ici_fsdp_parallelism=8"]),
    # MoE layers inside pipeline stages: the balance-loss sums, dropped and routed counts flow through the
    # loop. EP(2)xPP(2)xDP(2) against the unpipelined MoE model on one device.
    "moe_ep2_pp2_dp2": ("configs/base.yml", ["num_experts=4", "num_experts_per_tok=2", "capacity_factor=0"],
                        ["ici_expert_parallelism=2", "ici_stage_parallelism=2", "ici_data_parallelism=2",
                         "ici_fsdp_parallelism=1", "num_pipeline_microbatches=2"]),
}


@pytest.mark.parametrize("name", list(OWN_REFERENCE))
def test_setting_matches_its_single_device_run(name, tmp_path, corpus):
    config_file, settings, mesh = OWN_REFERENCE[name]
    # MoE: the step's load-balance loss (computed from sums over the whole batch) must match too.
    metric = "moe_load_balance_loss"
    single, single_balance = losses(tmp_path / "one", corpus, jax.devices()[:1], "per_device_batch_size=8",
                                    *settings, config_file=config_file, metric=metric)
    sharded, sharded_balance = losses(tmp_path / "eight", corpus, jax.devices(), "per_device_batch_size=1",
                                      *settings, *mesh, config_file=config_file, metric=metric)
    assert single[-1] < single[0]
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    np.testing.assert_allclose(sharded_balance, single_balance, rtol=1e-5)


def test_gradient_accumulation_matches_one_big_batch(tmp_path, corpus, reference):
    accumulated = losses(tmp_path, corpus, jax.devices()[:1], "per_device_batch_size=4",
                         "gradient_accumulation_steps=2")[0]
    np.testing.assert_allclose(accumulated, reference, rtol=1e-5)


@pytest.mark.parametrize("policy", ["minimal", "full"])
def test_remat_policy_does_not_change_losses(policy, tmp_path, corpus, reference):
    rematted = losses(tmp_path, corpus, jax.devices()[:1], "per_device_batch_size=8", f"remat_policy={policy}")[0]
    np.testing.assert_allclose(rematted, reference, rtol=1e-5)
