"""Checks before any device work: memory fit, simulated devices, the mesh's device-count hint."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

from helpers import REPO, MICRO, micro_config
from launch.cluster import hardware_profile, trainer_command
from maxpar.core.config import ConfigError, load_config
from maxpar.core.mesh import create_mesh, local_mesh_shape
from maxpar.host import preflight
from maxpar.plan.fit import check_fits, check_local_fit, host_available_bytes
from maxpar.training.train_step import layout_check


def without_simulated_devices() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}


# Runs a module as `python -m` does and, at exit, says its own peak resident memory: VmHWM of its address space.
# (A child's ru_maxrss from wait4 is no measure: Linux carries the spawning process's high-water mark over the
# fork and exec, so it reads the pytest worker's memory, which grows with the tests run before.)
PEAK_WORDS = "peak resident kB:"
_RUN_MODULE_AND_SAY_PEAK = f"""
import atexit, runpy, sys
def say_peak():
    with open("/proc/self/status") as status:
        kb = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    print("{PEAK_WORDS}", kb, file=sys.stderr)
atexit.register(say_peak)
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def run_module_to_the_end(module: str, args: list[str], env: dict[str, str]) -> tuple[int, str, int]:
    """(exit status, stderr, peak resident memory in bytes) of `python -m module *args` in a child process."""
    done = subprocess.run([sys.executable, "-c", _RUN_MODULE_AND_SAY_PEAK, module, *args], cwd=REPO, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    words, _, kb = done.stderr.rstrip().rpartition(PEAK_WORDS)
    return done.returncode, words, int(kb) * 1024


@pytest.mark.slow
@pytest.mark.skipif(host_available_bytes() > 100e9, reason="llama2-7b's ~120 GB could fit this host")
def test_a_model_too_large_for_this_host_is_refused_before_it_allocates():
    status, stderr, peak = run_module_to_the_end("maxpar.train", ["configs/base.yml", "model_name=llama2-7b", "steps=1"],
                                                 without_simulated_devices())
    assert status == 2, stderr
    assert "Traceback" not in stderr
    assert "llama2-7b needs ~" in stderr and "GB of memory available" in stderr, stderr
    for advice in ("ici_fsdp_parallelism", "remat_policy=full", "weight_dtype=bfloat16", "skip_memory_check=true"):
        assert advice in stderr
    assert peak < 3e9, f"{peak / 1e9:.1f} GB resident: the check must come before any allocation"


def test_a_tiny_model_fits_and_skip_memory_check_skips_the_check():
    check_local_fit(micro_config(), jax.devices(), jax.local_devices())
    huge = load_config(["configs/base.yml", "model_name=llama3-70b"])
    with pytest.raises(ConfigError, match=r"llama3-70b needs ~\d+ GB .* GB per device x 8 devices"):
        check_local_fit(huge, jax.devices(), jax.devices())
    check_local_fit(load_config(["configs/base.yml", "model_name=llama3-70b", "skip_memory_check=true"]),
                    jax.devices(), jax.devices())


def test_simulated_cpu_devices_share_the_host_memory():
    estimate = {"params": 1e9, "optimizer": 2e9, "gradients": 1e9, "activations": 1e9, "total": 5e9}
    check_fits(micro_config(), estimate, 40e9, 8, "this host")  # 8 x 5 GB = 40 GB: fits
    with pytest.raises(ConfigError, match=r"needs ~45 GB \(5.0 GB per device x 9 devices: parameters 1.0, "
                                          r"optimizer state 2.0, gradients 1.0, activations 1.0 GB\); this host"):
        check_fits(micro_config(), estimate, 40e9, 9, "this host")


def test_launchers_check_memory_against_the_target_hardware():
    assert [hardware_profile(t) for t in ("v5p-128", "v5litepod-16", "v6e-8", "v4-8", "nvidia-h100-80gb")] == [
        "tpu-v5p", "tpu-v5e", "tpu-v6e", "", "h100"]
    args = ["configs/base.yml", "model_name=llama3-70b"]
    with pytest.raises(ConfigError, match=r"llama3-70b needs .* a tpu-v5p device has 102 GB"):
        trainer_command(args, 4, 1, "job", "tpu-v5p")
    assert trainer_command([*args, "skip_memory_check=true"], 4, 1, "job", "tpu-v5p")[-1] == "run_name=job"
    assert trainer_command(args, 256, 1, "job", "tpu-v5p")[-1] == "run_name=job"


def test_too_few_cpu_devices_say_how_to_simulate_more():
    with pytest.raises(ConfigError, match=r"multiply to 16 but there are 8 devices per slice; .* on a CPU machine "
                                          r"simulate devices with num_simulated_devices=16 or "
                                          r"XLA_FLAGS=--xla_force_host_platform_device_count=16"):
        create_mesh(micro_config("ici_fsdp_parallelism=16"))


@pytest.mark.parametrize("overrides, named", [
    (["ici_tensor_parallelism=2"], "num_simulated_devices=2 or"),  # fsdp's -1 fills: 2 devices run it
    (["ici_tensor_parallelism=3"], "simulating 3 CPU devices would not run this config either: num_kv_heads=2 cannot be split 3 ways"),
    (["dcn_data_parallelism=2", "ici_fsdp_parallelism=4"],  # one process is one slice, whatever its devices
     "simulating 4 CPU devices would not run this config either: dcn degrees (dcn_data_parallelism=2)"),
])
def test_the_device_count_hint_names_a_count_that_runs_the_whole_config(overrides, named):
    config = micro_config(*overrides)
    with pytest.raises(ConfigError) as error:
        local_mesh_shape(config, jax.devices()[:1], layout_check(config))
    assert named in str(error.value)
    assert ("num_simulated_devices" in str(error.value)) == named.startswith("num_simulated_devices")


def test_num_simulated_devices_is_refused_where_it_cannot_work(monkeypatch):
    with pytest.raises(ConfigError, match="JAX has already started"):
        preflight.apply_simulated_devices(micro_config("num_simulated_devices=8"))
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    with pytest.raises(ConfigError, match="JAX_PLATFORMS='cuda'"):
        preflight.apply_simulated_devices(micro_config("num_simulated_devices=8"))
    preflight.apply_simulated_devices(micro_config())  # 0 = off: nothing to refuse


@pytest.mark.slow
def test_num_simulated_devices_gives_a_fresh_process_that_many_devices(tmp_path):
    # 4 simulated devices, no XLA_FLAGS: the mesh (asking for 8) counts them, before anything compiles.
    command = [sys.executable, "-m", "maxpar.train", "configs/base.yml", *MICRO, "dataset_type=synthetic", "steps=1",
               "num_simulated_devices=4", "ici_fsdp_parallelism=8", f"base_output_directory={tmp_path}"]
    done = subprocess.run(command, cwd=REPO, env=without_simulated_devices(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "multiply to 8 but there are 4 devices per slice" in done.stderr, done.stderr
    assert "num_simulated_devices=8" in done.stderr


def test_an_output_directory_under_a_file_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"base_output_directory='.*file/runs': cannot create it"):
        preflight.check_output_directory(micro_config(f"base_output_directory={tmp_path / 'file' / 'runs'}"))
    preflight.check_output_directory(micro_config(f"base_output_directory={tmp_path / 'runs'}"))
    assert (tmp_path / "runs").is_dir() and not list((tmp_path / "runs").iterdir())  # the probe file is gone


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_a_read_only_run_directory_is_a_config_error(tmp_path):
    (tmp_path / "run").mkdir(mode=0o500)
    with pytest.raises(ConfigError, match=r"the run directory .*run\): cannot write there"):
        preflight.check_output_directory(micro_config(f"base_output_directory={tmp_path}", "run_name=run"))
