"""The training loop: outputs, metrics, eval, resume, and the command line."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest

from helpers import read_metrics, micro_config, write_corpus
from maxpar.host import malloc
from maxpar.io.metrics import METRIC_KEYS, peak_flops
from maxpar.model.arithmetic import matmul_params, training_flops_per_token
from maxpar.train import train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def text_config(corpus, *overrides):
    return micro_config("dataset_type=text", f"dataset_path={corpus}", "per_device_batch_size=2", *overrides)


# The one-device runs below train 6 steps under a constant schedule after warm-up: `steps` and the schedule are
# constants of the compiled step, so with these keys they share one program (the session's compilation cache).
SIX_STEPS = ("steps=6", "learning_rate_final_fraction=1.0")


def test_outputs_metrics_and_eval(tmp_path, corpus, capsys):
    config = text_config(corpus, "steps=6", "log_period=2", "eval_interval=3", "eval_steps=2", "eval_fraction=0.2",
                         "enable_checkpointing=true", "checkpoint_period=4")
    train(config, devices=jax.devices()[:2], run_dir=tmp_path)
    rows = read_metrics(tmp_path)
    # The end-of-run summary: what was trained, how fast, the final losses, where everything is.
    out = capsys.readouterr().out
    header = out[:out.index("compiled the train step")].splitlines()
    # The header says what the run reads: the source, how many files train and are held out, the tokenizer.
    assert (f"  data text files {corpus}: 10 files for training, 2 for eval; tokenizer byte-level (259 tokens)"
            in header)
    batch = next(line for line in header if line.startswith("  batch "))  # no accumulation, so no microbatch count
    assert batch.startswith("  batch 4 rows x 32 tokens = 128 tokens/step; "), batch
    summary = out[out.index("maxpar: done:"):].splitlines()
    assert re.fullmatch(r"maxpar: done: steps 1-6 \(6\) in [\d.]+ s wall, [\d.]+ s of them training: [\d,]+ tokens/s",
                        summary[0]), summary
    assert summary[1] == f"  final train loss {rows[-1]['loss']:.4f} (step 6), eval loss {rows[-1]['eval_loss']:.4f} (step 6)"
    assert summary[2] == f"  checkpoint: {tmp_path / 'checkpoints' / '6'}"
    assert summary[3].startswith(f"  sample from it: python -m maxpar.generate {tmp_path / 'config.yml'}")
    assert summary[4] == f"  metrics: {tmp_path / 'metrics.jsonl'}; loss curve: {tmp_path / 'loss_curve.png'}"
    assert (tmp_path / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["step"] for r in rows] == [2, 3, 4, 6]  # log steps plus the eval step 3 and the last step
    for row in rows:
        assert tuple(row) == METRIC_KEYS
        assert row["mfu"] is None  # CPU has no known peak
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_s_per_device"] * 2)
    assert [r["eval_loss"] is not None for r in rows] == [False, True, False, True]
    assert all(np.isfinite(r["eval_loss"]) for r in rows if r["eval_loss"] is not None)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_the_batch_line_counts_only_gradient_accumulation_microbatches():
    from maxpar.train import accumulation_words
    assert accumulation_words(1, 64) == ""  # a pipeline's M microbatches are on the pipeline's own line
    assert accumulation_words(4, 16) == " in 4 gradient-accumulation microbatches of 16 rows"


def test_mfu_uses_configured_peak(tmp_path, corpus):
    config = text_config(corpus, *SIX_STEPS, "peak_flops_per_device=1e12")
    row = train(config, devices=jax.devices()[:1], run_dir=tmp_path)
    assert row["mfu"] == pytest.approx(row["tflops_per_device"] * 1e12 / 1e12)
    assert row["tflops_per_device"] == pytest.approx(
        row["tokens_per_s"] * training_flops_per_token(config) / 1e12)


def test_attention_flops_count_the_keys_each_query_attends():
    """Causal: seq/2 keys per query on average; a sliding window of w counts only the keys inside it."""
    def attention_flops(*overrides: str) -> float:
        config = micro_config("max_target_length=64", *overrides)
        return training_flops_per_token(config) - 6 * matmul_params(config)

    per_key = 3 * 2 * 4 * 4 * 16  # (fwd + bwd) x 2 layers x (QK^T + PV: 2 x 2 FLOPs) x 4 heads x head_dim 16
    assert attention_flops() == pytest.approx(per_key * 64 / 2)
    assert attention_flops("sliding_window=64") == attention_flops()  # a window as long as the row changes nothing
    # Query i (1-based) attends min(i, 8) keys: the windowed share of the causal count, within the
    # continuous approximation both use (seq/2 instead of (seq+1)/2).
    exact_share = sum(min(i, 8) for i in range(1, 65)) / sum(range(1, 65))
    assert attention_flops("sliding_window=8") / attention_flops() == pytest.approx(exact_share, rel=0.02)


def test_peak_flops_table():
    assert peak_flops("TPU v5 lite") == 197e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("cpu") is None
    assert peak_flops("cpu", configured=5e11) == 5e11


@pytest.mark.slow
def test_tensorboard_events_are_written_without_loading_torch(tmp_path):
    """tensorboardX would import an installed torch (seconds and hundreds of MB); the writer keeps it out, and the
    process can still import torch afterwards. A fresh interpreter: this one may hold torch already."""
    pytest.importorskip("torch")
    script = (
        "import sys; from pathlib import Path; from maxpar.io.metrics import MetricsWriter\n"
        f"writer = MetricsWriter(Path({str(tmp_path)!r}), enabled=True)\n"
        "writer.write({'step': 3, 'loss': 2.5}); writer.close()\n"
        "print('torch loaded:', 'torch' in sys.modules)\n"
        "import torch; print('torch imports:', hasattr(torch, 'Tensor'))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["torch loaded: False", "torch imports: True"]
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and b"loss" in events[0].read_bytes()


def test_a_step_that_is_only_logged_is_read_after_the_next_is_dispatched(tmp_path, corpus, monkeypatch):
    """The device never waits for the host's logging: step N's metrics are read once step N+1 is queued, except
    where step N's own state is needed (evaluation, a checkpoint) and at the last step."""
    import maxpar.train as train_module
    events = []
    compile_step = train_module.RunSetup.compile_train_step

    def recording_compile(run):
        step_fn = compile_step(run)
        return lambda state, batch: (events.append("run"), step_fn(state, batch))[1]

    metrics_row = train_module._metrics_row
    monkeypatch.setattr(train_module.RunSetup, "compile_train_step", recording_compile)
    monkeypatch.setattr(train_module, "_metrics_row",
                        lambda run, step, *rest: (events.append(f"read {step}"), metrics_row(run, step, *rest))[1])
    config = text_config(corpus, *SIX_STEPS, "log_period=1", "enable_checkpointing=true", "checkpoint_period=3",
                         "eval_fraction=0")
    train(config, devices=jax.devices()[:1], run_dir=tmp_path)
    assert events == ["run", "run", "read 1", "run", "read 2", "read 3",  # step 3 saves: read before step 4 runs
                      "run", "run", "read 4", "run", "read 5", "read 6"]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and all(r["step_time_s"] > 0 for r in rows)


