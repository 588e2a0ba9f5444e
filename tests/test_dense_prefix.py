"""first_num_dense_layers (DeepSeek-V3's dense prefix): its own stack before the MoE stack, the canonical layout of
both stacks, the planner's count of it, its setup errors, and training equal to one device under FSDP x EP x TP
and a gPipe pipeline, scanned or unrolled, across a checkpoint.

The tiny MoE (configs/models/tiny-moe.yml: 8 experts, top-2) at the test shapes, 3 layers: 1 dense, then 2 MoE.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest

from helpers import MICRO, read_metrics, micro_config, write_corpus
from maxpar.core.config import ConfigError, model_config
from maxpar.model import Transformer, stack
from maxpar.plan.__main__ import run as plan_run
from maxpar.train import setup_run, train

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
BASE = str(Path(__file__).resolve().parents[1] / "configs" / "base.yml")
PREFIX = ["model_name=tiny-moe", "num_decoder_layers=3", "first_num_dense_layers=1"]
# (devices, overrides); every mesh sees the same 8-row global batch.
ONE = (1, ["per_device_batch_size=8"])


def abstract_params(*overrides: str):
    config = micro_config(*PREFIX, *overrides)
    tokens = jax.ShapeDtypeStruct((1, config.max_target_length), np.int32)
    boxed = jax.eval_shape(Transformer(model_config(config)).init, jax.random.key(0), tokens, tokens, tokens)
    return config, nn.unbox(boxed["params"])


def test_the_dense_prefix_is_a_stack_of_its_own_before_the_moe_stack():
    _, scanned = abstract_params()
    decoder = scanned["decoder"]
    assert set(decoder) == {"dense_layers", "layers"}
    assert decoder["dense_layers"]["mlp"]["wi_gate"].shape == (1, 64, 128)      # mlp_dim, 1 layer
    assert "moe" not in decoder["dense_layers"] and "mlp" not in decoder["layers"]
    assert decoder["layers"]["moe"]["wi_gate"].shape == (2, 8, 64, 128)         # 2 MoE layers of 8 experts
    _, unrolled = abstract_params("scan_layers=false")
    assert set(unrolled["decoder"]) == {"dense_layers_0", "layers_0", "layers_1"}


def test_both_stacks_have_one_canonical_layout():
    config, scanned = abstract_params("num_decoder_layers=5", "num_pipeline_repeats=2", "ici_stage_parallelism=2")
    model = model_config(config)
    assert scanned["decoder"]["layers"]["moe"]["wo"].shape == (2, 2, 8, 128, 64)  # circular: [R, L/R, ...]
    assert scanned["decoder"]["dense_layers"]["mlp"]["wo"].shape == (1, 128, 64)  # the prefix: no repeats
    trees = jax.tree.map(lambda a: np.arange(a.size, dtype=np.float32).reshape(a.shape), scanned)
    canonical = stack.to_canonical(trees, model, stack=np.stack)
    assert canonical["decoder"]["layers"]["moe"]["wo"].shape == (4, 8, 128, 64)
    jax.tree.map(np.testing.assert_array_equal, stack.from_canonical(canonical, model), trees)
    unrolled = model_config(micro_config(*PREFIX, "num_decoder_layers=5", "scan_layers=false"))
    units = stack.from_canonical(canonical, unrolled)
    assert sorted(units["decoder"]) == ["dense_layers_0", "layers_0", "layers_1", "layers_2", "layers_3"]
    np.testing.assert_array_equal(units["decoder"]["layers_3"]["moe"]["wo"],
                                  canonical["decoder"]["layers"]["moe"]["wo"][3])
    jax.tree.map(np.testing.assert_array_equal, stack.to_canonical(units, unrolled, stack=np.stack), canonical)


def test_the_planner_counts_the_prefix_as_the_model_has_it():
    _, params = abstract_params()
    result, text, status = plan_run([BASE, *MICRO, *PREFIX, "hardware=tpu-v5p", "num_devices=8",
                                     "ici_expert_parallelism=4", "ici_fsdp_parallelism=2"])
    assert status == 0, text
    counted = result["params"]
    assert counted["total"] == sum(a.size for a in jax.tree.leaves(params))
    assert counted["total"] - counted["active"] == 2 * 3 * 6 * 64 * 128   # 6 of 8 experts idle in 2 MoE layers
    assert counted["mlp"] == 3 * 64 * 128 + 2 * 64 * 8                     # the prefix's MLP, 2 routers


@pytest.mark.parametrize("overrides, match", [
    (["first_num_dense_layers=3"], "at least one MoE layer"),
    (["model_name=", "first_num_dense_layers=1"], "every layer is dense already"),
    (["num_decoder_layers=4", "moe_layer_interval=2"], "does not divide the 3 layers after first_num_dense_layers=1"),
    (["num_decoder_layers=4", "ici_stage_parallelism=2", "ici_fsdp_parallelism=4"], "= 3 pipelined layers"),
])
def test_bad_prefixes_are_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        setup_run(micro_config(*PREFIX, *overrides), jax.devices())


# ---------------------------------------------------------------- training: per-step losses and a checkpoint

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def train_losses(run_dir, corpus, mesh, *extra) -> list[float]:
    devices, overrides = mesh
    config = micro_config(*PREFIX, "steps=4", "dataset_type=text", f"dataset_path={corpus}", "eval_fraction=0",
                         *overrides, *extra)
    train(config, devices=jax.devices()[:devices], run_dir=run_dir)
    return [row["loss"] for row in read_metrics(run_dir)]


def test_a_prefix_checkpoint_saved_scanned_resumes_unrolled(tmp_path, corpus):
    """Sharded and pipelined runs of a model with a prefix equal one device in tests/test_deepseek_parallel.py;
    here: saved scanned at step 2, resumed unrolled, steps 3 and 4 repeat the scanned run's losses."""
    saved = tmp_path / "saved"
    one = train_losses(saved, corpus, ONE, "enable_checkpointing=true", "checkpoint_period=2",
                       "max_checkpoints_to_keep=0")
    assert len(one) == 4 and one[-1] < one[0]  # it is really training
    resumed = tmp_path / "resumed"
    shutil.copytree(saved / "checkpoints" / "2", resumed / "checkpoints" / "2")
    np.testing.assert_allclose(train_losses(resumed, corpus, ONE, "enable_checkpointing=true", "scan_layers=false"),
                               one[2:], rtol=1e-5)
