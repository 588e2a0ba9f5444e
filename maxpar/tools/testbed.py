"""What the tests and the end-to-end scripts train: the micro model, a small corpus, a config bound to devices
(`layout_on`), and training in a child process.

The micro model (configs/models/micro.yml: 64 wide, 2 layers, 264 tokens) is smaller than the default `tiny` preset,
so that a sharded train step compiles in seconds on a CPU. `MICRO` names it and gives its shape as explicit keys
too, so that another preset named after it (`model_name=tiny-moe`) adds its own keys (experts) at the micro shape;
then the run settings the tests share (float32, 32 tokens, a short warm-up, no eval, no checkpoints).

The child-process helpers start `python -m maxpar.train` with its output in a file (no pipe can fill up), watch its
metrics.jsonl, and kill it with SIGKILL at a chosen step: a preemption without any chance to save.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from maxpar.core.config import Config, load_config

REPO = Path(__file__).resolve().parents[2]
MICRO_FILE = REPO / "configs" / "models" / "micro.yml"


def _override(key: str, value: object) -> str:
    return f"{key}={json.dumps(value) if isinstance(value, bool) else value}"


MICRO_MODEL = [_override(key, value) for key, value in yaml.safe_load(MICRO_FILE.read_text()).items()]
MICRO = ["model_name=micro", *MICRO_MODEL, "max_target_length=32", "dtype=float32", "weight_dtype=float32",
         "warmup_steps=2", "learning_rate=1e-2", "log_period=1", "eval_interval=-1", "enable_checkpointing=false"]


def micro_config(*overrides: str, config_file: str = "configs/base.yml") -> Config:
    """`config_file` (relative to the working directory) with MICRO, then `overrides` (later keys win)."""
    return load_config([config_file, *MICRO, *overrides])


def layout_on(config: Config, devices=None, tx=None):
    """(run layout, mesh) of `config` on `devices` (default: all), resolved and bound as the trainer does."""
    import jax

    from maxpar.core.mesh import build_mesh, local_mesh_shape
    from maxpar.training.train_step import run_layout

    devices = list(jax.devices() if devices is None else devices)
    layout = run_layout(config, local_mesh_shape(config, devices), tx, check_batch=False)
    return layout, build_mesh(layout.mesh, devices)


def write_corpus(directory: Path, num_files: int = 12, seed: int = 0) -> str:
    """Small English-like documents of varied length; returns a glob for dataset_path."""
    rng = np.random.default_rng(seed)
    words = "the model learns to predict the next byte of text while data flows across the mesh".split()
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(num_files):
        text = " ".join(rng.choice(words, size=int(rng.integers(5, 80))))
        (directory / f"doc_{i:02d}.txt").write_text(f"document {i}: {text}\n")
    return str(directory / "*.txt")


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- training in a child process (kill, SIGTERM)

def train_command(*overrides: str) -> list[str]:
    """`python -m maxpar.train` on the micro model with `overrides` (later keys win)."""
    return [sys.executable, "-m", "maxpar.train", str(REPO / "configs" / "base.yml"), *MICRO, *overrides]


def compilation_cache_env(directory: Path) -> dict[str, str]:
    """This environment plus a persistent JAX compilation cache: a restarted run reuses the compiled step
    (the same executable, so the same numbers) instead of compiling it again. The cache already named in the
    environment (under pytest, the session's: tests/conftest.py) if any, else `directory`."""
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR", str(directory)),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def start_training(command: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a training process whose output goes to `log_path` (a file, so no pipe can fill up)."""
    with open(log_path, "w", encoding="utf-8") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)


def logged_steps(run_dir: Path) -> list[int]:
    """Steps in metrics.jsonl so far, ignoring a half-written last line."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass
    return steps


def wait_until(process: subprocess.Popen, condition, what: str, timeout: float = 240) -> None:
    """Poll `condition()` every 10 ms until true. Fails if the process ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"training exited with {process.returncode} before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting until {what}")
        time.sleep(0.01)


def wait_for_step(process: subprocess.Popen, run_dir: Path, step: int, timeout: float = 240) -> int:
    """Wait until metrics.jsonl logs a step >= `step`; returns the newest logged step."""
    wait_until(process, lambda: max(logged_steps(run_dir), default=0) >= step, f"step {step} was logged", timeout)
    return max(logged_steps(run_dir))


def kill_and_rerun(command: list[str], run_dir: Path, steps: int, kill_at: int, checkpoint_step: int,
                   logs: Path) -> None:
    """Start `command` (a run of `steps` steps into `run_dir`), SIGKILL it once it has logged step `kill_at` and
    its checkpoint `checkpoint_step` is complete (so it has no chance to save), then run the same command to the
    end, which must say it resumed. Logs and the compilation cache go under `logs`."""
    env = compilation_cache_env(logs / "jax_cache")
    first = start_training(command, logs / "first.log", env)
    wait_for_step(first, run_dir, kill_at)
    wait_until(first, (run_dir / "checkpoints" / str(checkpoint_step)).is_dir,
               f"checkpoint {checkpoint_step} was complete")
    first.kill()
    assert first.wait(timeout=60) == -signal.SIGKILL and max(logged_steps(run_dir)) < steps
    second = start_training(command, logs / "second.log", env)
    code = second.wait(timeout=300)
    output = (logs / "second.log").read_text()
    assert code == 0, output[-3000:]
    assert "resumed from checkpoint at step" in output
