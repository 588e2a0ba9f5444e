"""compiled_trainstep_file on the CPU target: a train step compiled and saved in this process, loaded by a fresh
`python -m maxpar.train` process, trains to the same losses as a run that compiles its own step."""

from __future__ import annotations

import subprocess

import jax

from helpers import read_metrics, tiny_config, train_command
from maxpar.core.config import to_yaml
from maxpar.io.executable import CompiledFor, save_executable
from maxpar.plan.verify import compile_train_step
from maxpar.train import train

RUN = ["dataset_type=synthetic", "steps=3", "ici_data_parallelism=2", "ici_fsdp_parallelism=4"]


def test_a_saved_step_loads_in_a_fresh_process_and_trains_the_same(tmp_path):
    config = tiny_config(*RUN)
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
