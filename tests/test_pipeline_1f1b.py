"""pipeline_schedule=1f1b and zero_bubble: the explicit-backward executor gives the unpipelined model's gradients
and training.

Gradient level: every parameter's gradient of the summed cross-entropy, by the executor on 8 simulated devices
(stages x data), equals jax.grad of the one-device unpipelined model (float32), (S, M) = (4, 8); and at
S = 2 with data, FSDP and tensor parallelism inside the stages, remat policies and both pipeline_fsdp_ag_* modes; with an
MTP module in the loss head (the gradient of loss + weight x MTP loss, and mtp_sum) at S = 2 x data and x FSDP.
Training level: 4 steps of the trainer's compiled step under gradient accumulation (tests/helpers.compiled_steps)
have the one-device step's per-step losses and gradient norms (rtol 1e-5), one run per schedule (1F1B at S=4 x data,
zero-bubble at S=2 x FSDP x tensor), so the optimizer and the accumulation loop see both schedules and both S; the
run header (printed without training) names each schedule. `maxpar.train`'s loop under 1F1B: docs/pipelines.md's
runnable block (tests/test_docs.py).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import compiled_steps, micro_config, one_device_steps, packed_batch
from maxpar.core.config import ConfigError, model_config
from maxpar.core.layout import spec_axes
from maxpar.core.op_schedule import OpSchedule
from maxpar.model import Transformer
from maxpar.model.mtp import with_mtp_targets
from maxpar.model.staged import staged_grads
from maxpar.plan.hardware import load_hardware
from maxpar.plan.predict import Target, make_plan
from maxpar.pipeline.one_f_one_b import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHTS, FORWARD, FORWARD_HEAD, IDLE,
                                         program)
from maxpar.train import print_header, setup_run
from maxpar.training.summary import unstaged_keys
from maxpar.training.train_step import BATCH_KEYS, objective, train_step

KINDS = ("1f1b", "zero_bubble")  # the schedules maxpar.pipeline.one_f_one_b runs
LAYERS, ROWS, LENGTH = 4, 16, 32  # 1 layer per stage at S = 4: the least that compiles
BASE = ("dataset_type=synthetic", f"num_decoder_layers={LAYERS}", "per_device_batch_size=2")


def stages_and_data(stages: int, microbatches: int, *more: str) -> tuple[str, ...]:
    return (f"ici_stage_parallelism={stages}", f"ici_data_parallelism={8 // stages}", "ici_fsdp_parallelism=1",
            f"num_pipeline_microbatches={microbatches}", "pipeline_schedule=1f1b", *more)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (4, 16), (3, 5)])
def test_program_branches_follow_the_table_and_stores_hold_at_most_s_microbatches(kind, stages, microbatches):
    schedule = OpSchedule(kind, stages, microbatches)
    prog = program(schedule)
    ops = {"F": {FORWARD, FORWARD_HEAD}, "B": {BACKWARD if kind == "1f1b" else BACKWARD_INPUT},
           "W": {BACKWARD_WEIGHTS}}
    assert prog.branch.shape == (schedule.num_ticks, stages)
    assert (prog.branch == IDLE).sum() == schedule.num_ticks * stages - len(schedule.ops())
    assert FORWARD_HEAD in prog.branch[:, -1] and FORWARD_HEAD not in prog.branch[:, :-1]
    for op in schedule.ops():
        assert prog.microbatch[op.tick, op.stage] == op.microbatch
        assert prog.branch[op.tick, op.stage] in ops[op.kind]
    assert prog.act_slots <= stages and prog.cot_slots <= stages  # 1F1B's memory bound: S, not M
    assert FORWARD in prog.branch or stages == 1


def make_batch() -> dict[str, np.ndarray]:
    return packed_batch(ROWS, LENGTH)


def summed_loss(logits, targets, segment_ids):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    total = jnp.sum(jnp.where(segment_ids != 0, losses, 0.0))
    return total, {"loss_sum": total}


@pytest.fixture(scope="module")
def reference():
    """Float32 parameters, and the one-device unpipelined model's summed loss and gradients."""
    model = Transformer(model_config(micro_config(*BASE)))
    tokens = jnp.zeros((1, LENGTH), jnp.int32)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens, tokens, tokens)["params"])

    def loss(p, batch):
        logits = model.apply({"params": p}, batch["inputs"], batch["positions"], batch["segment_ids"])
        return summed_loss(logits, batch["targets"], batch["segment_ids"])[0]
    value, grads = jax.jit(jax.value_and_grad(loss))(params, make_batch())
    return params, float(value), jax.device_get(grads)


