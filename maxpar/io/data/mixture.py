"""Weighted mixtures of document sources by tokens (`dataset_mixture`), chosen lane by lane.

Each lane (text.py) picks the source of its next document by a token deficit: the source whose tokens in this phase,
divided by its weight, is smallest; ties (every source at 0 when a phase starts) go by a seeded order of the
sources per lane. The choice depends only on the lane's own history, so the global batch is the same for any
process count, and a lane's state (per source: documents taken and tokens this phase) resumes it exactly. Within a
source a lane reads the same endless sequence a single source would (text._LaneDocuments): a source that runs out
repeats with a new shuffle. A lane's shares miss the weights by at most one document's tokens.

A phase is a run of steps under one set of weights. A resume with other weights keeps every source's position and
starts a new phase: the deficit counts tokens from there, so the new weights hold from the resume on (after the
rest of the documents a lane had begun, which the packer replays under the old weights and finishes).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from maxpar.io.data.text import _entropy, _JsonSafeState, _LaneDocuments, _stack_lanes, process_rows
from maxpar.io.data.tokenizer import Tokenizer

Notify = Callable[[str], None]
SOURCE_TOKENS = "source_tokens"  # the batches' key: each row's running count of tokens per source


@dataclasses.dataclass(frozen=True)
class Source:
    """A source's name, its share of the training tokens (any positive scale) and its training documents."""

    name: str
    weight: float
    documents: Sequence[str]


def choose(tokens: Sequence[int], weights: Sequence[float], ranks: Sequence[int]) -> int:
    """The index of the source furthest below its share: the smallest tokens / weight, ties to the lowest rank."""
    return min(range(len(weights)), key=lambda i: (tokens[i] / weights[i], ranks[i]))


def tie_ranks(seed: int, lane: int, count: int) -> list[int]:
    """A seeded order of the sources for one lane, so that lanes do not all start a phase with the same source."""
    return np.argsort(np.random.default_rng([_entropy(seed), lane]).permutation(count)).tolist()


class _MixedDocuments(grain.IterDataset):
    """One lane's documents, each from the source furthest below its share of the lane's tokens this phase.

    Elements carry a `sources` feature (the source's index, per token) that survives packing, so rows can count
    their tokens per source. `notify` (lane 0 only, so once per job) hears of a source repeating and of a new phase.
    """

    def __init__(self, readers: Mapping[str, _LaneDocuments], weights: Mapping[str, float], ranks: Mapping[str, int],
                 notify: Notify | None):
        super().__init__()
        self.readers, self.weights, self.ranks, self.notify = dict(readers), dict(weights), dict(ranks), notify
        self.iterator: _MixedDocumentsIterator | None = None  # the newest, for the lane's begin_phase

    def __iter__(self) -> _MixedDocumentsIterator:
        self.iterator = _MixedDocumentsIterator(self)
        return self.iterator

    def announce_repeat(self, name: str, index: int) -> None:
        epoch = self.readers[name].epoch(index)
        if self.notify and index and epoch > self.readers[name].epoch(index - 1):
            self.notify(f"data mixture: source {name!r} ran out; it repeats (pass {epoch + 1}) with a new shuffle")


class _MixedDocumentsIterator(grain.DatasetIterator):
    """State: per source, the documents the lane took and their tokens this phase; and the phase's weights."""

    def __init__(self, mixed: _MixedDocuments):
        super().__init__()
        self._mixed = mixed
        self._weights = dict(mixed.weights)
        self._documents = dict.fromkeys(mixed.readers, 0)
        self._tokens = dict.fromkeys(mixed.readers, 0)

    def __next__(self) -> dict[str, np.ndarray]:
        names = [name for name in self._mixed.readers if name in self._weights]
        name = names[choose([self._tokens[n] for n in names], [self._weights[n] for n in names],
                            [self._mixed.ranks[n] for n in names])]
        index = self._documents[name]
        features = self._mixed.readers[name](index)
        self._documents[name] = index + 1
        self._tokens[name] += len(features["targets"])
        self._mixed.announce_repeat(name, index)
        code = list(self._mixed.readers).index(name)
        return {**features, "sources": np.full(len(features["targets"]), code, np.int32)}

    def get_state(self) -> dict[str, Any]:
        return {"documents": dict(self._documents), "tokens": dict(self._tokens), "weights": dict(self._weights)}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """The saved position under the saved phase's weights: the packer replays its buffered documents after
        this, and they must come out as they did. `begin_phase` switches to this run's weights afterwards."""
        self._documents = {name: int(state["documents"].get(name, 0)) for name in self._mixed.readers}
        self._tokens = {name: int(state["tokens"].get(name, 0)) for name in self._mixed.readers}
        self._weights = {name: float(weight) for name, weight in state["weights"].items()}

    def begin_phase(self) -> None:
        """Continue under this run's weights; other weights than the restored ones start a new phase."""
        if self._weights == self._mixed.weights:
            return
        if self._mixed.notify:
            self._mixed.notify(f"data mixture: new phase, weights {_shares(self._weights)} -> "
                               f"{_shares(self._mixed.weights)}; every source continues from where it stopped")
        self._weights = dict(self._mixed.weights)
        self._tokens = dict.fromkeys(self._mixed.readers, 0)


