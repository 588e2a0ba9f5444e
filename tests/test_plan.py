"""maxpar.plan without compiling: hardware profiles, the seeds' worked numbers, plans, recommendations, the CLI."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from maxpar.core.config import ConfigError, load_config
from maxpar.io.metrics import peak_flops
from maxpar.plan import rooflines
from maxpar.plan.__main__ import main, resolve_target
from maxpar.plan.comms import expert_all_to_all_bytes
from maxpar.plan.hardware import (HARDWARE_DIR, available, ici_axis_shares, load_hardware, slice_shape_exists,
                                  torus_shape)
from maxpar.plan.predict import Target, evaluate, make_plan
from maxpar.plan.recommend import recommend
from maxpar.plan.report import render_plan
from maxpar.training.train_step import trace_state

REPO = Path(__file__).resolve().parents[1]
BASE = str(REPO / "configs" / "base.yml")
V5P = load_hardware("tpu-v5p")


def config(*overrides: str):
    return load_config([BASE, *overrides])


def plan(*overrides: str, hardware: str = "tpu-v5p", devices: int = 4096, slices: int = 1):
    return make_plan(config(*overrides), Target(load_hardware(hardware), devices, slices))


# The seeds' LLaMA-3 70B, bf16, 8k context; per_device_batch_size fractional as in real pod-scale runs.
LLAMA70 = ("model_name=llama3-70b", "dtype=bfloat16", "weight_dtype=bfloat16", "max_target_length=8192")


# ---------------------------------------------------------------- hardware profiles

def test_every_profile_loads_with_sourced_numbers():
    assert {"tpu-v5e", "tpu-v5p", "tpu-v6e", "h100", "h200"} <= set(available())
    for name in available():
        hw = load_hardware(name)
        # The peak agrees with the table the trainer's MFU uses.
        assert peak_flops(hw.device_kind) == pytest.approx(hw.peak_flops), name
        for line in (HARDWARE_DIR / f"{name}.yml").read_text().splitlines():
            if re.match(r"^[a-z_]+:", line):
                assert re.search(r"#\s*\S", line), f"{name}: no source comment on {line!r}"


def test_bad_profiles_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="available: h100"):
        load_hardware("tpu-v9")
    (tmp_path / "broken.yml").write_text("platform: tpu\npeak_flops: -1\n")
    with pytest.raises(ConfigError, match="missing keys"):
        load_hardware("broken", tmp_path)


def test_torus_layout_gives_each_mesh_axis_its_torus_axes():
    assert torus_shape(V5P, 8960) == (16, 20, 28) and torus_shape(V5P, 4096) == (16, 16, 16)
    assert not slice_shape_exists(V5P, 8192)  # 2^13 chips fit no v5p torus within 16x20x28
    names = ("data", "stage", "fsdp", "expert", "tensor")
    shares = ici_axis_shares(V5P, names, {"fsdp": 1024, "tensor": 4}, 4096)
    assert shares["tensor"] == pytest.approx(0.5) and shares["fsdp"] == pytest.approx(2.5)
    assert sum(shares.values()) == pytest.approx(3)  # the seed: M_X + M_Y ~ 3 on a 3D torus
    assert ici_axis_shares(load_hardware("h100"), names, {"fsdp": 4, "tensor": 2}, 8)["fsdp"] == 1.0


# ---------------------------------------------------------------- the seeds' worked numbers

def test_seed_critical_batches_on_v5p():
    alpha = rooflines.network_intensity(V5P.peak_flops, V5P.ici_bandwidth)
    assert alpha == pytest.approx(2550)                                    # "4.59e14 / 1.8e11 = 2550"
    assert rooflines.fsdp_critical_batch(alpha, 3) == pytest.approx(850)   # "scale down to only BS=850"
    assert 850 * 4096 == pytest.approx(3.48e6, rel=1e-3)                  # Q3: FSDP alone needs 3.48M on 16^3
    # Model parallelism: Y < n_axes * F / 2550 -- "~ n_axes * 11" for LLaMA-3 70B, 19-way for F ~ 50k.
    assert int(rooflines.tensor_parallel_limit(28672, alpha, 1)) == 11
    assert int(rooflines.tensor_parallel_limit(50_000, alpha, 1)) == 19
    assert 8 * alpha == pytest.approx(20_400)                              # "required F for 8-way ... 20k"
    # Mixed FSDP + TP: B/N > 2 * 2550^2 / F.
    assert rooflines.mixed_critical_batch(alpha, 32768, 2, 1) == pytest.approx(400, rel=0.01)
    assert rooflines.mixed_critical_batch(alpha, 30_000, 2, 1) == pytest.approx(432, rel=0.01)
    assert rooflines.mixed_critical_batch(alpha, int(2.7 * 5120), 2, 1) == pytest.approx(940, rel=0.01)
    # DCN: per-pod batch > C_pod / W_dcn,pod, "3.8e18 / 5e13 = 76,000" (rounded inputs; the exact
    # v5p numbers, 8960 chips x 4.59e14 over 2240 hosts x 2.5e10, give 73,440).
    assert rooflines.dcn_critical_batch_per_slice(V5P.peak_flops, 8960, V5P.dcn_bandwidth_per_host, 4) == \
        pytest.approx(73_440)
    assert rooflines.dcn_critical_batch_per_slice(4.75e14, 8000, 2.5e10, 4) == pytest.approx(76_000)
    assert rooflines.max_params_pure_dp(96e9) == pytest.approx(9.6e9)      # "about 9B parameters"


def test_seed_optimal_fsdp_split_and_bubbles():
    # "N = 64, B = 48,000, F = 32,768, gives roughly X ~ 13.9" (M_X / M_Y = 2 on a 4x4x4 torus).
    assert rooflines.optimal_fsdp_degree(48_000, 32768, 64, 2, 1) == pytest.approx(13.9, rel=0.02)
    # sharding-strategies.md: gPipe (PP-1)/(M+PP-1); circular (PP-1)/(repeats*M+PP-1).
    assert rooflines.pipeline_bubble(4, 8) == pytest.approx(3 / 11)
    assert rooflines.pipeline_bubble(4, 8, repeats=2) == pytest.approx(3 / 19)
    assert rooflines.pipeline_bubble(1, 8) == 0


def test_seed_parameter_count_of_llama2_13b():
    # Question 1: 3LDF = 8.5e9 (FFW), 4DNHL = 4.2e9 (attention), 2VD = 0.33e9 (vocabulary), 13.1e9 total.
    p = plan("model_name=llama2-13b", devices=64)["params"]
    layers, d, f, n, h, v = 40, 5120, 13824, 40, 128, 32000
    assert p["mlp"] == 3 * layers * d * f == pytest.approx(8.5e9, rel=0.01)
    assert p["attention"] == 4 * d * n * h * layers == pytest.approx(4.2e9, rel=0.01)
    assert p["embedding"] + p["output"] == 2 * v * d
    assert p["total"] == p["mlp"] + p["attention"] + p["embedding"] + p["output"] + p["norm"]
    assert p["total"] == pytest.approx(13.1e9, rel=0.01) and p["active"] == p["total"]


def test_deepseek_v3_preset_is_671b_total_37b_active_without_its_mtp_module():
    """The published DeepSeek-V3 figures (671 B total, 37 B activated per token) exclude the MTP module; counted by
    hand: 61 MLA layers of 187.1 M, 3 dense MLPs of 3 x 7168 x 18432, 58 MoE layers of 257 experts (256 routed +
    1 shared) of 3 x 7168 x 2048 with 9 of them active, routers, two 129280 x 7168 tables."""
    p = plan("model_name=deepseek-v3", devices=256)["params"]
    e, vocab, expert = 7168, 129280, 3 * 7168 * 2048
    attention = e * 1536 + 1536 * 128 * 192 + e * (512 + 64) + 512 * 128 * 256 + 128 * 128 * e
    main_active = 61 * attention + 3 * 3 * e * 18432 + 58 * (9 * expert + 256 * e) + 2 * vocab * e
    main_total = main_active + 58 * 248 * expert
    assert p["attention"] == 62 * attention  # the MTP module's layer is an MLA layer too
    small = 61 * (2 * e + 1536 + 512) + e + 58 * 256  # norms and routing biases
    assert p["total"] - p["mtp"] == main_total + small
    assert p["active"] - p["mtp_active"] == main_active + small
    assert round((p["total"] - p["mtp"]) / 1e9) == 671 and int((p["active"] - p["mtp_active"]) / 1e9) == 37
    assert p["mtp"] - p["mtp_active"] == 248 * expert  # the MTP layer's idle experts


def test_detailed_model_reproduces_the_seed_rules_on_a_seed_like_model():
    # The seed approximates a transformer by its MLP; with a short context and a small vocabulary the
    # real model comes close, and the planner's per-collective critical batches land on the seed's.
    seed_like = (*LLAMA70, "max_target_length=128", "vocab_size=256", "per_device_batch_size=8")
    fsdp = plan(*seed_like)
    (row,) = fsdp["axes"]
    assert row["axis"] == "fsdp" and row["ici_axes_spanned"] == pytest.approx(3)
    assert row["critical_batch_tokens_per_device"] == pytest.approx(850, rel=0.01)
    dp = plan(*seed_like, "ici_data_parallelism=-1", "ici_fsdp_parallelism=1")  # backward all-reduce only
    assert dp["axes"][0]["critical_batch_tokens_per_device"] == pytest.approx(850, rel=0.01)
    mixed = plan(*seed_like, "ici_tensor_parallelism=8")
    critical = {r["axis"]: r["critical_batch_tokens_per_device"] for r in mixed["axes"]}
    # FSDP moves TP-sharded weights: its critical batch drops to alpha / (M_X * Y), M_X = 2.25 axes here.
    assert critical["fsdp"] == pytest.approx(2550 / (2.25 * 8), rel=0.02)
    assert critical["tensor"] == 0  # activations: compute-bound at any batch, or never


# ---------------------------------------------------------------- plans

def test_plan_reports_every_quantity_at_pod_scale():
    result = make_plan(config(*LLAMA70, "per_device_batch_size=0.125", "ici_fsdp_parallelism=512",
                              "ici_tensor_parallelism=8", "remat_policy=full"), Target(V5P, 4096, 1))
    assert result["global_batch_tokens"] == 512 * 8192 and result["tokens_per_device"] == 1024
    assert result["flops_per_step"] == pytest.approx(result["flops_per_token"] * 512 * 8192)
    mem = result["memory_per_device_bytes"]
    assert set(mem) >= {"params", "gradients", "optimizer", "activations", "total", "fits"}
    assert mem["total"] == pytest.approx(sum(mem[k] for k in ("params", "gradients", "optimizer", "activations",
                                                             "gathered_weights")))
    p = result["params"]  # bf16, fully sharded but for the replicated norm scales
    assert mem["params"] == pytest.approx((p["total"] - p["norm"]) * 2 / 4096 + p["norm"] * 2)
    assert mem["optimizer"] == pytest.approx(2 * mem["params"], rel=0.01) and mem["fits"]
    for c in result["comms"]:
        assert set(c) >= {"axis", "network", "collective", "bytes_per_device", "time_s"} and c["time_s"] > 0
    axes = {r["axis"]: r for r in result["axes"]}
    assert set(axes) == {"fsdp", "tensor"}
    # TP per layer: the forward all-reduce of [tokens, emb] bf16 (one 8192-token row per batch shard),
    # 2 (n-1)/n of it per device, 80 layers.
    tp_fwd = next(c for c in result["comms"] if c["pattern"] == "TP MLP output all-reduce (forward)")
    assert tp_fwd["bytes_per_device"] == pytest.approx(80 * 2 * (8192 * 8192 * 2) * 7 / 8)
    assert result["bound"] == "compute" and 0 < result["mfu"] < 1
    assert result["step_time_s"] >= result["compute_time_s"]
    assert result["tensor_parallelism_limit"] == 8  # 16-way cannot split LLaMA-3's 8 kv heads
    assert result["pipeline_bubble"] == 0 and result["bound_reason"].startswith("compute-bound")
    json.dumps(result["rules_of_thumb"])


def test_fractional_batch_that_cannot_shard_is_planned_with_a_warning():
    # 4M tokens on 8,960 chips: 512 rows cannot split over 8,960 / tensor batch shards.
    result = plan(*LLAMA70, f"per_device_batch_size={512 / 8960}", "ici_data_parallelism=35",
                  "ici_fsdp_parallelism=32", "ici_tensor_parallelism=8", devices=8960)
    assert result["global_batch_tokens"] == pytest.approx(512 * 8192)
    assert not result["batch_shardable"] and any("do not split" in w for w in result["warnings"])


def test_communication_bound_and_memory_verdicts():
    tiny_batch = plan(*LLAMA70, "per_device_batch_size=0.015625", "ici_fsdp_parallelism=-1", devices=4096)
    assert tiny_batch["bound"] == "communication" and "fsdp" in tiny_batch["bound_reason"]
    huge = plan(*LLAMA70, "per_device_batch_size=1", "ici_data_parallelism=-1", "ici_fsdp_parallelism=1",
                devices=64)
    assert not huge["memory_per_device_bytes"]["fits"] and "does not fit" in huge["bound_reason"]


def test_multislice_data_parallelism_crosses_dcn_hierarchically():
    result = plan("model_name=llama3-8b", "dtype=bfloat16", "max_target_length=8192", "per_device_batch_size=0.5",
                  "ici_tensor_parallelism=2", "remat_policy=full", hardware="tpu-v5e", devices=512, slices=2)
    dcn = [c for c in result["comms"] if c["network"] == "dcn"]
    assert dcn and {c["axis"] for c in dcn} == {"data"} and {c["collective"] for c in dcn} == {"all-reduce"}
    # Reduce-scatter over ICI first: DCN carries each weight's 1/(ici shards) slice once, 2 (d-1)/d = 1x, in the
    # weights' float32 (XLA:TPU's multi-slice llama3-8b compile sends float32 gradient shards between slices).
    layer_grads = next(c for c in dcn if c["pattern"] == "DP gradient all-reduce")
    matmul = sum(v for k, v in layer_grads["by_weight"].items() if "norm" not in k)
    weights = result["params"]["attention"] + result["params"]["mlp"] + result["params"]["output"]
    assert matmul == pytest.approx(weights * 4 / 256, rel=1e-6)


def test_pipeline_is_predicted_with_its_bubble_and_permutes():
    result = plan(*LLAMA70, "per_device_batch_size=0.5", "ici_stage_parallelism=4", "ici_tensor_parallelism=8",
                  "num_pipeline_microbatches=8", "ici_fsdp_parallelism=-1", devices=4096)
    assert result["pipeline_bubble"] == pytest.approx(3 / 11)
    assert any(c["collective"] == "collective-permute" and c["axis"] == "stage" for c in result["comms"])
    assert result["pipeline"].startswith("gPipe pipeline: S=4 stages, M=8 microbatches")
    assert result["step_time_s"] > sum(result["compute_time_by_phase_s"].values()) / (1 - 3 / 11) * 0.99


def test_expert_axis_of_a_dense_model_acts_as_fsdp_and_the_ep_all_to_all_formula():
    result = plan("model_name=llama3-8b", "dtype=bfloat16", "ici_expert_parallelism=4", "ici_fsdp_parallelism=-1",
                  devices=64)
    assert any(c["axis"] == "fsdp+expert" and c["collective"] == "all-gather" for c in result["comms"])
    # sharding-strategies.md (EP): intensity of an expert matmul vs its all-to-all = mlp dim.
    tokens, emb, k, mlp = 4096, 4096, 2, 14336
    flops = 2 * tokens * k * emb * mlp
    assert flops / expert_all_to_all_bytes(tokens, emb, k, 2) == pytest.approx(mlp)


def test_recommend_ranks_feasible_ready_to_paste_meshes():
    base = config(*LLAMA70, "per_device_batch_size=0.125")
    target = Target(V5P, 4096, 1)
    state = trace_state(base)
    rec = recommend(base, target, state, top=3)
    assert len(rec["best"]) == 3 and rec["feasible"] >= 3
    times = [b["step_time_s"] for b in rec["best"]]
    assert times == sorted(times)
    for best in rec["best"]:
        again = evaluate(config(*LLAMA70, "per_device_batch_size=0.125", *best["overrides"].split()), target, state)
        assert again["step_time_s"] == pytest.approx(best["step_time_s"])
        assert again["memory_per_device_bytes"]["fits"] and again["batch_shardable"]


def test_recommend_considers_the_pipeline_schedules():
    """With stages the search tries each schedule the repeats allow, each ranked by its own prediction: on one mesh
    zero-bubble's bubble is the smallest (faster than 1F1B) and 1F1B's held activations fewer than gPipe's."""
    from maxpar.plan.recommend import candidate_overrides
    target = Target(V5P, 64, 1)
    base = config("model_name=llama3-8b", "dtype=bfloat16", "ici_stage_parallelism=4", "num_pipeline_microbatches=4",
                  "per_device_batch_size=1")
    schedules = {c["pipeline_schedule"] for c in candidate_overrides(base, target, trace_state(base)) if "pipeline_schedule" in c}
    assert schedules == {"gpipe", "1f1b", "zero_bubble"}
    rec = recommend(base, target, trace_state(base), top=200)
    by: dict[str, dict[str, dict]] = {}
    for best in rec["best"]:
        rest, _, kind = best["overrides"].rpartition(" pipeline_schedule=")
        by.setdefault(rest, {})[kind] = best
    same_mesh = [found for rest, found in by.items() if len(found) == 3
                 and "ici_stage_parallelism" not in rest]  # the configured 4 stages (the search tries others too)
    assert same_mesh
    for found in same_mesh:
        assert found["zero_bubble"]["step_time_s"] < found["1f1b"]["step_time_s"]
        assert found["1f1b"]["memory_total_bytes"] < found["gpipe"]["memory_total_bytes"]
    circular = config("model_name=llama3-8b", "dtype=bfloat16", "ici_stage_parallelism=4", "num_pipeline_repeats=2",
                      "num_pipeline_microbatches=8")
    assert {c["pipeline_schedule"] for c in candidate_overrides(circular, target, trace_state(circular))
            if "pipeline_schedule" in c} == {"circular", "interleaved_1f1b"}
    dense = config("model_name=llama3-8b")
    assert all(("pipeline_schedule" in c) == ("ici_stage_parallelism" in c)  # a schedule only with stages
               for c in candidate_overrides(dense, target, trace_state(dense)))