# S = 4 here; S = 2 (M = 4) x data: the MTP test's 1F1B case (every gradient, with an MTP head) and the zero-bubble
# cases with data x tensor and data x FSDP inside the stages below.
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stages,microbatches", [(4, 8)])
def test_gradients_equal_the_unpipelined_model(kind, stages, microbatches, reference):
    params, want_loss, want = reference
    config = micro_config(*BASE, *stages_and_data(stages, microbatches, f"pipeline_schedule={kind}"))
    run = setup_run(config, jax.devices())
    schedule = OpSchedule(kind, stages, microbatches)
    step = jax.jit(lambda p, b: staged_grads(model_config(config), run.model.layout, schedule, p, b, summed_loss))
    sums, got = step(jax.device_put(params, run.state_shardings.params), jax.device_put(make_batch(), run.in_sharding))
    assert_reference_gradients(sums, got, want_loss, want)


def assert_reference_gradients(sums, got, want_loss, want, leaves=12):
    np.testing.assert_allclose(float(sums["loss_sum"]), want_loss, rtol=1e-6)
    flat_want = jax.tree_util.tree_leaves_with_path(want)
    assert jax.tree.structure(got) == jax.tree.structure(want) and len(flat_want) == leaves
    for (path, wanted), actual in zip(flat_want, jax.tree.leaves(got)):
        scale = float(np.max(np.abs(wanted)))
        assert scale > 0, path
        np.testing.assert_allclose(np.asarray(actual), wanted, rtol=1e-5, atol=1e-5 * scale,
                                   err_msg=jax.tree_util.keystr(path))


MTP = ("mtp_num_layers=1", "mtp_loss_scaling_factor=0.3")


@pytest.fixture(scope="module")
def mtp_reference():
    """A tiny dense model with one MTP module: float32 parameters, a `with_mtp_targets` batch, and the one-device
    unpipelined train step's objective (loss + 0.3 x MTP loss), its sums and its gradients."""
    config = micro_config(*BASE, *MTP)
    model = Transformer(model_config(config))
    tokens = jnp.zeros((1, LENGTH), jnp.int32)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens, tokens, tokens)["params"])
    batch = with_mtp_targets(make_batch(), 1)
    step = jax.jit(jax.value_and_grad(partial(objective, model=model, config=config), has_aux=True))
    (_, sums), grads = step(params, {}, batch)
    return params, batch, jax.device_get(sums), jax.device_get(grads)


@pytest.mark.parametrize("kind,overrides", [("1f1b", ()),
                                             ("zero_bubble", ("ici_data_parallelism=1", "ici_fsdp_parallelism=4"))])
def test_mtp_gradients_equal_the_unpipelined_model(kind, overrides, mtp_reference):
    """The last stage's loss head runs the MTP module on the future tokens' embeddings: every gradient (the table's
    sums the lookup's, the output head's and the MTP lookup's parts) and mtp_sum equal the unpipelined model's,
    at S = 2 x data and S = 2 x FSDP (the head's weights split over FSDP inside the last stage)."""
    params, batch, want_sums, want = mtp_reference
    config = micro_config(*BASE, *MTP, *stages_and_data(2, 4, f"pipeline_schedule={kind}"), *overrides)
    run = setup_run(config, jax.devices())
    step = jax.jit(lambda p, b: staged_grads(model_config(config), run.model.layout, OpSchedule(kind, 2, 4), p, b,
                                             summed_loss, mtp_weight=config.mtp_loss_scaling_factor))
    sums, got = step(jax.device_put(params, run.state_shardings.params), jax.device_put(batch, run.in_sharding))
    assert want_sums["mtp_sum"] > 0
    np.testing.assert_allclose(float(sums["mtp_sum"]), want_sums["mtp_sum"], rtol=1e-5)
    assert_reference_gradients(sums, got, float(want_sums["loss_sum"]), want, leaves=25)


