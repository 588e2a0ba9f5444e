"""Packed language-model batches from documents: whole text files, or records of shards (records.py).

Layout ("lanes"): row j of every global batch comes from lane j, an independent
packed stream over its own documents. A process builds only its contiguous
block of lanes, so the global batch is bitwise identical for any process count
and each process reads only the files its lanes need.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

from maxpar.core import storage
from maxpar.io.data.errors import reading
from maxpar.io.data.tokenizer import Tokenizer

# Datasets are index-addressed; this is "forever" (one doc or step per index).
INFINITE = 2**62
STDLIB_PLACEHOLDER = "{stdlib}"



def sync_read() -> grain.ReadOptions:
    """Reads on demand in the caller's thread.

    Grain's default prefetches 500 elements on 16 threads per stream; with one
    stream per lane that would read far ahead of what the batches need.
    """
    return grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def resolve_files(pattern: str) -> list[str]:
    """Expands `{stdlib}` and globs recursively, so the default corpus (the
    Python standard library source) is found on any machine without a download."""
    expanded = os.path.expanduser(
        pattern.replace(STDLIB_PLACEHOLDER, sysconfig.get_paths()["stdlib"])
    )
    files = storage.glob_files(expanded)
    if not files:
        raise ValueError(
            f"data file pattern {pattern!r} (expanded to {expanded!r}) matches no files"
        )
    return files


def split_files(
    files: Sequence[Any], eval_fraction: float, seed: int
) -> tuple[list[Any], list[Any]]:
    """Returns (train, eval): whole files (or record indices) held out, so eval text is never trained on.

    Holds out max(1, round(eval_fraction * n)) files (at most n - 1) when
    eval_fraction > 0 and n >= 2; none otherwise. Both lists keep input order.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n = len(files)
    if eval_fraction == 0.0 or n < 2:
        return list(files), []
    n_eval = min(n - 1, max(1, round(eval_fraction * n)))
    held_out = set(np.random.default_rng(_entropy(seed)).permutation(n)[:n_eval].tolist())
    train = [f for i, f in enumerate(files) if i not in held_out]
    evals = [f for i, f in enumerate(files) if i in held_out]
    return train, evals


def process_rows(global_batch_rows: int, process_index: int, process_count: int) -> range:
    """The global batch rows (= lanes) owned by one process: a contiguous block."""
    if global_batch_rows < 1:
        raise ValueError(f"global_batch_rows must be >= 1, got {global_batch_rows}")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"bad process_index={process_index} for process_count={process_count}")
    if global_batch_rows % process_count:
        raise ValueError(
            f"global_batch_rows={global_batch_rows} is not divisible by "
            f"process_count={process_count}"
        )
    rows = global_batch_rows // process_count
    return range(process_index * rows, (process_index + 1) * rows)


def _entropy(seed: int) -> int:
    """Seeds as non-negative ints, because numpy SeedSequence rejects negatives."""
    return int(seed) % 2**64


def read_text(path: str) -> str:
    """Reads a whole document (local or gs://); undecodable bytes become U+FFFD rather than errors."""
    return storage.read_text(path)


