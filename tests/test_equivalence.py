"""The backbone: sharded runs reproduce the single-device run's per-step losses and gradient norms.

Each run is the trainer's own compiled train step (layout, sharded initialization, step: `helpers.step_metrics`) for
4 steps on one fixed packed batch of 8 rows, on 8 devices against 1. Step 1 runs at learning rate 0 (warm-up), so
steps 2-4 start from updated AdamW moments and steps 3-4 from updated parameters. The trainer's loop around the step
(data pipeline, per-device batches, metrics) on other meshes than one device is compared in
tests/test_checkpoint.py (a resharded resume on FSDP(4)xTP(2) and one device logs the FSDP(8) run's
losses). Gradient accumulation against one big batch: tests/test_mtp.py (accumulation on a pipelined FSDP x TP mesh
against one device without it) and tests/test_pipeline_1f1b.py; remat policies: the fsdp_transpose and tp_sequence
meshes below.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import one_device_steps, step_metrics

STEPS = 4
COMPARED = ("loss", "grad_norm")  # the gradient norm of every step: the gradients match, not only the loss
STRATEGIES = {
    "dp8": ("configs/base.yml", ["ici_data_parallelism=8", "ici_fsdp_parallelism=1"]),
    "fsdp8": ("configs/base.yml", ["ici_fsdp_parallelism=8"]),
    "fsdp4_tp2": ("configs/base.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    "dp2_fsdp2_tp2": ("configs/base.yml", ["ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                                           "ici_tensor_parallelism=2"]),
    # Each remat policy in a run of its own mesh (it must not change the numbers): one compiled program per mesh.
    "fsdp_transpose": ("configs/fsdp_transpose.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2",
                                                      "remat_policy=full"]),
    "tp_sequence": ("configs/tp_sequence.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2",
                                                "remat_policy=minimal"]),
    "tp_transpose": ("configs/tp_transpose.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    # ZeRO-1: the AdamW moments split over data too; gradients reduce-scattered, parameters all-gathered.
    "dp8_zero1": ("configs/base.yml", ["ici_data_parallelism=8", "ici_fsdp_parallelism=1",
                                       "shard_optimizer_over_data=true"]),
    "dp2_fsdp2_tp2_zero1": ("configs/base.yml", ["ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                                                 "ici_tensor_parallelism=2", "shard_optimizer_over_data=true"]),
}


def run_metrics(devices, *overrides, config_file="configs/base.yml", metrics=COMPARED) -> dict[str, np.ndarray]:
    """{metric: its value at steps 1..STEPS} of the compiled train step on `devices`."""
    return step_metrics(devices, STEPS, *overrides, metrics=metrics, config_file=config_file)


def assert_same_run(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert want["loss"][-1] < want["loss"][0]  # it is really training
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)


def one_device(*settings: str, config_file="configs/base.yml", metrics=COMPARED) -> dict[str, np.ndarray]:
    """The one-device run of `settings` (8 rows per step), once per session: other modules compare with it too."""
    run = one_device_steps(STEPS, "per_device_batch_size=8", *settings, config_file=config_file)
    return {name: run.metrics[name] for name in metrics}


@pytest.fixture(scope="module")
def reference():
    return one_device()


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_matches_single_device(name, reference):
    config_file, overrides = STRATEGIES[name]
    assert_same_run(run_metrics(jax.devices(), "per_device_batch_size=1", *overrides, config_file=config_file),
                    reference)


# Settings that change the numbers themselves: each is compared with the same settings on one device.
OWN_REFERENCE = {
    # bfloat16 parameters, float32 AdamW moments (the seeds' 2 + 8 bytes per parameter), FSDP(8).
    "bf16_weights_fp32_moments": ("configs/base.yml", ["weight_dtype=bfloat16", "optimizer_state_dtype=float32"],
                                  ["ici_fsdp_parallelism=8"]),
    # MoE layers inside pipeline stages: the balance-loss sums, dropped and routed counts flow through the
    # loop. EP(2)xPP(2)xFSDP(2) with a capacity that drops tokens, against the unpipelined tiny MoE on one device
    # (the one-device steps tests/test_moe_parallel.py compares its capacity meshes with: one reference for both);
    # dropless: the Qwen3-MoE case below.
    "moe_ep2_pp2_fsdp2_capacity": ("configs/base.yml", ["model_name=tiny-moe", "capacity_factor=1.0"],
                                   ["ici_expert_parallelism=2", "ici_stage_parallelism=2", "ici_fsdp_parallelism=2",
                                    "num_pipeline_microbatches=2"]),
    # Qwen3's QK-norm (per-head RMSNorm scales over head_dim): Qwen3-MoE's shape pipelined under EP(2) x PP(2) x
    # TP(2), dropless; dense Qwen3 context-parallel (ring) under CP(2) x FSDP(2) x TP(2) (CP takes no MoE or stages
    # yet).
    "qwen3_moe_ep2_pp2_tp2": ("configs/base.yml", ["qk_norm=true", "num_experts=4", "num_experts_per_tok=2",
                                                   "capacity_factor=0"],
                              ["ici_expert_parallelism=2", "ici_stage_parallelism=2", "ici_tensor_parallelism=2",
                               "ici_fsdp_parallelism=1", "num_pipeline_microbatches=2"]),
    "qwen3_cp2_fsdp2_tp2": ("configs/base.yml", ["qk_norm=true", "attention=blockwise"],
                            ["ici_context_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                             "context_parallel_strategy=ring"]),
}
MOE_METRICS = ("moe_load_balance_loss", "moe_dropped_tokens")


@pytest.mark.parametrize("name", list(OWN_REFERENCE))
def test_setting_matches_its_single_device_run(name):
    config_file, settings, mesh = OWN_REFERENCE[name]
    # MoE: the step's load-balance loss (computed from sums over the whole batch) and dropped count must match too.
    moe = "model_name=tiny-moe" in settings or "num_experts=4" in settings
    metrics = COMPARED + (MOE_METRICS if moe else ())
    single = one_device(*settings, config_file=config_file, metrics=metrics)
    sharded = run_metrics(jax.devices(), "per_device_batch_size=1", *settings, *mesh, config_file=config_file,
                          metrics=metrics)
    if "capacity_factor=1.0" in settings:
        assert single["moe_dropped_tokens"].sum() > 0  # the capacity really drops tokens
    assert_same_run(sharded, single)

