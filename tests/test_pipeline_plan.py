"""maxpar.plan models the pipeline maxpar runs: bubble with repeats, permutes per iteration, reductions once.

The formulas are checked against hand counts here; `--verify` holds them against the compiled
step on 8 simulated CPU devices (gPipe, circular and 1F1B, mixed with data, fsdp and tensor axes). MoE layers inside
the stages: 1F1B here (DP(4)xPP(2) 1f1b MoE), gPipe in tests/test_plan_verify.py (the DeepSeek model's
PP(2)xEP(2)xFSDP(2): the experts' all-to-alls and gathers per iteration, over expert and fsdp+expert).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import MICRO
from maxpar.core.config import load_config
from maxpar.plan.__main__ import run
from maxpar.plan.hardware import load_hardware
from maxpar.plan.predict import Target, make_plan

REPO = Path(__file__).resolve().parents[1]
BASE = str(REPO / "configs" / "base.yml")
LLAMA70 = ("model_name=llama3-70b", "dtype=bfloat16", "weight_dtype=bfloat16", "max_target_length=8192",
           "per_device_batch_size=0.5", "ici_stage_parallelism=4", "ici_tensor_parallelism=8",
           "ici_fsdp_parallelism=-1")


def plan(*overrides: str, devices: int = 4096) -> dict:
    return make_plan(load_config([BASE, *overrides]), Target(load_hardware("tpu-v5p"), devices, 1))


def comm(result: dict, pattern: str) -> dict:
    return next(c for c in result["comms"] if c["pattern"] == pattern)


@pytest.mark.parametrize("micro,repeats", [(4, 1), (8, 1), (8, 2), (16, 4)])
def test_bubble_and_stage_permutes_follow_the_schedule(micro, repeats):
    result = plan(*LLAMA70, f"num_pipeline_microbatches={micro}", f"num_pipeline_repeats={repeats}")
    iterations = micro * repeats + 3
    assert result["pipeline_bubble"] == pytest.approx(3 / iterations)
    # One permute of a pipeline microbatch's [rows, seq, emb] per iteration each way. The batch
    # (2048 rows) is split over fsdp (4096 / 32 = 128) inside the loop: 16 rows, 16 / M per microbatch.
    rows = 2048 / 128 / micro
    for phase in ("forward", "backward"):
        permute = comm(result, f"PP stage-to-stage collective-permute ({phase})")
        assert permute["count_per_step"] == iterations
        assert permute["bytes_per_device"] == pytest.approx(iterations * rows * 8192 * 8192 * 2)


def test_data_parallel_gradient_reduction_is_counted_once_per_step():
    counts = {}
    for micro in (4, 16):
        result = plan(*LLAMA70, "ici_data_parallelism=2", "ici_fsdp_parallelism=-1", "ici_stage_parallelism=4",
                      f"num_pipeline_microbatches={micro}")
        counts[micro] = {c["pattern"]: c["count_per_step"] for c in result["comms"] if c["axis"] == "data"}
    assert counts[4] == counts[16] and set(counts[4].values()) == {1}


def test_fsdp_gathers_per_iteration_or_once_with_ag_once():
    circular = (*LLAMA70, "num_pipeline_microbatches=8", "num_pipeline_repeats=2")
    per_iteration, once = plan(*circular), plan(*circular, "pipeline_fsdp_ag_once=true")
    gathered = comm(per_iteration, "FSDP weight all-gather (forward)")
    assert gathered["count_per_step"] == pytest.approx((8 * 2 + 3) / 2)  # a block (1/R of the stage) each iteration
    assert comm(once, "FSDP stage-weight all-gather (once per step: pipeline_fsdp_ag_once)")["count_per_step"] == 1
    assert comm(once, "FSDP gradient reduce-scatter")["count_per_step"] == 1
    fsdp = {r["axis"]: r["bytes_per_device"] for r in once["axes"]}["fsdp"]
    assert fsdp < {r["axis"]: r["bytes_per_device"] for r in per_iteration["axes"]}["fsdp"] / 5
    # ... for the whole stage's weights kept gathered through the loop.
    assert once["memory_per_device_bytes"]["gathered_weights"] > 4 * per_iteration["memory_per_device_bytes"][
        "gathered_weights"]


SMALL = [*MICRO, "num_decoder_layers=4", "per_device_batch_size=4", "dtype=bfloat16", "hardware=tpu-v5p"]
VERIFIED = {
    "DP(2)xPP(2)xTP(2) circular": ["ici_data_parallelism=2", "ici_fsdp_parallelism=1", "ici_tensor_parallelism=2",
                                   "ici_stage_parallelism=2", "num_pipeline_repeats=2", "num_pipeline_microbatches=4"],
    "FSDP(2)xPP(4) gPipe ag_once": ["ici_fsdp_parallelism=2", "ici_stage_parallelism=4",
                                    "num_pipeline_microbatches=8", "pipeline_fsdp_ag_once=true"],
    # Two permutes per tick, the head's gradients moved from the last stage, the input's cotangent an all-to-all;
    # under FSDP each tick's switch runs one op's gathers (B's twice: its forward is recomputed) and the head's
    # at the last stage's F ops. float32: bfloat16's XLA:CPU temporaries are a known misprediction under FSDP.
    "DP(2)xFSDP(2)xPP(2) 1f1b": ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_stage_parallelism=2",
                                 "num_pipeline_microbatches=4", "pipeline_schedule=1f1b", "dtype=float32"],
    # MoE stages: the balance loss's forward-only pass adds its permutes; the executor's psum reduces the experts.
    "DP(4)xPP(2) 1f1b MoE": ["ici_data_parallelism=4", "ici_fsdp_parallelism=1", "ici_stage_parallelism=2",
                             "num_pipeline_microbatches=4", "pipeline_schedule=1f1b", "num_experts=4",
                             "num_experts_per_tok=2", "capacity_factor=0", "load_balance_loss_weight=0.01"],
}


@pytest.mark.parametrize("name", list(VERIFIED))
def test_verify_passes_for_pipelines(name):
    result, text, status = run([BASE, *SMALL, *VERIFIED[name], "--verify"])
    v = result["verify"]
    assert status == 0 and v["passed"], text
    ok = {(b["axis"], b["collective"]) for b in v["buckets"] if b["status"] == "ok"}
    assert ("stage", "collective-permute") in ok, text
    stage = [b for b in v["buckets"] if b["axis"] == "stage" and b["collective"] in ("all-gather", "all-reduce")]
    assert len(stage) == 2 and all(abs(b["error"]) <= 0.1 for b in stage), text  # small, so maybe 'negligible'
    if "FSDP" in name:
        assert {("fsdp", "all-gather"), ("fsdp", "all-reduce")} <= ok, text
    assert all(b["status"] != "MISMATCH" for b in v["buckets"])


def gathered_ratio(a: dict, b: dict) -> float:
    return a["memory_per_device_bytes"]["gathered_weights"] / b["memory_per_device_bytes"]["gathered_weights"]


def test_per_repeat_gathers_sit_between_the_default_and_ag_once():
    # With R = 4 repeats a window's two blocks are half the stage's stack (with R = 2, all of it: ag_once's memory).
    circular = (*LLAMA70, "num_pipeline_microbatches=8", "num_pipeline_repeats=4")
    default, once = plan(*circular), plan(*circular, "pipeline_fsdp_ag_once=true")
    per_repeat = plan(*circular, "pipeline_fsdp_ag_per_repeat=true")
    # 2R blocks (1/R of the stage each) per pass: the first and last windows one repeat's, the others two.
    assert comm(per_repeat, "FSDP stage-block all-gather (per repeat, forward)")["count_per_step"] == 8
    assert 0.5 < gathered_ratio(per_repeat, once) < 0.6  # half the stacked weights, and the same top-level ones
    def fsdp_bytes(result):
        return {r["axis"]: r["bytes_per_device"] for r in result["axes"]}["fsdp"]
    def gathered(result):
        return result["memory_per_device_bytes"]["gathered_weights"]
    assert fsdp_bytes(once) < fsdp_bytes(per_repeat) < fsdp_bytes(default)
    assert gathered(default) < gathered(per_repeat) < gathered(once)


def test_verify_per_repeat_gathers_match_the_compiled_collectives():
    # PP(2)xFSDP(4) circular: each window's gathers and the rematerialized forward's permutes are counted
    # exactly; XLA:CPU's temporaries are a named known misprediction.
    result, text, status = run([BASE, *MICRO, "num_decoder_layers=4", "per_device_batch_size=1", "hardware=tpu-v5p",
                                "ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_repeats=2",
                                "num_pipeline_microbatches=2", "pipeline_fsdp_ag_per_repeat=true", "--verify"])
    v = result["verify"]
    assert all(b["status"] in ("ok", "negligible") for b in v["buckets"]), text
    assert {("fsdp", "all-gather"), ("stage", "collective-permute")} <= {
        (b["axis"], b["collective"]) for b in v["buckets"] if b["status"] == "ok"}, text
    assert any("pipeline_fsdp_ag_per_repeat" in n for n in v["notes"]), text

