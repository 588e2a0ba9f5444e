"""Expert parallelism reproduces one device: outputs, gradients and training losses; all-to-all in the HLO;
checkpoints of MoE runs; the planner's --verify on an expert-parallel mesh; setup-time errors.

The tiny MoE (configs/models/tiny-moe.yml: 8 experts, top-2) at the micro shapes (emb 64, 2 layers, float32). The
training losses are the trainer's compiled step on a fixed batch (`helpers.compiled_steps`) against the one-device
step, which tests/test_context_moe.py shares; DeepSeek-style routing (sigmoid, groups, bias updates, a shared expert)
trains equal to one device, biases and parameters included, in tests/test_deepseek_parallel.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import micro_config, one_device_steps, read_metrics, step_metrics, write_corpus
from maxpar.core.config import ConfigError, model_config
from maxpar.io import checkpoint
from maxpar.model import stack
from maxpar.model.moe import MOE_STATS
from maxpar.plan import hlo
from maxpar.plan.__main__ import run as plan_run
from maxpar.train import setup_run, train
from maxpar.training.train_step import create_state, objective

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
BASE = str(Path(__file__).resolve().parents[1] / "configs" / "base.yml")

MOE = ["model_name=tiny-moe", "dataset_type=synthetic"]
# name -> (devices, overrides); every mesh sees the same 8-row global batch. EP alone at degree 8; EP(2) and EP(4)
# beside fsdp, tensor or data (alone, on 2 and 4 devices, they dispatched as EP(8) does: docs/architecture.md).
MESHES = {
    "ep8": (8, ["ici_expert_parallelism=8", "ici_fsdp_parallelism=1", "per_device_batch_size=1"]),
    "ep4_fsdp2": (8, ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2", "per_device_batch_size=1"]),
    "ep2_fsdp2_tp2": (8, ["ici_expert_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                          "per_device_batch_size=1"]),
    "dp2_ep4": (8, ["ici_data_parallelism=2", "ici_expert_parallelism=4", "ici_fsdp_parallelism=1",
                    "per_device_batch_size=1"]),
}
LOOKUP_ALL_TO_ALL = {"ep4_fsdp2": ("fsdp+expert",)}  # the token lookup's, where not over `expert` alone
ONE = (1, ["per_device_batch_size=8"])


def make_batch(config):
    rng = np.random.default_rng(0)
    shape = (8, config.max_target_length)
    segments = np.ones(shape, np.int32)
    segments[7, 20:] = 0                                   # a padded tail
    segments[3, 10:] = 2                                   # two documents in one row
    positions = np.where(segments == 2, np.arange(shape[1]) - 10, np.arange(shape[1])) * (segments != 0)
    return {"inputs": rng.integers(0, config.vocab_size, shape, dtype=np.int32),
            "targets": rng.integers(0, config.vocab_size, shape, dtype=np.int32),
            "segment_ids": segments, "positions": positions.astype(np.int32)}


def logits_and_grads(mesh: tuple[int, list[str]], params, *extra):
    """(logits, gradients, MoE stats, compiled HLO text) of one batch on a mesh, from host parameters."""
    devices, overrides = mesh
    config = micro_config(*MOE, *overrides, *extra)
    run = setup_run(config, jax.devices()[:devices])
    batch = make_batch(config)

    def step(p, b):
        logits, stats = run.model.apply({"params": p}, b["inputs"], b["positions"], b["segment_ids"],
                                        mutable=[MOE_STATS])
        grads, _ = jax.grad(objective, has_aux=True)(p, {}, b, model=run.model, config=config)
        return logits, grads, stats

    p = jax.device_put(params, run.state_shardings.params)
    b = jax.device_put(batch, run.in_sharding)
    compiled = jax.jit(step).lower(p, b).compile()
    out = jax.device_get(compiled(p, b))
    return (*out, compiled.as_text(), run.mesh)


@pytest.fixture(scope="module")
def params():
    config = micro_config(*MOE, *ONE[1])
    run = setup_run(config, jax.devices()[:1])
    return jax.device_get(create_state(run.model, run.tx, run.layout, run.mesh).params)


@pytest.fixture(scope="module")
def reference(params):
    return {mode: logits_and_grads(ONE, params, f"capacity_factor={cf}")[:3]
            for mode, cf in (("dropless", 0.0), ("capacity", 1.0))}


def all_to_all_axes(text: str, mesh) -> set[str]:
    sizes = dict(mesh.shape)
    return {hlo.label_groups(c, sizes) for c in hlo.collectives(text, mesh.devices.size) if c.kind == "all-to-all"}


@pytest.mark.parametrize("name, mode", [(name, "dropless") for name in MESHES] + [("ep4_fsdp2", "capacity")])
def test_expert_parallel_outputs_and_gradients_equal_one_device(name, mode, params, reference):
    cf = "capacity_factor=1.0" if mode == "capacity" else "capacity_factor=0"
    logits, grads, stats, text, mesh = logits_and_grads(MESHES[name], params, cf)
    want_logits, want_grads, want_stats = reference[mode]
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    # Gradients sum over every token (in another order on another mesh): compare at each array's scale.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(b).max()), grads, want_grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), stats, want_stats)
    # Tokens travel to their experts' devices and back over the expert axis: all-to-all in the compiled step. The
    # token lookup runs on the table's embed shards and moves its rows with an all-to-all over them too: a group of
    # its own where those shards span more than the expert axis.
    assert all_to_all_axes(text, mesh) == {"expert", *LOOKUP_ALL_TO_ALL.get(name, ())}
    if mode == "capacity":
        assert np.sum(stats[MOE_STATS]["decoder"]["layers"]["moe"]["dropped"]) > 0  # the rule bites here


# ---------------------------------------------------------------- training: per-step losses and checkpoints

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def train_losses(run_dir, corpus, mesh, *extra) -> list[dict]:
    devices, overrides = mesh
    config = micro_config("model_name=tiny-moe", "steps=4", "dataset_type=text", f"dataset_path={corpus}",
                         "eval_fraction=0", *overrides, *extra)
    train(config, devices=jax.devices()[:devices], run_dir=run_dir)
    return read_metrics(run_dir)


STEP_METRICS = ("loss", "moe_load_balance_loss", "moe_dropped_tokens", "moe_dropped_fraction")


def assert_same_steps(mesh, capacity_factor: float) -> dict[str, np.ndarray]:
    """4 compiled train steps of `mesh` equal the one-device steps (shared with tests/test_context_moe.py): losses,
    balance losses and dropped copies. Returns the mesh's metrics."""
    devices, overrides = mesh
    want = one_device_steps(4, "per_device_batch_size=8", "model_name=tiny-moe",
                            f"capacity_factor={capacity_factor}").metrics
    got = step_metrics(jax.devices()[:devices], 4, "model_name=tiny-moe", f"capacity_factor={capacity_factor}",
                       *overrides, metrics=STEP_METRICS)
    assert want["loss"][-1] < want["loss"][0]  # it is really training
    for key in STEP_METRICS:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    return got


