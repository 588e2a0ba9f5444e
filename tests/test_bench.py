"""The benchmark's plumbing (settings, XLA flag sets, worker, outputs); its timings are never asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from maxpar.tools import bench, bench_gpu
from maxpar.tools.bench_report import GPU_COLUMNS, markdown_table


def test_settings_parse_into_overrides_and_flag_sets():
    assert bench_gpu.parse_setting("base") == ([], [])
    assert bench_gpu.parse_setting("attention=cudnn_flash,remat_policy=full,xla=lhs+cublas") == (
        ["attention=cudnn_flash", "remat_policy=full"], ["lhs", "cublas"])
    for bad, message in (("remat=full", "neither a config key"), ("xla=fast", "unknown XLA flag set"),
                         ("attention", "not key=value")):
        with pytest.raises(ValueError, match=message):
            bench_gpu.parse_setting(bad)
    for setting in bench_gpu.DEFAULT_SETTINGS:  # the built-in sweep is well-formed
        bench_gpu.parse_setting(setting)


def test_setting_env_appends_flags_and_keeps_the_callers():
    env = bench_gpu.setting_env("xla=lhs+cublas,per_device_batch_size=8", {"XLA_FLAGS": "--xla_dump_to=/tmp/x"})
    assert env["XLA_FLAGS"] == ("--xla_dump_to=/tmp/x --xla_gpu_enable_latency_hiding_scheduler=true "
                                "--xla_gpu_enable_triton_gemm=false")
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == bench_gpu.MEMORY_FRACTION
    assert bench_gpu.setting_env("base", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"})[
        "XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"


def _starts(flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_every_xla_flag_exists_in_this_jaxlib():
    """XLA aborts at start-up on an unknown flag (checked with a made-up one), so starting proves they exist."""
    assert _starts("--xla_gpu_made_up_flag_for_this_test=true").returncode != 0
    flags = " ".join(bench_gpu.xla_flags(list(bench_gpu.XLA_FLAG_SETS)))
    done = _starts(flags)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_gpu_smoke_rows_measure_or_say_why_not(tmp_path):
    """The --gpu path end to end on CPU with the smoke shape: a measured row, a refused cuDNN row, outputs."""
    rows = [bench.run_worker(setting, bench_gpu.setting_overrides(setting, smoke=True), 1, steps=1, warmup=1)
            for setting in ("base", "attention=cudnn_flash")]
    measured, refused = rows
    assert measured["tokens_per_step"] == 2 * 128 and measured["tokens_per_s"] > 0
    assert measured["mfu"] is None  # a CPU has no peak FLOP/s to compare with
    assert math.isfinite(measured["final_loss"]) and measured["parameters"] > 0
    assert "needs GPU devices" in refused["refused"]

    table = markdown_table(rows, "header", GPU_COLUMNS)
    assert "| base | 256 |" in table and "| attention=cudnn_flash | not run: attention=cudnn_flash" in table
    bench.write_outputs(tmp_path, table, "header", rows)
    assert (tmp_path / "bench.md").read_text() == table
    assert [r["name"] for r in json.loads((tmp_path / "bench.json").read_text())["results"]] == [
        "base", "attention=cudnn_flash"]
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_llama_1b_preset_is_about_one_billion_parameters():
    from maxpar.core.config import load_config
    from maxpar.model.arithmetic import matmul_params

    config = load_config([str(bench.BASE_CONFIG), *bench_gpu.setting_overrides("base", smoke=False)])
    assert (config.num_decoder_layers, config.emb_dim, config.num_query_heads, config.mlp_dim,
            config.max_target_length) == (16, 2048, 16, 5632, 2048)
    embedding = config.vocab_size * config.emb_dim
    assert 0.9e9 < matmul_params(config) + embedding < 1.1e9  # + the input embedding table
