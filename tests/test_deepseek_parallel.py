"""The whole tiny DeepSeek-V3-style model (configs/models/deepseek-tiny.yml: MLA with a compressed query, sigmoid
routing within groups with an aux-loss-free bias, a shared expert, experts narrower than the dense prefix layer,
multi-token prediction) trains equal to one device under FSDP, TP, EP, and PP with the experts in stages; without
its experts, under CP too.

One 1-device run per module is the reference; every mesh sees the same 8-row global batch. The per-step metrics
compared cover the losses (main and MTP), the gradients (their norm) and the routing (max/mean expert load): the
bias moves every step, and a bias that differed would route differently in the next.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import train_metrics, write_corpus

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

STEPS = 3
# The preset at the test shapes; 3 layers (TINY has 2): the dense prefix layer, then one MoE layer per stage.
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
}
# CP: the config refuses context parallelism with MoE layers (maxpar/core/layout.py), so the model without its
# experts (MLA, YaRN, MTP) runs context-parallel against its own one-device run.
DENSE = ("num_experts=1", "num_experts_per_tok=1", "n_routing_groups=0", "topk_routing_group=0",
         "first_num_dense_layers=0")
CP = ["ici_context_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2", "attention=blockwise",
      "attention_block_size=4", "context_parallel_strategy=ring"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    return train_metrics(tmp_path_factory.mktemp("one") / "run", corpus, jax.devices()[:1], STEPS, *DEEPSEEK,
                         "per_device_batch_size=8", metrics=METRICS)


@pytest.mark.parametrize("name", list(MESHES))
def test_deepseek_trains_equal_to_one_device(name, tmp_path, corpus, reference):
    got = train_metrics(tmp_path / "run", corpus, jax.devices(), STEPS, *DEEPSEEK, "per_device_batch_size=1",
                        *MESHES[name], metrics=METRICS)
    assert reference["loss"][-1] < reference["loss"][0] and reference["mtp_loss"][-1] < reference["mtp_loss"][0]
    for metric in METRICS:
        np.testing.assert_allclose(got[metric], reference[metric], rtol=1e-5, err_msg=metric)


def test_deepseek_attention_and_mtp_train_equal_to_one_device_context_parallel(tmp_path, corpus):
    """The MTP targets are shifted before the context shards are cut (load-balanced chunks), MLA's latent and
    shared RoPE key travel the ring while TP splits its heads (and the MTP head's vocab)."""
    metrics = ("loss", "grad_norm", "mtp_loss")
    want = train_metrics(tmp_path / "one", corpus, jax.devices()[:1], STEPS, *DEEPSEEK, *DENSE,
                         "per_device_batch_size=8", "attention=blockwise", "attention_block_size=4", metrics=metrics)
    got = train_metrics(tmp_path / "cp", corpus, jax.devices(), STEPS, *DEEPSEEK, *DENSE, "per_device_batch_size=1",
                        *CP, metrics=metrics)
    assert want["loss"][-1] < want["loss"][0]
    for metric in metrics:
        np.testing.assert_allclose(got[metric], want[metric], rtol=1e-5, err_msg=metric)