def test_resolve_target_from_config_or_local_devices():
    t = resolve_target(config("hardware=h100", "num_devices=64"), None, None, None)
    assert (t.hardware.name, t.num_devices, t.num_slices) == ("h100", 64, 8)  # 8-GPU NVLink domains
    t = resolve_target(config(), "cpu", 8, 1)
    assert t.hardware.name == "tpu-v5p" and "assumed" in t.note
    assert resolve_target(config(), "TPU v5 lite", 8, 1).hardware.name == "tpu-v5e"
    with pytest.raises(ConfigError, match="max_devices_per_slice"):
        resolve_target(config("hardware=tpu-v5e", "num_devices=512", "num_slices=1"), None, None, None)


# ---------------------------------------------------------------- command line

def test_cli_json_and_errors(capsys):
    args = [BASE, "model_name=llama3-8b", "hardware=tpu-v6e", "num_devices=256", "dtype=bfloat16"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"] == "tpu-v6e" and out["params"]["total"] > 8e9 and "_comms" not in out
    for bad, message in (([*args, "mlp_dimm=3"], "did you mean mlp_dim"), ([*args, "hardware=tpu-v9"], "tpu-v5p"),
                         ([*args, "--top", "x"], "--top"), ([*args, "--dump_hlo", "/tmp/x"], "--verify"),
                         ([*args, "--frobnicate"], "unknown flag")):
        assert main(bad) == 2
        assert message in capsys.readouterr().err


def test_cli_recommends_even_when_the_configured_mesh_cannot_run(capsys):
    # The example: fsdp=-1 over 8,960 chips cannot split emb 8192, but --recommend finds meshes that do.
    status = main([BASE, "model_name=llama3-70b", "hardware=tpu-v5p", "num_devices=8960", "per_device_batch_size=0.5",
                   "--recommend"])
    out = capsys.readouterr().out
    assert status == 0 and "cannot run" in out
    first = re.search(r"^\s+1\s.*?(ici_data_parallelism=\S+ ici_fsdp_parallelism=\S+ ici_tensor_parallelism=\S+ "
                      r".*remat_policy=\S+.*)$", out, re.M)
    assert first, out
    assert math.isfinite(make_plan(config("model_name=llama3-70b", "per_device_batch_size=0.5",
                                          *first.group(1).split()), Target(V5P, 8960, 1))["step_time_s"])


def test_float32_moments_under_bf16_weights_give_the_seeds_ten_bytes_per_parameter():
    # parallelism-basics.md: LLaMA-3 70B, bf16 parameters (2 bytes) and float32 Adam moments (4 + 4 bytes).
    result = plan(*LLAMA70, "max_target_length=4096", "optimizer_state_dtype=float32", devices=8192)
    whole = result["state_bytes"]
    assert whole["params_per_parameter"] == 2 and whole["optimizer_per_parameter"] == pytest.approx(8)
    assert whole["params"] == pytest.approx(141e9, rel=0.01) and whole["optimizer"] == pytest.approx(564e9, rel=0.01)
    mem = result["memory_per_device_bytes"]
    assert mem["optimizer"] == pytest.approx(4 * mem["params"], rel=0.01)
    default = plan(*LLAMA70, "max_target_length=4096", devices=8192)  # '' = weight_dtype: bf16 moments
    assert default["state_bytes"]["optimizer_per_parameter"] == pytest.approx(4)
    assert "optimizer 564 GB (8 bytes per parameter)" in render_plan(result)


def test_zero1_divides_the_moments_by_the_data_degree_and_keeps_dp_bytes():
    # parallelism-basics.md's ZeRO-1 row: optimizer state / N_dp; gradients reduce-scattered and parameters
    # all-gathered: the bytes of DP's all-reduce.
    dp = ("model_name=llama3-8b", "weight_dtype=bfloat16", "optimizer_state_dtype=float32", "max_target_length=4096",
          "per_device_batch_size=1", "ici_data_parallelism=8", "ici_fsdp_parallelism=-1")
    plain, zero = plan(*dp, devices=256), plan(*dp, "shard_optimizer_over_data=true", devices=256)
    mem, mem_zero = plain["memory_per_device_bytes"], zero["memory_per_device_bytes"]
    assert mem_zero["optimizer"] == pytest.approx(mem["optimizer"] / 8, rel=0.01)
    assert mem_zero["params"] == mem["params"] and plain["state_bytes"] == zero["state_bytes"]
    def data_bytes(result, kinds):
        return sum(c["bytes_per_device"] for c in result["comms"] if c["axis"] == "data" and c["collective"] in kinds)
    assert data_bytes(zero, ("all-reduce",)) < data_bytes(plain, ("all-reduce",)) / 100  # only norm-like leftovers
    # The output projection's gradient is reduce-scattered over data and fsdp at once: its data share (half its
    # DP all-reduce's bytes) leaves the data-only collectives.
    output_share = 0.5 * sum(c.bytes_per_device for c in plain.collectives  # one by one, per tensor
                             if c.tensor == "output" and c.axis == "data" and c.collective == "all-reduce")
    assert output_share > 0
    assert data_bytes(zero, ("reduce-scatter", "all-gather", "all-reduce")) + output_share == pytest.approx(
        data_bytes(plain, ("all-reduce",)), rel=0.01)


def test_recommend_considers_context_parallelism_for_long_sequences():
    """At 32k tokens per row the dense scores do not fit; the search offers blockwise attention and CP."""
    base = config("model_name=llama3-8b", "dtype=bfloat16", "max_target_length=32768", "per_device_batch_size=0.25")
    target = Target(V5P, 64, 1)
    rec = recommend(base, target, trace_state(base), top=50)
    assert rec["best"], rec["why_none"]
    assert all("attention=blockwise" in b["overrides"] for b in rec["best"])  # dot_product's seq^2 never fits
    assert any("ici_context_parallelism=" in b["overrides"] for b in rec["best"])
    short = config("model_name=llama3-8b", "dtype=bfloat16", "max_target_length=2048")
    from maxpar.plan.recommend import candidate_overrides
    assert not any("ici_context_parallelism" in c for c in candidate_overrides(short, target, trace_state(short)))


def test_context_parallel_comms_follow_the_seed():
    """CP(8) at 32k, bf16: per layer the k and v all-gathers receive the seed's 4·B·T·KV·D bytes, activations
    carry no seq^2 term, and the seed's intensity T·H/(KV·C) is what attention FLOPs / gathered bytes give."""
    from maxpar.plan.context_comms import cp_intensity
    cfg = ("model_name=llama3-8b", "dtype=bfloat16", "max_target_length=32768", "attention=blockwise",
           "ici_context_parallelism=8", "ici_fsdp_parallelism=-1", "per_device_batch_size=0.125")
    result = plan(*cfg, devices=64)
    c = config(*cfg)
    rows_per_shard = 0.125 * 64 / 8  # the batch is split over fsdp (8) only
    seed_bytes = 4 * rows_per_shard * c.max_target_length * c.num_kv_heads * c.head_dim  # k and v, bf16
    gathered = sum(r["bytes_per_device"] for r in result["comms"]
                   if r["pattern"] in ("CP k all-gather (forward)", "CP v all-gather (forward)"))
    assert gathered == pytest.approx(seed_bytes * 7 / 8 * c.num_decoder_layers)  # ring cost: (n-1)/n received
    attention_flops = 4 * rows_per_shard * c.max_target_length ** 2 * c.num_query_heads * c.head_dim / 8
    assert attention_flops / seed_bytes == pytest.approx(cp_intensity(c.max_target_length, c.num_query_heads,
                                                                      c.num_kv_heads, 8))
    assert result["rules_of_thumb"]["cp_intensity"] == 32768 * 32 / (8 * 8)  # the plan reports it beside C/W
    dense = plan(*cfg[:3], "ici_fsdp_parallelism=-1", "per_device_batch_size=0.125", devices=64)
    assert result["memory_per_device_bytes"]["activations"] < dense["memory_per_device_bytes"]["activations"] / 10


def test_blockwise_attention_is_planned_without_the_masked_half_of_the_scores():
    """dot_product computes the whole score matrix (2x the causal FLOPs MFU counts); blockwise only the blocks on
    and below the diagonal: 1 + block / seq times them."""
    from maxpar.plan.model_math import attention_flops_per_token
    from maxpar.plan.predict import FORWARD, compute_flops
    dense, blockwise = (config("max_target_length=4096", "attention_block_size=512", f"attention={a}")
                        for a in ("dot_product", "blockwise"))
    attention = attention_flops_per_token(dense)
    extra = compute_flops(dense, 1.0)[FORWARD] - compute_flops(blockwise, 1.0)[FORWARD]
    assert extra == pytest.approx(attention * (1 - 512 / 4096) / 3)
    assert any("blockwise attention skips" in a for a in plan("attention=blockwise", devices=4)["assumptions"])


def test_the_planner_reads_parameters_by_the_roles_the_model_declares():
    from maxpar.model.roles import Block, ParamRole, param_role
    from maxpar.plan.predict import plan_layout
    MLA_ROLES = {ParamRole.QUERY_A, ParamRole.QUERY_B, ParamRole.KEY_VALUE_A, ParamRole.KEY_VALUE_B,
                 ParamRole.LATENT_NORM}  # attention_type=mla's, in place of key, value and qk_norm
    assert param_role(("decoder", "layers", "sublayer_1", "moe", "wi_gate")) == ParamRole.EXPERT_GATE
    assert param_role(("decoder", "layers", "attention", "out")) == ParamRole.ATTENTION_OUT
    assert param_role(("output",)) == ParamRole.OUTPUT and param_role(("decoder", "mlp", "bias")) is None
    small = ("emb_dim=64", "num_query_heads=4", "num_kv_heads=2", "head_dim=16", "mlp_dim=128", "vocab_size=264",
             "max_target_length=32", "num_experts=4", "num_experts_per_tok=2", "moe_layer_interval=2",
             "num_decoder_layers=4", "qk_norm=true", "mtp_num_layers=1", "num_shared_experts=1", "routed_bias=true",
             "routed_score_func=sigmoid", "lora_rank=2", "lora_target_roles=[attention_out,expert_up]")  # adapters too
    for extra in ((), ("scan_layers=false", "logits_via_embedding=true")):
        cfg = config(*small, *extra)
        layout = plan_layout(cfg, Target(V5P, 8, 1))  # refuses a parameter whose role or axes are undeclared
        roles = {t.role for t in layout.params()}
        assert roles == set(ParamRole) - MLA_ROLES - ({ParamRole.OUTPUT} if cfg.logits_via_embedding else set())
        assert {t.block for t in layout.params()} >= {Block.ATTENTION, Block.MLP, Block.EXPERTS, Block.NORM}
    mla = plan_layout(config(*small, "attention_type=mla", "qk_norm=false", "q_lora_rank=8"), Target(V5P, 8, 1))
    assert {t.role for t in mla.params()} >= MLA_ROLES


# The tiny DeepSeek model without its experts (context parallelism refuses MoE layers).
DEEPSEEK_DENSE = ("model_name=deepseek-tiny", "num_experts=1", "num_experts_per_tok=1", "n_routing_groups=0",
                  "topk_routing_group=0", "first_num_dense_layers=0", "max_target_length=64")
DEEPSEEK_CP = (*DEEPSEEK_DENSE, "attention=blockwise", "ici_context_parallelism=4", "ici_fsdp_parallelism=-1",
               "per_device_batch_size=1", "dtype=bfloat16")


def test_context_parallelism_under_mla_moves_every_heads_keys_and_values_for_each_layer_and_mtp_module():
    """MLA's k [qk_nope + qk_rope] and v [v_head_dim] are expanded per head from the latent before attention: CP
    gathers H heads of each (num_kv_heads and head_dim are unused), for the stack's layers and each MTP module's."""
    def kv(result, what):
        return sum(r["bytes_per_device"] for r in result["comms"] if r["pattern"] == f"CP {what} all-gather (forward)")
    c = config(*DEEPSEEK_CP)
    local_tokens = 8 / 2 * c.max_target_length / 4  # 8 rows over fsdp (2), a quarter of each row per shard
    layers = c.num_decoder_layers + c.mtp_num_layers
    with_mtp = plan(*DEEPSEEK_CP, devices=8)
    for what, width in (("k", c.qk_nope_head_dim + c.qk_rope_head_dim), ("v", c.v_head_dim)):
        assert kv(with_mtp, what) == pytest.approx(local_tokens * c.num_query_heads * width * 2 * 3 * layers)
    without = plan(*DEEPSEEK_CP, "mtp_num_layers=0", devices=8)
    assert kv(without, "k") == pytest.approx(kv(with_mtp, "k") * c.num_decoder_layers / layers)
    assert with_mtp["rules_of_thumb"]["cp_intensity"] == c.max_target_length / 4  # KV = H


def test_unsharded_weights_are_reduced_over_context_first():
    """A gradient summed over context shards and other batch shards (the norm scales, MLA's latent-side weights):
    the partitioner reduces the context shards' partial sums first, then the rest; never both axes at once."""
    result = make_plan(config(*DEEPSEEK_CP), Target(V5P, 8, 1))
    norm = [c for c in result.collectives if c.tensor == "decoder/layers/attention/key_value_a_norm/scale"
            and c.collective == "all-reduce"]
    assert sorted(c.axis for c in norm) == ["context", "fsdp"]


def test_mtp_modules_and_mla_latents_are_in_the_activation_memory():
    """Each MTP module keeps its layer's activations, its float32 logits and its inputs; MLA's compressed q and kv
    and their normed copies add to a layer's activations."""
    from maxpar.plan.model_math import activation_bytes_per_token, mla_latent_widths, tp_degrees
    from maxpar.plan.predict import plan_layout
    base = (*DEEPSEEK_DENSE, "ici_fsdp_parallelism=-1", "per_device_batch_size=1", "dtype=float32")
    memory = {n: plan(*base, f"mtp_num_layers={n}", devices=8)["memory_per_device_bytes"]["activations"]
              for n in (0, 1, 2)}
    c = config(*base)
    layout = plan_layout(c, Target(V5P, 8, 1))
    tokens = c.max_target_length  # one row per device
    per_module = tokens * (activation_bytes_per_token(c, layout)["none"] + c.vocab_size * 4 + 3 * c.emb_dim * 4)
    assert memory[2] - memory[1] == pytest.approx(per_module)
    assert memory[1] - memory[0] >= per_module  # and its layer's re-run, with the stack's done
    latents, _ = mla_latent_widths(c, tp_degrees(layout))
    assert latents == 2 * c.q_lora_rank + 2 * c.kv_lora_rank + c.qk_rope_head_dim
    gqa = load_config([BASE, "attention_type=gqa"])
    assert mla_latent_widths(gqa, tp_degrees(plan_layout(gqa, Target(V5P, 8, 1)))) == (0.0, 0.0)


def test_a_rematerialized_mtp_layer_of_an_unscanned_model_gathers_its_weights_again():
    """remat's prevent_cse (unscanned layers) keeps the MTP layer's re-run apart from its forward pass: its FSDP
    weights are gathered again in the backward pass; with a scanned stack XLA merges the two."""
    def phases(*extra):
        result = make_plan(config(*DEEPSEEK_CP, "remat_policy=minimal", *extra), Target(V5P, 8, 1))
        return {c.phase for c in result.collectives
                if (c.tensor or "").startswith("mtp/module_1/layer/") and c.collective == "all-gather"}
    assert phases("scan_layers=false") == {"forward", "backward"}
    assert phases() == {"forward"}


# ---------------------------------------------------------------- --recommend over every axis (issue 43)

def test_recommend_finds_deepseek_v3_on_1024_h100_with_experts_and_fsdp_across_nodes():
    """The issue's case (`python -m maxpar.plan configs/base.yml model_name=deepseek-v3 hardware=h100
    num_devices=1024 --recommend`) found nothing: 30 candidates, the ICI data / FSDP / tensor split only. MLA's head
    projections shard over tensor alone and 8 GPUs per node cannot hold the rest: the weights must be sharded across
    nodes (DCN FSDP)."""
    from maxpar.plan.report import render_recommendations
    c = config("model_name=deepseek-v3", "hardware=h100", "num_devices=1024")
    target, state = resolve_target(c, None, None, None), trace_state(c)
    rec = recommend(c, target, state, top=3)
    assert rec["best"] and rec["searched"] < rec["space"]
    best = rec["best"][0]["overrides"]
    assert "dcn_fsdp_parallelism=" in best and "ici_expert_parallelism=" in best, best
    again = evaluate(config("model_name=deepseek-v3", *best.split()), target, state)
    assert again["memory_per_device_bytes"]["fits"] and again["batch_shardable"]
    assert re.search(r"recommended meshes for 1,024 x h100 \([\d,]+ of [\d,]+ candidates planned in [\d.]+ s, \d+ fit",
                     render_recommendations(rec))


def test_the_rules_of_thumb_name_their_source():
    text = render_plan(plan("model_name=llama3-8b", devices=64))
    assert 'rules of thumb from "How to Scale Your Model"' in text and "seed" not in text


def test_recommend_picks_expert_parallelism_for_a_mixture_of_experts():
    c = config("model_name=mixtral-8x7b")
    rec = recommend(c, Target(V5P, 64, 1), trace_state(c), top=3)
    assert all("ici_expert_parallelism=" in b["overrides"] for b in rec["best"]), rec["best"]


def test_recommend_for_a_dense_model_is_no_worse_than_the_ici_split_alone():
    """docs/planning.md's LLaMA-3 70B: the best of the data / FSDP / tensor search stays the best or is beaten."""
    c = config(*LLAMA70, "per_device_batch_size=0.125")
    target, state = Target(V5P, 4096, 1), trace_state(c)
    before = evaluate(config(*LLAMA70, "per_device_batch_size=0.125", "ici_data_parallelism=1",
                             "ici_fsdp_parallelism=512", "ici_tensor_parallelism=8", "remat_policy=minimal"),
                      target, state)
    rec = recommend(c, target, state, top=1)
    assert rec["best"][0]["step_time_s"] <= before["step_time_s"]


def test_the_slices_take_data_then_stages_fsdp_and_experts_and_tensor_stays_in_a_slice():
    from maxpar.plan.recommend import place
    h100 = Target(load_hardware("h100"), 64, 8)
    ici, dcn = place({"data": 2, "fsdp": 8, "tensor": 2, "expert": 2, "stage": 1, "context": 1}, h100)
    assert dcn == {"data": 2, "fsdp": 4, "tensor": 1, "expert": 1, "stage": 1, "context": 1}
    assert ici == {"data": 1, "fsdp": 2, "tensor": 2, "expert": 2, "stage": 1, "context": 1}
    assert place({"data": 1, "fsdp": 1, "tensor": 8, "expert": 8, "stage": 1, "context": 1}, h100) == (
        {"data": 1, "fsdp": 1, "tensor": 8, "expert": 1, "stage": 1, "context": 1},
        {"data": 1, "fsdp": 1, "tensor": 1, "expert": 8, "stage": 1, "context": 1})
    assert place({"data": 1, "fsdp": 1, "tensor": 64, "expert": 1, "stage": 1, "context": 1}, h100) is None
