"""Muon and the z-loss on meshes: equal to one device, predicted by the planner, resumed exactly.

Compiled steps on a fixed packed batch (no input pipeline): Muon (spread orthogonalization) under FSDP(2) x TP(2)
x EP(2) with MoE layers and the z-loss (vocab-sharded logits) has the one-device run's losses, z-loss, gradient
norms and hidden matrices; the z-loss in the 1F1B loss head has the one-device run's losses, z-loss and gradient
norms; `--verify` finds the planner's Muon collectives in the compiled step; a Muon run
resumed from its checkpoint logs the uninterrupted run's numbers.
"""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from helpers import REPO, MICRO, layout_on, packed_batch, read_metrics, micro_config, write_corpus
from maxpar.core.config import model_config
from maxpar.model import Transformer
from maxpar.plan.__main__ import run as plan_run
from maxpar.train import train
from maxpar.training.optimizer import make_optimizer, muon_labels
from maxpar.training.train_step import create_state, jit_train_step

STEPS = 3
MOE = ("num_experts=4", "num_experts_per_tok=2", "moe_layer_interval=2")
# Muon's runs have the z-loss on too: its vocab-sharded logits (tensor parallelism splits the output head) are
# checked by the Muon mesh, its 1F1B loss head by the z-loss case below (one compiled program fewer).
MUON = ("opt_type=muon", *MOE, "z_loss_weight=1e-2", "steps=4")


def compiled_run(config, devices, steps: int = STEPS):
    """Per-step metrics and the final parameters of `steps` compiled train steps on one fixed batch."""
    layout, mesh = layout_on(config, devices)
    model = Transformer(model_config(config), layout.model)
    tx = make_optimizer(config, layout)
    state = create_state(model, tx, layout, mesh)
    step = jit_train_step(model, tx, layout, mesh)
    batch = {key: jax.device_put(value, layout.input_sharding(mesh))
             for key, value in packed_batch(layout.batch.global_rows, config.max_target_length).items()}
    metrics = []
    for _ in range(steps):
        state, out = step(state, batch)
        metrics.append(jax.device_get(out))
    return metrics, jax.device_get(state.params)


def assert_same(got, want, keys=("loss", "grad_norm"), params=False):
    """Per-step metrics equal (rtol 1e-5); with `params`, the Muon matrices too (AdamW's sign-like first steps
    magnify last-bit gradient differences in the others)."""
    (got_metrics, got_params), (want_metrics, want_params) = got, want
    assert want_metrics[-1]["loss"] < want_metrics[0]["loss"]  # it is really training
    for key in keys:
        np.testing.assert_allclose([m[key] for m in got_metrics], [m[key] for m in want_metrics], rtol=1e-5,
                                   err_msg=key)
    if params:
        labels = muon_labels(want_params)
        for got_leaf, want_leaf, label in zip(*(jax.tree.leaves(t) for t in (got_params, want_params, labels))):
            if label == "muon":
                np.testing.assert_allclose(got_leaf, want_leaf, atol=1e-5 * np.abs(want_leaf).max())


@pytest.fixture(scope="module")
def muon_one_device():
    """The program of test_a_muon_run_resumes_exactly's runs too (compiled once)."""
    return compiled_run(micro_config(*MUON, "per_device_batch_size=8"), jax.devices()[:1])


def test_muon_under_fsdp_tp_ep_equals_one_device(muon_one_device):
    """FSDP(2) x TP(2) x EP(2): the spread way moves the fsdp and tensor axes onto the layers, gathers what is
    left, and keeps the experts split over `expert`; the z-loss of vocab-sharded logits."""
    config = micro_config(*MUON, "per_device_batch_size=1", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                          "ici_expert_parallelism=2")
    assert_same(compiled_run(config, jax.devices()), muon_one_device, keys=("loss", "grad_norm", "z_loss"),
                params=True)
    assert muon_one_device[0][0]["z_loss"] > 0


Z_LOSS = ("z_loss_weight=1e-2", "num_decoder_layers=4")


@pytest.fixture(scope="module")
def z_loss_one_device():
    return compiled_run(micro_config(*Z_LOSS, "per_device_batch_size=8"), jax.devices()[:1])


def test_z_loss_in_the_1f1b_loss_head_equals_one_device(z_loss_one_device):
    """The last stage's loss head computes the z-loss (with FSDP x TP inside the stages: vocab-sharded logits)."""
    mesh = ("ici_stage_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "pipeline_schedule=1f1b",
            "num_pipeline_microbatches=2")
    got = compiled_run(micro_config(*Z_LOSS, "per_device_batch_size=1", *mesh), jax.devices())
    assert_same(got, z_loss_one_device, keys=("loss", "grad_norm", "z_loss"))
    assert z_loss_one_device[0][0]["z_loss"] > 0


def test_verify_finds_the_planned_muon_collectives():
    """The MoE model under FSDP(2) x TP(2) x EP(2): the spread way's all-to-alls (fsdp and tensor onto the experts
    and the padded layer dim) are predicted exactly."""
    result, text, status = plan_run([str(REPO / "configs" / "base.yml"), *MICRO, "per_device_batch_size=4",
                                     "hardware=tpu-v5p", "opt_type=muon", *MOE, "ici_fsdp_parallelism=2",
                                     "ici_tensor_parallelism=2", "ici_expert_parallelism=2", "--verify"])
    assert status == 0 and result["verify"]["passed"], text
    checked = {(b["axis"], b["collective"]) for b in result["verify"]["buckets"] if b["status"] == "ok"}
    assert {("fsdp", "all-to-all"), ("tensor", "all-to-all")} <= checked, text
    assert "Muon spread all-to-all" in {c["pattern"] for c in result["comms"]}


def test_a_muon_run_resumes_exactly(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    config = micro_config(*MUON, "dataset_type=text", f"dataset_path={corpus}", "per_device_batch_size=8",
                          "checkpoint_period=2", "enable_checkpointing=true", "max_checkpoints_to_keep=0")
    train(config, devices=jax.devices()[:1], run_dir=tmp_path / "whole")
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "2", tmp_path / "resumed" / "checkpoints" / "2")
    train(config, devices=jax.devices()[:1], run_dir=tmp_path / "resumed")
    keys = ("step", "loss", "grad_norm", "learning_rate")
    assert [[r[k] for k in keys] for r in read_metrics(tmp_path / "resumed")] == [
        [r[k] for k in keys] for r in read_metrics(tmp_path / "whole")[2:]]