def document_features(text: str, tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    """(input, target) pairs of one document: `[bos] + text + [eos]` shifted by one,
    so no target ever belongs to another document."""
    body = tokenizer.encode(text)
    toks = np.empty(len(body) + 2, np.int32)
    toks[0] = tokenizer.bos_id
    toks[1:-1] = body
    toks[-1] = tokenizer.eos_id
    return {"inputs": toks[:-1], "targets": toks[1:]}


class FileTexts(Sequence[str]):
    """Whole text files as a lazily read sequence of documents (one file, one document)."""

    def __init__(self, files: Sequence[str]):
        self._files = tuple(files)

    def __len__(self) -> int:
        return len(self._files)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        with reading("dataset_type=text", self._files[index]):
            return read_text(self._files[index])


def tail_start(text: str, fraction: float) -> int:
    """Where the held-out tail of a single file's text begins: at the first line start from (1 - fraction) of its
    characters on, so the tail is about `fraction` of the text in whole lines (at that point itself when no line
    starts after it)."""
    cut = int(len(text) * (1.0 - fraction))
    newline = text.find("\n", cut)
    return newline + 1 if 0 <= newline < len(text) - 1 else cut


# A single file is read as documents of whole lines of about this many characters, so that the lanes of a batch
# read different parts of it (as one document, every lane would read the same stream and every row be the same).
FILE_CHUNK_CHARS = 16_384


def line_chunks(text: str, size: int) -> list[int]:
    """Where `text`'s chunks begin: at 0, then at the first line start at least `size` characters after the last."""
    starts = [0]
    while (newline := text.find("\n", starts[-1] + size)) >= 0 and newline + 1 < len(text):
        starts.append(newline + 1)
    return starts


class FilePart(Sequence[str]):
    """One text file's head or held-out tail (`tail_start`; the whole file at fraction 0) as documents of whole lines
    (`line_chunks`): a corpus of a single file has no whole file to hold out, so the last `fraction` of its text is
    evaluated on instead (nanoGPT's split). The part is read once, when the corpus is opened."""

    def __init__(self, file: str, fraction: float, tail: bool):
        self.file, self.fraction, self.tail = file, fraction, tail
        text = FileTexts([file])[0]
        cut = tail_start(text, fraction) if fraction else len(text)
        self._text = text[cut:] if tail else text[:cut]
        self._starts = line_chunks(self._text, FILE_CHUNK_CHARS)

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        index = index + len(self) if index < 0 else index
        if not 0 <= index < len(self):
            raise IndexError(index)
        end = self._starts[index + 1] if index + 1 < len(self) else len(self._text)
        return self._text[self._starts[index]:end]


# Suffixes of record shards (dataset_type=grain's grain_file_type), which dataset_type=text would read as raw text.
RECORD_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet", ".arrayrecord": "arrayrecord",
                   ".array_record": "arrayrecord"}


def record_shards(files: Sequence[str]) -> tuple[str, str] | None:
    """(a file, its grain_file_type) for the first of `files` named like a record shard; None when none is."""
    for file in files:
        kind = RECORD_SUFFIXES.get(os.path.splitext(file)[1].lower())
        if kind:
            return file, kind
    return None


class Subset(Sequence[str]):
    """The documents of `documents` at `indices` (a train or eval split of a record corpus)."""

    def __init__(self, documents: Sequence[str], indices: Sequence[int]):
        self._documents = documents
        self._indices = np.asarray(indices, np.int64)

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        return self._documents[int(self._indices[index])]


class _LaneDocuments:
    """Maps lane-local index m to the features of the lane's m-th document.

    Documents form an endless sequence of epochs (global index k is position
    k % n of epoch k // n's seeded permutation); lane j takes k = j + m * lanes.
    Every lane thus gets documents even when n < lanes, and each epoch reshuffles.
    """

    def __init__(self, documents: Sequence[str], tokenizer: Tokenizer, *, lane: int,
                 lanes: int, seed: int):
        self._documents = documents
        self._tokenizer = tokenizer
        self._lane = lane
        self._lanes = lanes
        self._seed = _entropy(seed)
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, permutation) cache

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self._seed, epoch])
            self._order = (epoch, rng.permutation(len(self._documents)))
        return self._order[1]

    def epoch(self, m: int) -> int:
        """The pass over the documents that the lane's m-th document belongs to (each pass reshuffles)."""
        return (self._lane + m * self._lanes) // len(self._documents)

    def document(self, m: int) -> Any:
        """The lane's m-th document as `documents` holds it."""
        epoch, position = divmod(self._lane + m * self._lanes, len(self._documents))
        return self._documents[int(self._permutation(epoch)[position])]

    def __call__(self, m: int) -> dict[str, np.ndarray]:
        return document_features(self.document(m), self._tokenizer)


