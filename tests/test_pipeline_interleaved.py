"""pipeline_schedule=interleaved_1f1b: the explicit-backward executor over R blocks per stage gives the unpipelined
model's gradients, on circular's parameter layout.

The executor's program: each op's block, and the slots that carry a block's input from the stage that ran the
previous block (around the ring: stage S - 1 to stage 0 of the next repeat) and its cotangent back. Gradients:
(S, M, R) = (2, 4, 2) and (2, 2, 2) on 8 simulated devices (stages x data, the latter x FSDP), float32, against
jax.grad of the one-device model, its stacked parameters split into circular's [R, L/R, ...] the way checkpoints
convert them.
"""

from __future__ import annotations

import jax
import pytest

from helpers import micro_config
from maxpar.core.config import ConfigError, model_config
from maxpar.core.op_schedule import B, F, OpSchedule
from maxpar.model.stack import from_canonical, to_canonical
from maxpar.model.staged import staged_grads
from maxpar.pipeline.one_f_one_b import BACKWARD, FORWARD, FORWARD_HEAD, program
from maxpar.plan.hardware import load_hardware
from maxpar.plan.predict import Target, make_plan
from maxpar.train import setup_run
from test_pipeline_1f1b import (BASE, assert_reference_gradients, make_batch, reference,  # noqa: F401 - fixture
                                stages_and_data, summed_loss)

KIND = "interleaved_1f1b"


@pytest.mark.parametrize("stages,microbatches,repeats", [(2, 4, 2), (4, 8, 2), (3, 6, 3), (2, 2, 4)])
def test_program_runs_each_ops_block_and_routes_what_it_sends_to_the_next_blocks_slot(stages, microbatches, repeats):
    schedule = OpSchedule(KIND, stages, microbatches, repeats)
    prog = program(schedule)
    blocks = stages * repeats
    at = {(op.kind, op.microbatch, op.block(stages)): op for op in schedule.ops()}
    for (kind, m, v), op in at.items():
        t, s = op.tick, op.stage
        assert (prog.microbatch[t, s], prog.repeat[t, s]) == (m, v // stages)
        want = {F: FORWARD_HEAD if v == blocks - 1 else FORWARD, B: BACKWARD}[kind]
        assert prog.branch[t, s] == want
        if kind == F and v < blocks - 1:  # the receiver stores it where its F of block v + 1 reads it
            nxt = at[(F, m, v + 1)]
            assert prog.act_recv[t, nxt.stage] == prog.act_slot[nxt.tick, nxt.stage] >= 0
        if kind == B and v > 0:
            prev = at[(B, m, v - 1)]
            assert prog.cot_recv[t, prev.stage] == prog.cot_slot[prev.tick, prev.stage] >= 0
    assert (prog.act_recv >= 0).sum() == (prog.cot_recv >= 0).sum() == microbatches * (blocks - 1)
    assert prog.act_slots == max(schedule.peak_in_flight())  # a slot per block input held, no more


@pytest.mark.parametrize("stages,microbatches,repeats,inside", [
    (2, 4, 2, ()), (2, 2, 2, ("ici_fsdp_parallelism=2", "ici_data_parallelism=2"))],
    ids=["s2_m4_r2", "s2_m2_r2_fsdp2"])
def test_gradients_equal_the_unpipelined_model(stages, microbatches, repeats, inside, reference):
    """The second case splits each stage's weights over FSDP inside the executor as well."""
    params, want_loss, want = reference
    config = micro_config(*BASE, *stages_and_data(stages, microbatches, f"pipeline_schedule={KIND}",
                                                 f"num_pipeline_repeats={repeats}"), *inside)
    model = model_config(config)
    run = setup_run(config, jax.devices())
    schedule = OpSchedule(KIND, stages, microbatches, repeats)
    step = jax.jit(lambda p, b: staged_grads(model, run.model.layout, schedule, p, b, summed_loss))
    circular = jax.device_put(from_canonical(params, model), run.state_shardings.params)
    sums, got = step(circular, jax.device_put(make_batch(), run.in_sharding))
    assert_reference_gradients(sums, to_canonical(jax.device_get(got), model), want_loss, want)


@pytest.mark.parametrize("overrides,message", [
    (("ici_stage_parallelism=2", f"pipeline_schedule={KIND}"), f"pipeline_schedule={KIND} needs num_pipeline_repeats"),
    (("ici_stage_parallelism=2", "num_pipeline_repeats=2", "num_pipeline_microbatches=3", f"pipeline_schedule={KIND}"),
     f"pipeline_schedule={KIND} needs num_pipeline_microbatches=3 to be a multiple of the 2 stages"),
])
def test_what_interleaved_cannot_run_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        setup_run(micro_config(*BASE, *overrides), jax.devices())


def test_the_plan_divides_the_bubble_by_about_r_and_keeps_block_inputs_only():
    """S = 4, M = 8, 16 layers: the bubble (S-1)/(RM+S-1), circular's; the activations those of the block inputs
    held (2 (S-1) + (R-1) S + 1 of them) and one block's re-run, far below circular's, which keeps every
    microbatch's."""
    def planned(schedule: str, repeats: int) -> tuple[float, float]:
        config = micro_config("num_decoder_layers=16", "per_device_batch_size=4", "max_target_length=256",
                             *stages_and_data(4, 8, f"pipeline_schedule={schedule}", f"num_pipeline_repeats={repeats}"))
        result = make_plan(config, Target(load_hardware("tpu-v5p"), 8, 1))
        return result["pipeline_bubble"], result["memory_per_device_bytes"]["activations"]
    one_f_one_b, circular = planned("1f1b", 1), planned("circular", 2)
    interleaved = {r: planned(KIND, r) for r in (2, 4)}
    assert (one_f_one_b[0], interleaved[2][0], interleaved[4][0]) == pytest.approx((3 / 11, 3 / 19, 3 / 35))
    assert interleaved[2][0] == pytest.approx(circular[0])
    assert interleaved[2][1] < circular[1] / 4