def _shares(weights: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {weight:g}" for name, weight in weights.items())


class _CountedLane(grain.IterDataset):
    """One lane's packed rows, each with the lane's running count of trained tokens per source (`source_tokens`)."""

    def __init__(self, packed: grain.IterDataset, mixed: _MixedDocuments):
        super().__init__(packed)
        self._mixed = mixed

    def __iter__(self) -> _CountedLaneIterator:
        return _CountedLaneIterator(self._parent.__iter__(), self._mixed)


class _CountedLaneIterator(grain.DatasetIterator):

    def __init__(self, parent: grain.DatasetIterator, mixed: _MixedDocuments):
        super().__init__(parent)
        self._mixed = mixed
        self._documents = mixed.iterator  # made by the packer's iterator just now
        self._names = list(mixed.readers)
        self._counts = np.zeros(len(self._names), np.int64)

    def __next__(self) -> dict[str, np.ndarray]:
        row = next(self._parent)
        real = row["inputs_segment_ids"] > 0
        self._counts = self._counts + np.bincount(row["sources"][real], minlength=len(self._names))
        return {**{k: v for k, v in row.items() if not k.startswith("sources")}, SOURCE_TOKENS: self._counts}

    def get_state(self) -> dict[str, Any]:
        return {"packed": self._parent.get_state(), "tokens": dict(zip(self._names, self._counts.tolist()))}

    def set_state(self, state: Mapping[str, Any]) -> None:
        notify, self._mixed.notify = self._mixed.notify, None  # the packer's replay of documents already announced
        try:
            self._parent.set_state(state["packed"])
        finally:
            self._mixed.notify = notify
        self._counts = np.array([int(state["tokens"].get(name, 0)) for name in self._names], np.int64)
        self._documents.begin_phase()


def _stack_mixed_lanes(rows: tuple[dict[str, np.ndarray], ...], pad_id: int) -> dict[str, np.ndarray]:
    return {**_stack_lanes(rows, pad_id), SOURCE_TOKENS: np.stack([r[SOURCE_TOKENS] for r in rows])}


def mixture_batches(sources: Sequence[Source], tokenizer: Tokenizer, *, seq_len: int, global_batch_rows: int,
                    seed: int, process_index: int = 0, process_count: int = 1,
                    notify: Notify | None = None) -> grain.IterDataset:
    """This process's rows of an endless stream of packed global batches mixed from `sources` by tokens.

    The batches are document_batches' (text.py) plus `source_tokens`: int64 [rows, len(sources)], each lane's
    running count of the tokens it has trained on from each source (padding not counted); summed over every
    process's rows it is the run's tokens per source. Same seed -> same stream for any process_count."""
    if not sources or any(not len(s.documents) for s in sources):
        raise ValueError("mixture_batches needs sources with at least one document each")
    streams = []
    for lane in process_rows(global_batch_rows, process_index, process_count):
        readers = {s.name: _LaneDocuments(s.documents, tokenizer, lane=lane, lanes=global_batch_rows, seed=seed)
                   for s in sources}
        ranks = dict(zip(sorted(readers), tie_ranks(seed, lane, len(sources))))  # by name: the list's order is free
        mixed = _MixedDocuments(readers, {s.name: s.weight for s in sources}, ranks, notify if lane == 0 else None)
        packed = grain.experimental.ConcatThenSplitIterDataset(
            mixed, length_struct={"inputs": seq_len, "targets": seq_len, "sources": seq_len})
        streams.append(_CountedLane(_JsonSafeState(packed), mixed))
    pad_id = int(tokenizer.pad_id)
    return grain.experimental.ZipIterDataset(streams).map(functools.partial(_stack_mixed_lanes, pad_id=pad_id))

