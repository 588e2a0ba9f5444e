"""Shared test fixtures: tiny configs, a small text corpus, fixed packed batches, and a session-wide store of results
that several tests or modules need (`shared`, `shared_dir`)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np

from maxpar.core.config import Config, load_config

TINY = ["emb_dim=64", "num_query_heads=4", "num_kv_heads=2", "head_dim=16", "mlp_dim=128",
        "num_decoder_layers=2", "vocab_size=264", "max_target_length=32", "dtype=float32",
        "weight_dtype=float32", "warmup_steps=2", "learning_rate=1e-2", "log_period=1", "eval_interval=-1",
        "enable_checkpointing=false"]


def tiny_config(*overrides: str, config_file: str = "configs/base.yml") -> Config:
    return load_config([config_file, *TINY, *overrides])


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
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- training in a subprocess (kill, SIGTERM)

REPO = Path(__file__).resolve().parents[1]


def train_command(*overrides: str) -> list[str]:
    """`python -m maxpar.train` on the tiny model with `overrides` (later keys win)."""
    return [sys.executable, "-m", "maxpar.train", str(REPO / "configs" / "base.yml"), *TINY, *overrides]


def compilation_cache_env(directory: Path) -> dict[str, str]:
    """This environment plus a persistent JAX compilation cache: a restarted run reuses the compiled step
    (the same executable, so the same numbers) instead of compiling it again. Under pytest that is the session's
    cache (tests/conftest.py), which the test's own in-process runs have filled too; elsewhere `directory`."""
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


def train_metrics(run_dir: Path, corpus: str, devices, steps: int, *overrides: str,
                  metrics: tuple[str, ...] = ("loss", "grad_norm")) -> dict[str, np.ndarray]:
    """{metric: its value at steps 1..`steps`} of an in-process run of the tiny model on the test corpus. Equivalence
    tests need few steps: from the second on, a step starts from updated parameters and optimizer moments."""
    from maxpar.train import train

    config = tiny_config(f"steps={steps}", "dataset_type=text", f"dataset_path={corpus}", "eval_fraction=0",
                         *overrides)
    train(config, devices=devices, run_dir=run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    return {name: np.array([r[name] for r in rows], dtype=float) for name in metrics}


def packed_batch(rows: int, length: int, vocab: int = 264, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tokens in rows of two packed documents (so attention masking matters), int32 like the loader's."""
    rng = np.random.default_rng(seed)
    cut = rng.integers(4, length - 4, rows)[:, None]
    columns = np.arange(length)[None, :]
    return {"inputs": rng.integers(0, vocab, (rows, length)).astype(np.int32),
            "targets": rng.integers(0, vocab, (rows, length)).astype(np.int32),
            "segment_ids": np.where(columns < cut, 1, 2).astype(np.int32),
            "positions": np.where(columns < cut, columns, columns - cut).astype(np.int32)}


def step_metrics(devices, steps: int, *overrides: str, metrics: tuple[str, ...] = ("loss", "grad_norm"),
                 config_file: str = "configs/base.yml") -> dict[str, np.ndarray]:
    """{metric: its value at steps 1..`steps`} of the trainer's own compiled train step on the tiny model: the run
    layout, sharded initialization and step that `maxpar.train` compiles for `config` on `devices`, fed one fixed
    packed batch of the layout's global rows every step (the same rows on any mesh, so runs compare). What
    `train_metrics` shows without the data pipeline, writers and loop; use it for equivalence, and `train_metrics`
    where the loop itself is what a test checks. The loss falls: every step fits the same batch."""
    import jax

    from maxpar.train import global_batch, setup_run
    from maxpar.training.train_step import create_state

    config = tiny_config("dataset_type=synthetic", f"steps={steps}", *overrides, config_file=config_file)
    run = setup_run(config, devices)
    state = create_state(run.model, run.tx, run.layout, run.mesh)
    step = run.compile_train_step()
    batch = global_batch(packed_batch(run.shape.global_rows, config.max_target_length, config.vocab_size),
                         run.in_sharding)
    rows = []
    for _ in range(steps):
        state, values = step(state, batch)
        rows.append(jax.device_get(values))
    return {name: np.array([row[name] for row in rows], dtype=float) for name in metrics}


# ---------------------------------------------------------------- one result for the whole session, across workers

T = TypeVar("T")
_MEMO: dict[str, object] = {}


def _store() -> Path:
    """The session's shared directory (tests/conftest.py sets it before the xdist workers start, so all share it)."""
    return Path(os.environ["MAXPAR_TESTS_SHARED_DIR"])


def store_name(*key: object) -> str:
    """A file name for `key` (its parts' reprs): readable start, a hash of the whole so distinct keys never meet."""
    text = repr(key)
    readable = re.sub(r"[^A-Za-z0-9_.=-]+", "_", text)[:60].strip("_")
    return f"{readable}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """Hold the lock of entry `name`: the worker that builds it blocks the others until it is complete."""
    with open(_store() / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def shared(compute: Callable[[], T], *key: object) -> T:
    """`compute()` once per test session for `key`, whichever test or pytest-xdist worker asks first; a picklable
    value (NumPy arrays, dicts of them), read back everywhere else. The key must name everything the value depends
    on: the config overrides, the devices' count, the seed. Use it for references several modules compare against
    (a one-device run's losses, transformers' logits), not for what a test checks about itself."""
    name = store_name(*key)
    if name in _MEMO:
        return _MEMO[name]  # type: ignore[return-value]
    path = _store() / f"{name}.pkl"
    with _locked(name):
        if path.exists():
            value = pickle.loads(path.read_bytes())
        else:
            value = compute()
            path.with_suffix(".tmp").write_bytes(pickle.dumps(value))
            path.with_suffix(".tmp").rename(path)
    _MEMO[name] = value
    return value


def shared_dir(build: Callable[[Path], object], *key: object) -> Path:
    """A directory `build(directory)` fills once per test session for `key` (a saved Hugging Face model, its
    conversion), across workers; tests read it and copy it before changing anything. It is built where it stays
    (a conversion records its own path), and counts only once `build` returns: a build that fails leaves nothing
    usable, so the next asker builds again and fails the same way."""
    name = store_name(*key)
    directory, done = _store() / name, _store() / f"{name}.done"
    with _locked(name):
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            build(directory)
            done.touch()
    return directory
