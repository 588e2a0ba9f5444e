"""compiled_trainstep_file on the CPU target: a train step compiled and saved in this process, loaded by a fresh
`python -m maxpar.train` process, trains to the same losses as a run that compiles its own step."""

from __future__ import annotations

import subprocess

import jax
import pytest

from helpers import read_metrics, micro_config, train_command
from maxpar.core.config import ConfigError, to_yaml
from maxpar.io.executable import CompiledFor, load_executable, save_executable
from maxpar.plan.verify import compile_train_step
from maxpar.train import train

RUN = ["dataset_type=synthetic", "steps=3", "ici_data_parallelism=2", "ici_fsdp_parallelism=4"]


def test_a_saved_step_loads_in_a_fresh_process_and_trains_the_same(tmp_path):
    config = micro_config(*RUN)
    compiled = compile_train_step(config, jax.devices())
    devices = jax.devices()
    step_file = save_executable(compiled.executable, str(tmp_path / "step.bin"), CompiledFor(
        devices[0].platform, devices[0].device_kind, len(devices), compiled.layout.mesh.describe(), "local",
        to_yaml(config)))
    train(config, run_dir=tmp_path / "compiled_here")
    loaded = subprocess.run(train_command(*RUN, f"compiled_trainstep_file={step_file}",
                                          f"base_output_directory={tmp_path}", "run_name=loaded"),
                            capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert f"loaded the train step compiled before from {step_file}" in loaded.stdout
    expected = [row["loss"] for row in read_metrics(tmp_path / "compiled_here")]
    assert [row["loss"] for row in read_metrics(tmp_path / "loaded")] == expected and len(expected) == 3


def test_a_step_compiled_from_another_config_is_refused_naming_the_keys(tmp_path):
    """A learning rate is a constant of the compiled step: loaded under another one, the step would train with the
    old one without a word. Keys that do not enter the step (where the run writes, how often it saves) may differ."""
    config = micro_config(*RUN)
    devices = jax.devices()
    compiled = jax.jit(lambda x: x + 1).lower(1.0).compile()
    mesh = "data=2 fsdp=4"
    step_file = str(save_executable(compiled, str(tmp_path / "step.bin"), CompiledFor(
        devices[0].platform, devices[0].device_kind, len(devices), mesh, "local", to_yaml(config))))
    same_step = micro_config(*RUN, "run_name=elsewhere", "checkpoint_period=7", f"compiled_trainstep_file={step_file}")
    assert callable(load_executable(step_file, devices, mesh, same_step))
    with pytest.raises(ConfigError) as refused:
        load_executable(step_file, devices, mesh, micro_config(*RUN, "learning_rate=0.123", "z_loss_weight=0.5"))
    assert "learning_rate=0.123 (compiled with " in str(refused.value)
    assert "z_loss_weight=0.5 (compiled with 0.0)" in str(refused.value) and "run_name" not in str(refused.value)
