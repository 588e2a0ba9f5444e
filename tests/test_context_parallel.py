"""Context parallelism: the sequence split over the `context` axis reproduces the 1-device losses and gradient
norms (compiled train steps on a fixed batch against test_equivalence.py's one-device reference, shared with it),
and a CP checkpoint resumes on one device (the trainer's loop)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import read_metrics, micro_config
from maxpar.core.config import ConfigError
from maxpar.core.mesh import resolve_mesh_shape
from maxpar.training.train_step import run_layout
from test_equivalence import assert_same_run, one_device, run_metrics

BLOCKWISE = ["attention=blockwise", "attention_block_size=8"]
CASES = {
    "cp8_ring_balanced": ["ici_context_parallelism=8", "ici_fsdp_parallelism=1", "context_parallel_strategy=ring"],
    "cp8_gather_unbalanced": ["ici_context_parallelism=8", "ici_fsdp_parallelism=1",
                              "context_parallel_load_balance=false"],
    # all-gather at CP(4), load-balanced: tests/test_context_moe.py's capacity_cp4_ep2_gather (the same attention);
    # CP x FSDP: the two cases below
    "cp4_ring_unbalanced_fsdp2": ["ici_context_parallelism=4", "ici_fsdp_parallelism=2",
                                  "context_parallel_strategy=ring", "context_parallel_load_balance=false"],
    "cp2_gather_balanced_fsdp4": ["ici_context_parallelism=2", "ici_fsdp_parallelism=4"],
    "cp2_ring_unbalanced_tp2_dp2": ["ici_context_parallelism=2", "ici_fsdp_parallelism=1", "ici_tensor_parallelism=2",
                                    "ici_data_parallelism=2", "context_parallel_strategy=ring",
                                    "context_parallel_load_balance=false"],
}


@pytest.fixture(scope="module")
def reference():
    return one_device()


# Blockwise attention on the mesh against the dot_product reference: blockwise = dot_product on one device is
# tests/test_blockwise.py's (the forward and gradient of the core), and a difference would fail every case here.
@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_matches_single_device(name, reference):
    assert_same_run(run_metrics(jax.devices(), "per_device_batch_size=1", *BLOCKWISE, *CASES[name]), reference)


@pytest.mark.parametrize("overrides, named", [
    (["ici_context_parallelism=8", "ici_fsdp_parallelism=1"], ["attention=dot_product", "ici_context_parallelism"]),
    (["ici_context_parallelism=8", "ici_fsdp_parallelism=1", "attention=blockwise", "max_target_length=40"],
     ["max_target_length=40", "context_parallel_load_balance", "16"]),
    (["ici_context_parallelism=8", "ici_fsdp_parallelism=1", "attention=blockwise", "max_target_length=36",
      "context_parallel_load_balance=false"], ["max_target_length=36", "8"]),
    (["attention=blockwise", "attention_block_size=12"], ["attention_block_size=12", "32"]),
    (["ici_context_parallelism=2", "ici_stage_parallelism=2", "ici_fsdp_parallelism=-1", "attention=blockwise"],
     ["ici_stage_parallelism=2", "pipeline"]),
    (["ici_context_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "attention=blockwise",
      "extra_logical_axis_rules=[[activation_length,[tensor]]]"], ["activation_length", "TP-sequence"]),
])
def test_context_config_errors_name_the_keys(overrides, named):
    """Refused before any device is used: by the run layout on an abstract mesh of 8."""
    with pytest.raises(ConfigError) as info:
        config = micro_config(*overrides)
        run_layout(config, resolve_mesh_shape(config, 8))
    for word in named:
        assert word in str(info.value)


def test_checkpoint_restores_across_context_degrees_and_strategies(tmp_path):
    """Saved by a CP=4 ring run, resumed at step 2 on one device with dot_product: the same steps 3 and 4. Both runs
    have the programs of a case above and of the one-device reference (4 steps, 8 rows): the session's compilation
    cache holds them already."""
    from helpers import write_corpus
    from test_checkpoint import copy_run, run_config
    from maxpar.train import train

    corpus = write_corpus(tmp_path / "corpus")
    saved = tmp_path / "saved"
    train(run_config(corpus, *BLOCKWISE, *CASES["cp4_ring_unbalanced_fsdp2"]), devices=jax.devices(), run_dir=saved)
    resumed = copy_run(saved, tmp_path / "resumed", steps={2})
    train(run_config(corpus, "per_device_batch_size=8"), devices=jax.devices()[:1], run_dir=resumed)
    rows = {name: [(r["step"], r["loss"]) for r in read_metrics(run)] for name, run in (("saved", saved),
                                                                                         ("resumed", resumed))}
    assert [s for s, _ in rows["resumed"]] == [3, 4]
    np.testing.assert_allclose([loss for _, loss in rows["resumed"]], [loss for _, loss in rows["saved"][2:]],
                               rtol=1e-5)


def test_a_filled_context_degree_is_checked_when_the_step_is_built(tmp_path):
    """ici_context_parallelism=-1 is only resolved with the devices: dot_product attention is refused then."""
    from maxpar.train import setup_run
    config = micro_config("ici_context_parallelism=-1", "ici_fsdp_parallelism=1", "per_device_batch_size=1",
                         "dataset_type=synthetic")
    with pytest.raises(ConfigError, match="attention=dot_product"):
        setup_run(config, jax.devices()).compile_train_step()
