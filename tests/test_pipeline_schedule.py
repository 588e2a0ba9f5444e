"""The pipeline schedule on its own (no JAX), and the config errors of impossible pipelines."""

from __future__ import annotations

import itertools

import jax
import pytest

from helpers import micro_config
from maxpar.core.config import ConfigError
from maxpar.core.mesh import resolve_mesh_shape
from maxpar.core.schedule import Schedule, stage_task
from maxpar.train import main, setup_run
from maxpar.training.train_step import run_layout


def simulate(stages: int, microbatches: int, repeats: int, layers: int) -> dict[tuple[int, int], int]:
    """Run the schedule's dataflow symbolically, as maxpar.pipeline.spmd does with arrays.

    A value is the list of layers applied to a microbatch so far. Stage 0 reads its microbatch's
    slot of the buffer; stage s > 0 reads what stage s - 1 passed at the previous iteration; the
    last stage's output lands in the buffer slot of its microbatch. Asserts every block sees
    exactly the layers before it; returns {(microbatch, layer): iteration}.
    """
    per_block = layers // (stages * repeats)
    buffer = [[] for _ in range(microbatches)]
    passed: list[list[int] | None] = [None] * stages
    done: dict[tuple[int, int], int] = {}
    for t in range(microbatches * repeats + stages - 1):
        outputs = []
        for s in range(stages):
            task = stage_task(t, s, microbatches, repeats)
            value = buffer[task.microbatch] if s == 0 else passed[s - 1]
            if not task.active:
                outputs.append(None)
                continue
            block = range((task.repeat * stages + s) * per_block, (task.repeat * stages + s + 1) * per_block)
            assert value == list(range(block.start)), (t, s, task, value)
            for layer in block:
                assert (task.microbatch, layer) not in done
                done[(task.microbatch, layer)] = t
            outputs.append(value + list(block))
        passed = outputs
        last = stage_task(t, stages - 1, microbatches, repeats)
        if last.active:
            buffer[last.microbatch] = passed[-1]
    assert buffer == [list(range(layers))] * microbatches
    return done


CASES = [(s, m, r, s * r * n) for s, r, n in itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2))
         for m in (s, s + 1, 2 * s, 3) if r == 1 or m >= s]