class _JsonSafeState(grain.IterDataset):
    """Makes a ConcatThenSplit iterator's state survive a JSON round trip.

    Grain's packer stores slices as tuples and compares them with a tuple
    sentinel; after JSON (Orbax writes iterator state as JSON) they come back as
    lists and a restore silently produces different rows. We hand out lists and
    turn them back into tuples on restore.
    """

    def __iter__(self) -> grain.DatasetIterator:
        return _JsonSafeStateIterator(self._parent.__iter__())


class _JsonSafeStateIterator(grain.DatasetIterator):

    def __next__(self) -> Any:
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        state = dict(self._parent.get_state())
        state["remainder_slices"] = {
            k: [int(x) for x in v] for k, v in state["remainder_slices"].items()
        }
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["remainder_slices"] = {
            k: tuple(int(x) for x in v) for k, v in state["remainder_slices"].items()
        }
        self._parent.set_state(state)


def _lane_rows(documents: Callable[[int], dict[str, np.ndarray]], seq_len: int) -> grain.IterDataset:
    """One lane: its documents (document i of the lane's endless order: `_LaneDocuments`) packed end to end into
    rows of seq_len."""
    docs = grain.MapDataset.range(INFINITE).map(documents).to_iter_dataset(sync_read())
    packed = grain.experimental.ConcatThenSplitIterDataset(
        docs, length_struct={"inputs": seq_len, "targets": seq_len}
    )
    return _JsonSafeState(packed)


def _stack_lanes(rows: tuple[dict[str, np.ndarray], ...], pad_id: int) -> dict[str, np.ndarray]:
    """Stacks one row per lane into the batch dict; padding gets pad_id/position 0.

    Positions come from the packer and restart at 0 for every segment, including
    the continuation of a document split across rows: attention never sees the
    earlier part, and RoPE only depends on relative positions anyway.
    """
    segment_ids = np.stack([r["inputs_segment_ids"] for r in rows]).astype(np.int32)
    valid = segment_ids > 0
    return {
        "inputs": np.where(valid, np.stack([r["inputs"] for r in rows]), pad_id).astype(np.int32),
        "targets": np.where(valid, np.stack([r["targets"] for r in rows]), pad_id).astype(np.int32),
        "segment_ids": segment_ids,
        "positions": np.where(valid, np.stack([r["inputs_positions"] for r in rows]), 0).astype(np.int32),
    }


def text_batches(files: Sequence[str], tokenizer: Tokenizer, **kwargs: Any) -> grain.IterDataset:
    """document_batches over whole text files, one document each."""
    if not files:
        raise ValueError("text_batches needs at least one file")
    return document_batches(FileTexts(files), tokenizer, **kwargs)


def document_batches(
    documents: Sequence[str],
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    global_batch_rows: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.IterDataset:
    """This process's rows of an endless stream of packed global batches.

    Yields dicts of int32 arrays [global_batch_rows // process_count, seq_len]:
    inputs, targets, segment_ids (1, 2, ... per document in a row; 0 = padding)
    and positions (within the segment). Same seed -> same stream, for any
    process_count. Iterators support get_state()/set_state() with JSON-safe state.
    `documents[i]` is the text of document i, read on demand.
    """
    if not len(documents):
        raise ValueError("document_batches needs at least one document")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    lanes = process_rows(global_batch_rows, process_index, process_count)
    streams = [
        _lane_rows(
            _LaneDocuments(documents, tokenizer, lane=lane, lanes=global_batch_rows, seed=seed),
            seq_len,
        )
        for lane in lanes
    ]
    pad_id = int(tokenizer.pad_id)
    return grain.experimental.ZipIterDataset(streams).map(functools.partial(_stack_lanes, pad_id=pad_id))
