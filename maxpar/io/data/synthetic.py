"""Random-token batches: a data source with no I/O for benchmarks and smoke runs."""

from __future__ import annotations

import functools

import grain
import numpy as np

from maxpar.core.config import SYNTHETIC_FIRST_TOKEN as _FIRST_TOKEN
from maxpar.io.data.text import INFINITE, process_rows, sync_read


def synthetic_batch(
    step: int, *, rows: range, vocab_size: int, seq_len: int, seed: int
) -> dict[str, np.ndarray]:
    """The given global rows of step `step`; each row depends only on
    (seed, step, row), which makes the stream process-count invariant."""
    toks = np.stack([
        np.random.default_rng([int(seed) % 2**64, step, row]).integers(
            _FIRST_TOKEN, vocab_size, size=seq_len + 1, dtype=np.int32
        )
        for row in rows
    ])
    shape = (len(rows), seq_len)
    return {
        "inputs": toks[:, :-1],
        "targets": toks[:, 1:],
        "segment_ids": np.ones(shape, np.int32),
        "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), shape).copy(),
    }


def synthetic_batches(
    *,
    vocab_size: int,
    seq_len: int,
    global_batch_rows: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.IterDataset:
    """Endless batches in the `text_batches` format; this process's rows only.

    Each row is one full segment of uniform tokens in [3, vocab_size), with
    targets the inputs shifted by one. Index-based, so iterator state is a step.
    """
    if vocab_size <= _FIRST_TOKEN:
        raise ValueError(f"vocab_size must be > {_FIRST_TOKEN}, got {vocab_size}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    rows = process_rows(global_batch_rows, process_index, process_count)
    make = functools.partial(
        synthetic_batch, rows=rows, vocab_size=vocab_size, seq_len=seq_len, seed=seed
    )
    return grain.MapDataset.range(INFINITE).map(make).to_iter_dataset(sync_read())