@pytest.mark.parametrize("stages,microbatches,repeats,layers", CASES)
def test_every_microbatch_meets_every_layer_once_in_order(stages, microbatches, repeats, layers):
    done = simulate(stages, microbatches, repeats, layers)
    assert set(done) == set(itertools.product(range(microbatches), range(layers)))
    for m in range(microbatches):  # dependency order: a later block runs at a later iteration
        for layer in range(1, layers):
            same_block = layer % (layers // (stages * repeats)) != 0
            assert done[(m, layer)] >= done[(m, layer - 1)] + (0 if same_block else 1)
    schedule = Schedule(stages, microbatches, repeats, layers)
    busy = [sum(1 for row in schedule.table() if row[s].active) for s in range(stages)]
    assert busy == [microbatches * repeats] * stages
    assert schedule.bubble == pytest.approx(1 - microbatches * repeats / schedule.num_iterations)


def test_circular_with_fewer_microbatches_than_stages_breaks_the_dataflow():
    with pytest.raises(AssertionError):  # stage 0 would start repeat 1 before the microbatch came round
        simulate(stages=4, microbatches=2, repeats=2, layers=8)
    with pytest.raises(ValueError, match="microbatches >= stages"):
        Schedule(4, 2, 2, 8)


def test_circular_assignment_of_the_seed():
    schedule = Schedule(num_stages=4, num_microbatches=8, num_repeats=2, num_layers=24)
    assert list(schedule.layers(0, 0)) == [0, 1, 2] and list(schedule.layers(0, 1)) == [12, 13, 14]
    assert list(schedule.layers(1, 0)) == [3, 4, 5] and list(schedule.layers(1, 1)) == [15, 16, 17]
    assert schedule.assignment().startswith("stage 0: 0-2, 12-14; stage 1: 3-5, 15-17; stage 2: 6-8, 18-20")
    assert schedule.kind == "circular" and schedule.num_iterations == 8 * 2 + 3
    assert schedule.bubble == pytest.approx(3 / 19)
    assert "bubble (S-1)/(R*M+S-1) = 3/19 = 15.8%" in schedule.describe()


def test_gpipe_table():
    table = Schedule(num_stages=2, num_microbatches=3, num_repeats=1, num_layers=4).table()
    assert [[(t.microbatch, t.repeat) if t.active else None for t in row] for row in table] == [
        [(0, 0), None], [(1, 0), (0, 0)], [(2, 0), (1, 0)], [None, (2, 0)]]


# ---------------------------------------------------------------- config errors

@pytest.mark.parametrize("overrides,message", [
    (["ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_repeats=2"],
     r"num_decoder_layers=2 must be divisible by stages x num_pipeline_repeats = 2 x 2 = 4"),
    (["ici_stage_parallelism=4", "ici_fsdp_parallelism=2", "num_decoder_layers=8", "num_pipeline_repeats=2",
      "num_pipeline_microbatches=2"], r"num_pipeline_repeats=2 \(circular\) needs num_pipeline_microbatches >= the 4"),
    (["ici_stage_parallelism=4", "ici_fsdp_parallelism=2"], r"= 4 stage\(s\) exceeds num_decoder_layers=2"),
    (["ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "scan_layers=false"], r"needs scan_layers=true"),
    (["num_pipeline_repeats=2"], r"num_pipeline_repeats=2 need\(s\) pipeline stages"),
    (["num_pipeline_microbatches=4", "pipeline_fsdp_ag_once=true"],
     r"num_pipeline_microbatches=4, pipeline_fsdp_ag_once=True need\(s\) pipeline stages"),
    (["num_decoder_layers=3", "num_pipeline_repeats=2"], r"\(num_decoder_layers=3\) must be divisible by it"),
    (["ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "pipeline_fsdp_ag_once=true",
      "pipeline_fsdp_ag_per_repeat=true"], r"pipeline_fsdp_ag_once=true and pipeline_fsdp_ag_per_repeat=true: choose"),
    (["pipeline_fsdp_ag_per_repeat=true"], r"pipeline_fsdp_ag_per_repeat=True need\(s\) pipeline stages"),
])
def test_impossible_pipelines_fail_before_any_device_is_used(overrides, message):
    """Keys that cannot pipeline on any mesh: refused by the config or, where the stage count matters, by the
    run layout on an abstract mesh."""
    with pytest.raises(ConfigError, match=message):
        config = micro_config(*overrides)
        run_layout(config, resolve_mesh_shape(config, 8))


@pytest.mark.parametrize("overrides,message", [
    (["ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_microbatches=3"],
     r"num_pipeline_microbatches=3 must divide the 8 rows of a step"),
    (["ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_microbatches=4"],
     r"must divide the 2 rows that each of the 4 data-parallel shards .* runs through the pipeline"),
    (["ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "per_device_batch_size=0.5"],
     r"gives 4 rows per microbatch, which the batch-sharding mesh axes .*'stage'\) \(degree 8\)"),
    (["ici_stage_parallelism=-1", "ici_fsdp_parallelism=1"], r"= 8 stage\(s\) exceeds num_decoder_layers=2"),
    (["ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "logical_axis_rules=[[embed,[fsdp]]]"],
     r"map the stacked `layers` axis to no mesh axis; pipelining needs the rule \[layers, \[stage\]\]"),
])
def test_pipelines_that_do_not_fit_the_mesh_fail_at_setup(overrides, message):
    config = micro_config("dataset_type=synthetic", "per_device_batch_size=1", *overrides)
    with pytest.raises(ConfigError, match=message):
        setup_run(config, jax.devices())


def test_cli_exits_2_on_a_pipeline_config_error(capsys):
    assert main(["configs/base.yml", "ici_stage_parallelism=2", "num_pipeline_repeats=4"]) == 2
    assert "num_decoder_layers=4 must be divisible by stages x num_pipeline_repeats = 2 x 4 = 8" in capsys.readouterr().err