# S = 2 stages x FSDP / tensor parallelism inside them (the executor's shard_map leaves those axes automatic),
# under remat policies and both pipeline_fsdp_ag_* modes, one compile each: (schedule, the executor's manual batch
# axes of degree > 1, the mesh axes of the stage weights' gradients, overrides).
INSIDE = {
    "1f1b fsdp x tensor": ("1f1b", (), {"stage", "fsdp", "tensor"},
                           ("ici_data_parallelism=1", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")),
    "zero_bubble data x tensor remat=full": ("zero_bubble", ("data",), {"stage", "tensor"},
                                             ("ici_data_parallelism=2", "ici_tensor_parallelism=2",
                                              "remat_policy=full")),
    # gathered before the executor: fsdp is a replica axis there, the gradients are reduced once, after it
    "1f1b fsdp x tensor ag_once": ("1f1b", ("fsdp",), {"stage", "tensor"},
                                   ("ici_data_parallelism=1", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                                    "pipeline_fsdp_ag_once=true")),
    "zero_bubble data x fsdp ag_per_repeat remat=minimal": ("zero_bubble", ("data",), {"stage", "fsdp"},
                                                            ("ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                                                             "pipeline_fsdp_ag_per_repeat=true",
                                                             "remat_policy=minimal")),
}


@pytest.mark.parametrize("case", list(INSIDE))
def test_gradients_with_fsdp_and_tensor_parallelism_inside_the_stages(case, reference):
    """The unpipelined gradients, and the stage weights' gradients leave the executor as split as the weights
    (FSDP keeps its memory saving), but under pipeline_fsdp_ag_once."""
    params, want_loss, want = reference
    kind, manual, grad_axes, overrides = INSIDE[case]
    config = micro_config(*BASE, *stages_and_data(2, 4, f"pipeline_schedule={kind}"), *overrides)
    run = setup_run(config, jax.devices())
    sizes = run.model.layout.mesh.sizes
    assert tuple(a for a in run.model.layout.pipeline.executor.batch_axes if sizes[a] > 1) == manual
    step = jax.jit(lambda p, b: staged_grads(model_config(config), run.model.layout, OpSchedule(kind, 2, 4), p, b,
                                             summed_loss))
    sums, got = step(jax.device_put(params, run.state_shardings.params), jax.device_put(make_batch(), run.in_sharding))
    assert_reference_gradients(sums, got, want_loss, want)
    assert {a for g in jax.tree.leaves(got["decoder"]) for a in spec_axes(g.sharding.spec)} == grad_axes


# ---------------------------------------------------------------- training

STEPS = 4  # the trainer's compiled step on one fixed batch: steps 3-4 start from updated parameters
# Accumulation runs the executor once per accumulation microbatch: 2 x 16 rows per step on every mesh (one device: 2 x 16).
# The zero-bubble run splits its stages over FSDP x tensor parallelism too.
SCHEDULES = {"1f1b_s4_m4": ("1f1b", 4, 4, ()),
             "zero_bubble_s2_m4_fsdp_tensor": ("zero_bubble", 2, 4, ("ici_data_parallelism=1", "ici_fsdp_parallelism=2",
                                                                     "ici_tensor_parallelism=2"))}
RUNS = {name: stages_and_data(s, m, f"pipeline_schedule={kind}", "gradient_accumulation_steps=2", *more)
        for name, (kind, s, m, more) in SCHEDULES.items()}
TRAINING = ("num_decoder_layers=4", "gradient_accumulation_steps=2")


def run_header(*overrides: str) -> str:
    """The run header `maxpar.train` prints for the micro model under `overrides` on the 8 devices (no training;
    synthetic data: the default text dataset would read and tokenize the standard library's files first)."""
    lines: list[str] = []
    config = micro_config(*TRAINING, "dataset_type=synthetic", *overrides)
    print_header(setup_run(config, jax.devices()), Path("run"), None, lines.append)
    return "\n".join(lines)


def test_run_header_prints_the_op_schedule():
    assert ("1f1b pipeline: S=4 stages, M=4 microbatches, 14 ticks (a block's forward or backward each); "
            "bubble 42.9% = (S-1)/(M+S-1); at most 4 of the M stage inputs held per stage"
            ) in run_header("per_device_batch_size=2", *RUNS["1f1b_s4_m4"])
    assert (OpSchedule("zero_bubble", 2, 4).describe()
            in run_header("per_device_batch_size=2", *RUNS["zero_bubble_s2_m4_fsdp_tensor"]))


@pytest.mark.parametrize("name", list(RUNS))
def test_training_has_the_unpipelined_losses_and_gradient_norms(name):
    """The trainer's compiled step (optimizer, accumulation loop, executor) against the one-device run's."""
    reference = one_device_steps(STEPS, *TRAINING, "per_device_batch_size=16").metrics
    got = compiled_steps(jax.devices(), STEPS, *TRAINING, "per_device_batch_size=2", *RUNS[name]).metrics
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], reference[key], rtol=1e-5, err_msg=key)
    assert reference["loss"][-1] < reference["loss"][0]