def test_ep8_training_losses_equal_one_device():
    got = assert_same_steps(MESHES["ep8"], 0.0)
    assert np.all(got["moe_dropped_tokens"] == 0) and np.all((1.9 < got["moe_load_balance_loss"])
                                                             & (got["moe_load_balance_loss"] < 8))


def test_capacity_training_losses_and_drops_equal_one_device():
    got = assert_same_steps(MESHES["ep4_fsdp2"], 1.0)
    assert np.all((0 < got["moe_dropped_fraction"]) & (got["moe_dropped_fraction"] < 1))


def test_moe_checkpoint_saves_on_one_mesh_and_resumes_on_another(tmp_path, corpus):
    """Saved by the trainer on EP(4) x FSDP(2) with a capacity that drops tokens (the step of the capacity test above,
    which the session has compiled), resumed at step 2 on one device with unrolled layers: the experts gathered from
    their shards, steps 3 and 4 repeat the saved run's losses and drops."""
    saved = tmp_path / "saved"
    rows = train_losses(saved, corpus, MESHES["ep4_fsdp2"], "capacity_factor=1.0", "enable_checkpointing=true",
                        "checkpoint_period=2", "max_checkpoints_to_keep=0")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] < rows[0]["loss"]
    assert all(r["moe_dropped_tokens"] > 0 for r in rows)
    resumed = tmp_path / "resumed"
    shutil.copytree(saved / "checkpoints" / "2", resumed / "checkpoints" / "2")
    resumed_rows = train_losses(resumed, corpus, ONE, "capacity_factor=1.0", "enable_checkpointing=true",
                                "scan_layers=false")
    assert [r["step"] for r in resumed_rows] == [3, 4]
    for key in ("loss", "moe_load_balance_loss", "moe_dropped_tokens"):
        np.testing.assert_allclose([r[key] for r in resumed_rows], [r[key] for r in rows[2:]], rtol=1e-5, err_msg=key)