def test_resume_continues_the_same_run(tmp_path, corpus):
    # A constant schedule after warm-up makes the 6-step run's schedule independent of `steps`.
    common = ("checkpoint_period=2", "enable_checkpointing=true", "async_checkpointing=true")
    whole = train(text_config(corpus, *SIX_STEPS, *common), devices=jax.devices()[:1], run_dir=tmp_path / "a")
    train(text_config(corpus, *SIX_STEPS, *common, "steps=4"), devices=jax.devices()[:1], run_dir=tmp_path / "b")
    resumed = train(text_config(corpus, *SIX_STEPS, *common), devices=jax.devices()[:1], run_dir=tmp_path / "b")
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4", "6"]
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert resumed["loss"] == whole["loss"]


@pytest.mark.slow
def test_command_line_training_run(tmp_path, corpus):
    args = [sys.executable, "-m", "maxpar.train", "configs/base.yml", "steps=3", "log_period=1",
            "dataset_type=text", f"dataset_path={corpus}", "enable_checkpointing=false", "eval_interval=0",
            "eval_steps=1", "per_device_batch_size=1",
            "emb_dim=64", "mlp_dim=128", "head_dim=16", "num_decoder_layers=1", "max_target_length=32",
            f"base_output_directory={tmp_path}", "run_name=cli"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parameters" in result.stdout + result.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "cli")] == [1, 2, 3]
    assert "maxpar: done: steps 1-3 (3)" in result.stdout
    assert "checkpoint: none (enable_checkpointing=false)" in result.stdout
    if malloc.on_glibc():  # the trainer's own process keeps XLA:CPU's step buffers mapped
        assert "maxpar: glibc malloc keeps each step's freed buffers mapped" in result.stdout


def test_summary_prints_the_generate_command_of_a_run_with_a_checkpoint(tmp_path):
    from maxpar.training.summary import RunTotals, summary_lines
    run = tmp_path / "run"
    (run / "checkpoints" / "5").mkdir(parents=True)
    (run / "config.yml").write_text("steps: 5\n")
    lines = summary_lines(run, RunTotals(0, 5, 1.0, 1.0, 128), [{"step": 5, "loss": 2.0}], "none", [])
    command = [line for line in lines if "sample from it:" in line]
    assert command == [f"  sample from it: python -m maxpar.generate {run / 'config.yml'} model_name= "
                       f"load_parameters_path={run / 'checkpoints' / '5'} --prompt 'def '"]


@pytest.mark.parametrize("run, devices, slices, platform, added", [
    # One process, no stages: nothing to change (the run's own num_simulated_devices=8 stays).
    (["num_simulated_devices=8", "ici_tensor_parallelism=2"], 8, 1, "cpu", []),
    # gPipe: the stages go to data, the pipeline-only keys back to their unstaged values.
    (["num_simulated_devices=8", "ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_microbatches=4"],
     8, 1, "cpu", ["ici_data_parallelism=2", "ici_stage_parallelism=1", "num_pipeline_microbatches=-1"]),
    (["ici_stage_parallelism=2", "ici_fsdp_parallelism=-1", "num_decoder_layers=4", "num_pipeline_repeats=2",
      "pipeline_fsdp_ag_once=true"], 8, 1, "cpu",  # circular; fsdp's -1 still fills; the devices were XLA_FLAGS'
     ["ici_data_parallelism=2", "ici_stage_parallelism=1", "num_simulated_devices=8", "num_pipeline_repeats=1",
      "pipeline_fsdp_ag_once=false"]),
    (["ici_stage_parallelism=-1", "ici_fsdp_parallelism=2", "num_decoder_layers=4", "num_simulated_devices=8"],
     8, 1, "cpu", ["ici_data_parallelism=4", "ici_stage_parallelism=1"]),
    # Two processes (slices) of 4 CPU devices: one process simulates all 8, the DCN degree folded into ICI.
    (["dcn_data_parallelism=2", "ici_fsdp_parallelism=4"], 8, 2, "cpu",
     ["ici_data_parallelism=2", "dcn_data_parallelism=1", "num_simulated_devices=8"]),
    (["dcn_stage_parallelism=2", "dcn_data_parallelism=1", "ici_fsdp_parallelism=-1", "num_slices=2"], 8, 2, "cpu",
     ["ici_data_parallelism=2", "dcn_stage_parallelism=1", "num_slices=1", "num_simulated_devices=8"]),
    # Accelerators: one host holds one slice, so the DCN degrees go and the ICI ones stay.
    (["dcn_data_parallelism=2", "ici_fsdp_parallelism=4"], 8, 2, "gpu", ["dcn_data_parallelism=1"]),
])
def test_summary_command_lays_the_run_out_in_one_process(run, devices, slices, platform, added, tmp_path):
    """maxpar.generate runs in one process, without pipeline stages: the printed command folds the run's mesh into
    one process's devices (the stages into data) and unsets the pipeline-only keys; a path with a space pastes as
    one word."""
    from maxpar.core.mesh import resolve_mesh_shape
    from maxpar.training.summary import generate_command, sampling_overrides
    config = micro_config("max_new_tokens=8", *run)  # room in MICRO's 32 tokens
    overrides = sampling_overrides(config, resolve_mesh_shape(config, devices, slices), platform)
    assert overrides == added
    run_dir = tmp_path / "my run"
    assert shlex.split(generate_command(run_dir, run_dir / "checkpoints" / "5", overrides)) == [
        "python", "-m", "maxpar.generate", str(run_dir / "config.yml"), "model_name=",
        f"load_parameters_path={run_dir / 'checkpoints' / '5'}", *added, "--prompt", "def "]


def test_summary_command_fits_max_new_tokens_into_a_short_sequence():
    """A run with max_target_length 32 has room for 32 - BOS - 'def ' = 27 new tokens, not the default 64."""
    from maxpar.training.summary import room_to_write
    assert room_to_write(micro_config("max_target_length=32", "max_new_tokens=64")) == ["max_new_tokens=27"]
    assert room_to_write(micro_config("max_target_length=256", "max_new_tokens=64")) == []
