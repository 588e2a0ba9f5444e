"""pipeline_schedule=1f1b and zero_bubble run MoE layers in their stages: the train step's gradients and MoE sums
equal the one-device unpipelined step's (float32).

A tiny Mixtral-style model (8 experts, top-2, dropless, a balance loss) and a DeepSeek-style one (sigmoid scores,
routing groups, a shared expert, routed_bias, capacity dispatch that drops), both with a dense first layer, on
2 stages x 2 data replicas, M = 4 microbatches (1F1B for one, with expert parallelism 2 inside the stages on 8
devices; zero-bubble for the other, on 4): the gradient of every
parameter (the dense prefix's, run before the stages, included), the loss, the balance loss, the dropped and
routed copies and each layer's routed counts per expert (what the routed_bias update reads).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import packed_batch, micro_config
from maxpar.core.config import model_config
from maxpar.model import Transformer
from maxpar.train import setup_run
from maxpar.training.train_step import _grads

ROWS, LENGTH = 16, 32
MOE = ("model_name=tiny-moe", "dataset_type=synthetic", "num_decoder_layers=3", "first_num_dense_layers=1")
MODELS = {
    "mixtral": ("load_balance_loss_weight=0.1",),
    "deepseek": ("routed_score_func=sigmoid", "routed_bias=true", "n_routing_groups=4", "topk_routing_group=2",
                 "num_shared_experts=1", "moe_mlp_dim=48", "routed_scaling_factor=2.5", "capacity_factor=1.0",
                 "load_balance_loss_weight=0.1"),
}
STAGED = ("ici_stage_parallelism=2", "ici_data_parallelism=2", "ici_fsdp_parallelism=1",
          "num_pipeline_microbatches=4")
MESHES = {"mixtral": ("ici_expert_parallelism=2", "per_device_batch_size=2"), "deepseek": ("per_device_batch_size=4",)}


def make_batch() -> dict[str, np.ndarray]:
    batch = packed_batch(ROWS, LENGTH)
    batch["segment_ids"][::3, -5:] = 0  # padded tails: tokens that neither route nor count
    return batch


def step_grads(config, params):
    """(gradients, sums) of the train step's gradient computation for `config`, on its devices."""
    devices = jax.devices()[:int(ROWS // config.per_device_batch_size)]
    run = setup_run(config, devices)
    fn = jax.jit(lambda p, batch: _grads(p, {}, run.model, batch, config))
    grads, _, sums = fn(jax.device_put(params, run.state_shardings.params),
                        jax.device_put(make_batch(), run.in_sharding))
    return jax.device_get(grads), jax.device_get(sums)


@pytest.fixture(scope="module")
def reference():
    """name -> (float32 parameters, the one-device unpipelined step's gradients and sums), each made once."""
    made = {}

    def get(name: str):
        if name not in made:
            config = micro_config(*MOE, *MODELS[name], "per_device_batch_size=16")
            tokens = jnp.zeros((1, LENGTH), jnp.int32)
            init = jax.jit(Transformer(model_config(config)).init)
            params = nn.unbox(init(jax.random.key(0), tokens, tokens, tokens)["params"])
            made[name] = (params, *step_grads(config, params))
        return made[name]
    return get


@pytest.mark.parametrize("name,kind", [("mixtral", "1f1b"), ("deepseek", "zero_bubble")])
def test_moe_stages_give_the_unpipelined_gradients_and_sums(name, kind, reference):
    params, want, want_sums = reference(name)
    got, sums = step_grads(micro_config(*MOE, *MODELS[name], *STAGED, *MESHES[name], f"pipeline_schedule={kind}"),
                           params)
    assert set(sums) == set(want_sums)
    for key in ("loss_sum", "tokens", "balance_sum", "dropped", "routed"):
        np.testing.assert_allclose(sums[key], want_sums[key], rtol=1e-5, err_msg=key)
    assert want_sums["balance_sum"] > 0 and (want_sums["dropped"] > 0) == (name == "deepseek")
    assert set(sums["expert_routed"]) == {"decoder/layers/moe"}
    np.testing.assert_array_equal(sums["expert_routed"]["decoder/layers/moe"],
                                  want_sums["expert_routed"]["decoder/layers/moe"])
    flat = jax.tree_util.tree_leaves_with_path(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert any("dense_layers" in jax.tree_util.keystr(path) for path, _ in flat)
    for (path, wanted), actual in zip(flat, jax.tree.leaves(got)):
        scale = float(np.max(np.abs(wanted)))
        if "routing_bias" in jax.tree_util.keystr(path):  # moved by the step's update, not by a gradient
            assert scale == 0
            continue
        assert scale > 0, path
        np.testing.assert_allclose(actual, wanted, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def test_the_balance_loss_gradient_reaches_the_routers(reference):
    """The case above would miss a dropped balance-loss gradient too small to see: without the loss the routers'
    gradients differ by far more than its tolerance."""
    params, want, _ = reference("mixtral")
    no_balance, _ = step_grads(micro_config(*MOE, "load_balance_loss_weight=0", "per_device_batch_size=16"), params)
    router, other = want["decoder"]["layers"]["moe"]["router"], no_balance["decoder"]["layers"]["moe"]["router"]
    assert np.max(np.abs(router - other)) > 1e-3 * np.max(np.abs(router))