def test_interleaved_moe_layers_have_one_on_disk_layout_scanned_or_unrolled():
    def target(*extra):
        config = micro_config("model_name=tiny-moe", "dataset_type=synthetic", "num_decoder_layers=4",
                             "moe_layer_interval=2", *extra)
        run = setup_run(config, jax.devices())
        return run.restore_target()
    scanned, unrolled = target(), target("scan_layers=false")
    for item in checkpoint.ARRAY_ITEMS:
        assert checkpoint.structure_differences(unrolled.on_disk(item), scanned.on_disk(item)) == []
    layers = scanned.on_disk("params")["decoder"]["layers"]
    assert layers["sublayer_1"]["moe"]["wi_gate"].shape == (2, 8, 64, 128)   # 2 blocks of (dense, MoE)
    # Restoring unstacks the 2 blocks (not 4 layers) into layers_0, layers_1.
    stacked = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), scanned.on_disk("params"))
    unstacked = stack.from_canonical(stacked, model_config(unrolled.config))
    assert set(unstacked["decoder"]) == set(unrolled.abstract_state.params["decoder"]) == {"layers_0", "layers_1"}


# ---------------------------------------------------------------- setup errors and the planner

@pytest.mark.parametrize("overrides, message", [
    (["num_experts=6", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2"],
     "num_experts=6 is not divisible by the expert-parallel degree 4"),
    (["ici_expert_parallelism=2", "ici_fsdp_parallelism=4", "logical_axis_rules=[[activation_batch,[data,fsdp]],"
      "[exp,[expert]],[embed,[fsdp]]]"], "which does not split the tokens"),
])
def test_expert_layouts_the_mesh_cannot_run_fail_at_setup(overrides, message):
    config = micro_config("model_name=tiny-moe", "dataset_type=synthetic", "per_device_batch_size=1", *overrides)
    with pytest.raises(ConfigError, match=message):
        setup_run(config, jax.devices())


def test_plan_verify_passes_for_expert_parallelism_and_counts_active_parameters():
    result, text, status = plan_run([BASE, "model_name=tiny-moe", *[a for a in (
        "emb_dim=64", "num_query_heads=4", "num_kv_heads=2", "head_dim=16", "mlp_dim=128", "num_decoder_layers=2",
        "vocab_size=264", "max_target_length=32", "dtype=float32", "per_device_batch_size=4", "hardware=tpu-v5p",
        "ici_expert_parallelism=4", "ici_fsdp_parallelism=2")], "--verify"])
    assert status == 0 and result["verify"]["passed"], text
    buckets = {(b["axis"], b["collective"]): b for b in result["verify"]["buckets"]}
    a2a = buckets[("expert", "all-to-all")]
    assert a2a["status"] == "ok" and a2a["measured_bytes"] > 0
    assert buckets[("fsdp", "reduce-scatter")]["status"] == "ok"    # the experts' gradients, as written
    params = result["params"]
    assert params["total"] - params["active"] == 2 * 3 * 6 * 64 * 128  # 6 of 8 experts idle, 2 layers, 3 weights


# ---------------------------------------------------------------- DeepSeek-V3-style MoE: the routing bias resumes

DEEPSEEK = ["routed_score_func=sigmoid", "routed_bias=true", "routed_bias_update_rate=0.01", "n_routing_groups=4",
            "topk_routing_group=2", "num_shared_experts=1", "moe_mlp_dim=48", "routed_scaling_factor=2.5"]
def test_routing_bias_resumes_bitwise(tmp_path, corpus):
    def final_bias(run_dir):
        config = micro_config("model_name=tiny-moe", *DEEPSEEK, "dataset_type=text", f"dataset_path={corpus}",
                             "eval_fraction=0", *ONE[1])
        run = setup_run(config, jax.devices()[:1])
        manager = checkpoint.make_manager(run_dir, config)
        try:
            state = checkpoint.resume_step(manager, 4, run.restore_target(), iter(run.train_data))
        finally:
            manager.close()
        return np.asarray(state.params["decoder"]["layers"]["moe"]["routing_bias"])

    saved, resumed = tmp_path / "saved", tmp_path / "resumed"
    rows = train_losses(saved, corpus, ONE, *DEEPSEEK, "enable_checkpointing=true", "checkpoint_period=2",
                        "max_checkpoints_to_keep=0")
    shutil.copytree(saved / "checkpoints" / "2", resumed / "checkpoints" / "2")
    resumed_rows = train_losses(resumed, corpus, ONE, *DEEPSEEK, "enable_checkpointing=true", "checkpoint_period=2")
    assert [r["loss"] for r in resumed_rows] == [r["loss"] for r in rows[2:]]
    bias = final_bias(saved)
    assert np.any(bias != 0)
    np.testing.assert_array_equal(final_bias(resumed), bias)
