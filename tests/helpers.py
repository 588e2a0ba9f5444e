"""Shared test fixtures: the micro model's configs, a small text corpus and training in a child process (from
maxpar/tools/testbed.py, which the end-to-end scripts share), fixed packed batches, compiled train steps
(`step_metrics`) and training runs (`train_metrics`), and a session-wide store of results that several tests or
modules need (`shared`, `shared_dir`)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pickle
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from maxpar.tools.testbed import (MICRO, REPO, compilation_cache_env, kill_and_rerun, layout_on,  # noqa: F401
                                   logged_steps, micro_config, read_metrics, start_training, train_command,
                                   wait_for_step, wait_until, write_corpus)


def train_metrics(run_dir: Path, corpus: str, devices, steps: int, *overrides: str,
                  metrics: tuple[str, ...] = ("loss", "grad_norm")) -> dict[str, np.ndarray]:
    """{metric: its value at steps 1..`steps`} of an in-process run of the micro model on the test corpus. Equivalence
    tests need few steps: from the second on, a step starts from updated parameters and optimizer moments."""
    from maxpar.train import train

    config = micro_config(f"steps={steps}", "dataset_type=text", f"dataset_path={corpus}", "eval_fraction=0",
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


@dataclass(frozen=True)
class StepRun:
    """What `compiled_steps` returns (picklable, so `shared` can keep it)."""
    metrics: dict[str, np.ndarray]  # every metric the step returns, its value at steps 1..N
    params: Any  # the parameters after the last step, on the host, in the canonical (scanned, unstaged) layout
    fp8_meta: Any  # the fp8 amax histories after the last step ({} without delayed scaling)


def compiled_steps(devices, steps: int, *overrides: str, config_file: str = "configs/base.yml") -> StepRun:
    """`steps` steps of the trainer's own compiled train step on the micro model: the run layout, sharded
    initialization and step that `maxpar.train` compiles for the config on `devices`, fed one fixed packed batch of
    the layout's global rows every step (the same rows on any mesh, so runs compare). What `train_metrics` shows
    without the data pipeline, writers and loop; use it for equivalence, and `train_metrics` where the loop itself
    is what a test checks. The loss falls: every step fits the same batch. Step 1 runs at learning rate 0 (MICRO's
    warm-up), so compare 4 steps: steps 2-4 start from updated AdamW moments, 3-4 from updated parameters."""
    import jax

    from maxpar.core.config import model_config
    from maxpar.model import stack
    from maxpar.train import global_batch, setup_run
    from maxpar.training.train_step import create_state

    config = micro_config("dataset_type=synthetic", f"steps={steps}", *overrides, config_file=config_file)
    run = setup_run(config, devices)
    state = create_state(run.model, run.tx, run.layout, run.mesh)
    step = run.compile_train_step()
    batch = global_batch(packed_batch(run.shape.global_rows, config.max_target_length, config.vocab_size),
                         run.in_sharding)
    rows = []
    for _ in range(steps):
        state, values = step(state, batch)
        rows.append(jax.device_get(values))
    metrics = {name: np.array([row[name] for row in rows], dtype=float) for name in rows[0]}
    params = stack.to_canonical(jax.device_get(state.params), model_config(config))
    return StepRun(metrics, params, jax.device_get(state.fp8_meta))


def step_metrics(devices, steps: int, *overrides: str, metrics: tuple[str, ...] = ("loss", "grad_norm"),
                 config_file: str = "configs/base.yml") -> dict[str, np.ndarray]:
    """{metric: its value at steps 1..`steps`} of `compiled_steps`."""
    run = compiled_steps(devices, steps, *overrides, config_file=config_file)
    return {name: run.metrics[name] for name in metrics}


def one_device_steps(steps: int, *overrides: str, config_file: str = "configs/base.yml") -> StepRun:
    """`compiled_steps` on one device, once per test session for these arguments (`shared`): the reference that
    equivalence tests in several modules compare their meshes with. Give the global batch in `overrides`
    (per_device_batch_size=8 for the usual 8 rows)."""
    import jax

    return shared(lambda: compiled_steps(jax.devices()[:1], steps, *overrides, config_file=config_file),
                  "one_device_steps", steps, config_file, overrides)


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
