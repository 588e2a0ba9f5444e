"""The whole tiny DeepSeek-V3-style model (configs/models/deepseek-tiny.yml: MLA with a compressed query, sigmoid
routing within groups with an aux-loss-free bias, a shared expert, experts narrower than the dense prefix layer,
multi-token prediction) trains equal to one device under FSDP, TP, EP, PP with the experts in stages, and CP.

One 1-device run per module is the reference; every mesh runs the trainer's compiled step on the same 8-row packed
batch (`helpers.step_metrics`; the loop around it: tests/test_equivalence.py's docstring says where). The per-step metrics
compared cover the losses (main and MTP), the gradients (their norm) and the routing (max/mean expert load): the
bias moves every step, and a bias that differed would route differently in the next.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import step_metrics

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

STEPS = 4
# The preset at the test shapes; 3 layers (MICRO has 2): the dense prefix layer, then one MoE layer per stage.
# A bias rate 50x the preset's, so that the bias updates weigh in the next steps' choices of experts.
DEEPSEEK = ("model_name=deepseek-tiny", "num_decoder_layers=3", "routed_bias_update_rate=0.05")
METRICS = ("loss", "grad_norm", "mtp_loss", "moe_load_max_over_mean")
# Every mesh shards over fsdp too: FSDP is proven by each (the suite's FSDP(8) cases are test_equivalence.py's).
MESHES = {
    "fsdp2_tp4": ["ici_fsdp_parallelism=2", "ici_tensor_parallelism=4"],
    "ep4_fsdp2": ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"],
    # gPipe over 2 stages: the prefix before the loop, one MoE layer (its experts split over expert) per stage,
    # the MTP module after the last.
    "pp2_ep2_fsdp2": ["ici_stage_parallelism=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=2",
                      "num_pipeline_microbatches=2", "pipeline_schedule=gpipe"],
    # CP(2) x EP(2) x TP(2): MLA's latent and shared RoPE key travel the ring while TP splits its heads (and the MTP
    # head's vocab), the MTP targets are shifted before the context shards are cut, each context shard routes its
    # own tokens and the bias moves by the counts of all of them (else the loads would part).
    "cp2_ep2_tp2_ring": ["ici_context_parallelism=2", "ici_expert_parallelism=2", "ici_tensor_parallelism=2",
                         "ici_fsdp_parallelism=1", "context_parallel_strategy=ring", "attention=blockwise",
                         "attention_block_size=4"],
}


@pytest.fixture(scope="module")
def reference():
    return step_metrics(jax.devices()[:1], STEPS, *DEEPSEEK, "per_device_batch_size=8", metrics=METRICS)


@pytest.mark.parametrize("name", list(MESHES))
def test_deepseek_trains_equal_to_one_device(name, reference):
    got = step_metrics(jax.devices(), STEPS, *DEEPSEEK, "per_device_batch_size=1", *MESHES[name], metrics=METRICS)
    assert reference["loss"][-1] < reference["loss"][0] and reference["mtp_loss"][-1] < reference["mtp_loss"][0]
    for metric in METRICS:
        np.testing.assert_allclose(got[metric], reference[metric], rtol=1e-5, err_msg=metric)