@pytest.mark.parametrize("schedule,explicit", [("1f1b", True), ("zero_bubble", True), ("auto", False)])
def test_the_train_step_takes_its_gradients_from_the_executor_only_under_1f1b(schedule, explicit):
    """The executor's ppermutes (the gPipe loop moves activations with jnp.roll) are in the step only under the
    schedules with an explicit backward."""
    config = micro_config(*BASE, *stages_and_data(2, 4), f"pipeline_schedule={schedule}")
    run = setup_run(config, jax.devices())
    batch = {k: jax.ShapeDtypeStruct((ROWS, LENGTH), jnp.int32) for k in BATCH_KEYS}
    step = partial(train_step, model=run.model, tx=run.tx, config=config)
    assert ("ppermute" in str(jax.make_jaxpr(step)(run.layout.state.abstract, batch))) == explicit


def test_the_plan_predicts_1f1b_activations_that_shrink_with_m_where_gpipe_keeps_them_all():
    """The planner's memory per schedule, same batch (16 rows per replica): gPipe keeps every microbatch's
    activations until the backward, 1F1B and zero-bubble at most S stage inputs (checked against XLA by
    pipeline_memory.py and `maxpar.plan --verify`). The bubble is (S-1)/(M+S-1) for gPipe and 1F1B, a third of
    the ticks' share for zero-bubble (M >= S)."""
    def planned(schedule: str, micro: int) -> tuple[float, float]:
        config = micro_config("num_decoder_layers=8", "per_device_batch_size=4", "max_target_length=256",
                             *stages_and_data(4, micro, f"pipeline_schedule={schedule}"))
        result = make_plan(config, Target(load_hardware("tpu-v5p"), 8, 1))
        bubble = 3 / (3 * micro + 3) if schedule == "zero_bubble" else 3 / (micro + 3)  # ZB-H1: B and W split
        assert result["pipeline_bubble"] == pytest.approx(bubble)
        return result["memory_per_device_bytes"]["activations"], result["memory_per_device_bytes"]["total"]
    gpipe = {m: planned("gpipe", m) for m in (4, 16)}
    one_f_one_b = {m: planned("1f1b", m) for m in (4, 16)}
    assert one_f_one_b[16][0] < one_f_one_b[4][0] < gpipe[4][0]
    assert one_f_one_b[16][0] < gpipe[16][0] / 2
    assert one_f_one_b[16][1] < gpipe[16][1]
    assert {m: planned("zero_bubble", m) for m in (4, 16)} == one_f_one_b  # ZB-H1 holds 1F1B's S stage inputs


def test_the_sampling_command_of_a_1f1b_run_puts_the_schedule_back():
    """maxpar.generate runs no stages, so the command a run prints resets the pipeline-only keys it set."""
    config = micro_config(*BASE, *stages_and_data(2, 4))
    assert "pipeline_schedule=auto" in unstaged_keys(config)
    assert not any(k.startswith("pipeline_schedule") for k in unstaged_keys(micro_config(*BASE)))


@pytest.mark.parametrize("overrides,message", [
    (("ici_stage_parallelism=2", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "num_experts=3",
      "pipeline_schedule=1f1b"), "num_experts=3 is not divisible by the expert-parallel degree 2"),
    (("ici_stage_parallelism=2", "ici_fsdp_parallelism=2", "num_experts=2", "mtp_num_layers=1",
      "pipeline_schedule=zero_bubble"), "pipeline_schedule=zero_bubble with mtp_num_layers=1 and num_experts=2"),
    (("ici_stage_parallelism=2", "ici_fsdp_parallelism=2", "ici_context_parallelism=2", "attention=blockwise",
      "pipeline_schedule=1f1b"),
     "ici_context_parallelism=2 .* context parallelism with pipeline stages is not supported"),
    (("ici_stage_parallelism=2", "num_pipeline_repeats=2", "pipeline_schedule=1f1b"),
     "pipeline_schedule=1f1b with num_pipeline_repeats=2"),
    (("ici_stage_parallelism=2", "pipeline_schedule=circular"), "pipeline_schedule=circular needs"),
    (("pipeline_schedule=1f1b",), "pipeline_schedule=1f1b need"),
    (("ici_stage_parallelism=2", "pipeline_schedule=interleaved_1f1b"), "pipeline_schedule"),
])
def test_what_1f1b_cannot_run_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        setup_run(micro_config(*BASE, *overrides), jax.devices())
