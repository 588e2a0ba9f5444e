"""The whole tiny DeepSeek-V3-style model (configs/models/deepseek-tiny.yml: MLA with a compressed query, sigmoid
routing within groups with an aux-loss-free bias, a shared expert, experts narrower than the dense prefix layer,
multi-token prediction) trains equal to one device under FSDP x TP, PP x EP x FSDP with the experts in stages, and
CP x EP x TP.

One 1-device run per module is the reference; every mesh runs the trainer's compiled step on the same 8-row packed
batch (`helpers.compiled_steps`; the loop around it: tests/test_equivalence.py's docstring says where). The per-step
metrics compared cover the losses (main and MTP), the gradients (their norm) and the routing (max/mean expert load):
the bias moves every step, and a bias that differed would route differently in the next. After the last step the
routing biases are equal bit for bit (whole multiples of the update rate) and every parameter is equal within the
tolerance (this replaced tests/test_moe_parallel.py's DeepSeek-style MoE cases, which had MHA and no MTP).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import compiled_steps

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

STEPS = 4
RATE = 0.05  # routed_bias_update_rate
# The preset at the test shapes; 3 layers (MICRO has 2): the dense prefix layer, then one MoE layer per stage.
# A bias rate 50x the preset's, so that the bias updates weigh in the next steps' choices of experts.
DEEPSEEK = ("model_name=deepseek-tiny", "num_decoder_layers=3", f"routed_bias_update_rate={RATE}")
METRICS = ("loss", "grad_norm", "mtp_loss", "moe_load_max_over_mean")
# FSDP, TP and EP each in two meshes, PP and CP in one (the suite's FSDP(8) cases are test_equivalence.py's). EP(4) x
# FSDP(2)'s dispatch (the token lookup's all-to-all over fsdp+expert) is tests/test_moe_parallel.py's; the routing it
# feeds is computed before the dispatch, and moves the biases by the global counts under EP(2) in two meshes here.
MESHES = {
    "fsdp2_tp4": ["ici_fsdp_parallelism=2", "ici_tensor_parallelism=4"],
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
    return compiled_steps(jax.devices()[:1], STEPS, *DEEPSEEK, "per_device_batch_size=8")


def routing_biases(params) -> list[np.ndarray]:
    return [np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
            if jax.tree_util.keystr(path).endswith("['routing_bias']")]


@pytest.mark.parametrize("name", list(MESHES))
def test_deepseek_trains_equal_to_one_device(name, reference):
    got = compiled_steps(jax.devices(), STEPS, *DEEPSEEK, "per_device_batch_size=1", *MESHES[name])
    want = reference.metrics
    assert want["loss"][-1] < want["loss"][0] and want["mtp_loss"][-1] < want["mtp_loss"][0]
    for metric in METRICS:
        np.testing.assert_allclose(got.metrics[metric], want[metric], rtol=1e-5, err_msg=metric)
    # STEPS updates of +-RATE (or 0) each from zero, the same choices on every mesh: the same biases, bit for bit.
    biases = routing_biases(reference.params)
    assert biases and any(np.any(b != 0) for b in biases)
    for bias, got_bias in zip(biases, routing_biases(got.params), strict=True):
        multiples = np.round(bias / RATE)
        assert np.all(np.abs(multiples) <= STEPS)
        np.testing.assert_allclose(bias, multiples * RATE, atol=1e-7)
        np.testing.assert_array_equal(got_bias, bias)
    # Within 2e-5 of each tensor's scale: the ring's blockwise softmax sums in another order (seen: 1.6e-5 on one
    # of 6,144 weights after 4 steps of CP(2)); the metrics above hold at 1e-5.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5 * max(np.abs(b).max(), 1e-3)),
                 got.params, reference.params)
