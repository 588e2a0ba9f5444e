"""Weighted mixtures of document sources by tokens (`dataset_mixture`), chosen row by row.

Every lane (text.py) has, per source, the packed stream of rows that a single-source run of that source would read
in that lane: documents packed end to end, a document longer than a row continuing into the source's next row. Each
row of the lane is the next row of one source's stream, chosen by the row's global index alone (`RowChooser`): a
low-discrepancy sequence that gives every source its weight's share of any run of consecutive rows, within a few rows.
Rows are full of tokens, so those are shares of tokens, however long the documents are. (Choosing per document
missed the weights by up to a document per lane: with whole modules as documents, by most of a short run.)

The choice depends only on the global row index, so the global batch is the same for any process count, and a
lane's state (its row count, its tokens per source, each source's packer) resumes it exactly. A source that runs
out repeats with a new shuffle, as a single source does (text._LaneDocuments).

A phase is a run of steps under one set of weights. A resume with other weights starts a new phase: every source
continues from where it stopped (its packer keeps the rest of its current document), and the rows from the resume
on follow the new weights.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from maxpar.core.config import ConfigError
from maxpar.io.data.text import _entropy, _lane_rows, _LaneDocuments, _stack_lanes, process_rows
from maxpar.io.data.tokenizer import Tokenizer

Notify = Callable[[str], None]
SOURCE_TOKENS = "source_tokens"  # the batches' key: each row's running count of tokens per source

_ONE = 2**64  # [0, 1) in 64-bit fixed point: the chooser's arithmetic is exact integers, the same on every host
_GOLDEN_STEP = (math.isqrt(5 * _ONE * _ONE) - _ONE) // 2  # frac of the golden ratio, (sqrt(5) - 1) / 2


@dataclasses.dataclass(frozen=True)
class Source:
    """A source's name, its share of the training tokens (any positive scale) and its training documents."""

    name: str
    weight: float
    documents: Sequence[str]


@dataclasses.dataclass(frozen=True)
class RowChooser:
    """Which source global row g reads: the one whose slice of [0, 1) holds frac(offset + g x golden ratio).

    The slices have the weights' widths, in the order of `names` (sorted, so the sources' listed order is free).
    The golden-ratio (Weyl) sequence is the most evenly spread of its kind: any N consecutive rows fall into each
    slice within about log(N) rows of its width times N (over 1,000 rows, a fraction of a point), from any start:
    a run, a resume, a new phase. The seeded offset makes the pattern the seed's.
    """

    names: tuple[str, ...]
    upper: tuple[int, ...]  # each slice's upper edge but the last's (which is 1)
    offset: int

    @classmethod
    def of(cls, weights: Mapping[str, float], seed: int) -> RowChooser:
        names = tuple(sorted(weights))
        total = sum(weights[n] for n in names)
        cumulative = np.cumsum([weights[n] for n in names])[:-1] / total
        offset = int(np.random.default_rng([_entropy(seed), 0x6D6978]).integers(0, _ONE, dtype=np.uint64))
        return cls(names, tuple(int(c * _ONE) for c in cumulative), offset)

    def __call__(self, row: int) -> str:
        return self.names[bisect.bisect_right(self.upper, (self.offset + row * _GOLDEN_STEP) % _ONE)]


def _source_rows(name: str, reader: _LaneDocuments, seq_len: int, heard: Callable[[str, int], None]
                 ) -> grain.IterDataset:
    """One source's rows in one lane: its documents packed end to end as a text lane's are, `heard` of each read."""
    def document(index: int) -> dict[str, np.ndarray]:
        heard(name, index)
        return reader(index)
    return _lane_rows(document, seq_len)


class _MixedLane(grain.IterDataset):
    """One lane's rows, each the next row of the source `chooser` names for its global index, with the lane's running
    count of trained tokens per source (`source_tokens`, in the order of `readers`). `notify` (lane 0 only, so once
    per job) hears of a source repeating and of a new phase."""

    def __init__(self, readers: Mapping[str, _LaneDocuments], weights: Mapping[str, float], chooser: RowChooser, *,
                 lane: int, lanes: int, seq_len: int, notify: Notify | None):
        self.readers, self.names = dict(readers), list(readers)
        self.weights, self.chooser, self.lane, self.lanes, self.notify = dict(weights), chooser, lane, lanes, notify
        self.sources = {name: _source_rows(name, reader, seq_len, self.heard) for name, reader in readers.items()}
        super().__init__(list(self.sources.values()))

    def __iter__(self) -> _MixedLaneIterator:
        return _MixedLaneIterator(self)

    def heard(self, name: str, index: int) -> None:
        """A source's document `index` was read: say so when it starts another pass over the source."""
        reader = self.readers[name]
        if self.notify and index and reader.epoch(index) > reader.epoch(index - 1):
            self.notify(f"data mixture: source {name!r} ran out; it repeats (pass {reader.epoch(index) + 1}) "
                        "with a new shuffle")


class _MixedLaneIterator(grain.DatasetIterator):
    """State: the lane's rows so far, its tokens per source, each source's packer, and the phase's weights."""

    def __init__(self, lane: _MixedLane):
        self._sources = {name: iter(source) for name, source in lane.sources.items()}
        super().__init__(list(self._sources.values()))
        self._lane = lane
        self._rows = 0
        self._counts = np.zeros(len(lane.names), np.int64)

    def __next__(self) -> dict[str, np.ndarray]:
        lane = self._lane
        name = lane.chooser(self._rows * lane.lanes + lane.lane)
        row = next(self._sources[name])
        self._rows += 1
        self._counts = self._counts.copy()
        self._counts[lane.names.index(name)] += int(np.sum(row["inputs_segment_ids"] > 0))
        return {**row, SOURCE_TOKENS: self._counts}

    def get_state(self) -> dict[str, Any]:
        return {"rows": self._rows, "weights": dict(self._lane.weights),
                "tokens": dict(zip(self._lane.names, self._counts.tolist())),
                "sources": {name: source.get_state() for name, source in self._sources.items()}}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """The saved position; a source the state does not know (one that joined) starts from its beginning.
        Other weights than the saved ones start a new phase, which is announced."""
        lane = self._lane
        if "sources" not in state:
            raise ConfigError("the checkpoint's data position is a dataset_mixture's that chose its sources per "
                              "document (an earlier maxpar) and cannot resume here; start a new run with "
                              "load_parameters_path=<its checkpoint> to keep its parameters")
        notify, lane.notify = lane.notify, None  # the packers re-read documents already announced
        try:
            for name, source in self._sources.items():
                if name in state["sources"]:
                    source.set_state(state["sources"][name])
        finally:
            lane.notify = notify
        self._rows = int(state["rows"])
        self._counts = np.array([int(state["tokens"].get(name, 0)) for name in lane.names], np.int64)
        saved = {name: float(weight) for name, weight in state["weights"].items()}
        if saved != lane.weights and lane.notify:
            lane.notify(f"data mixture: new phase, weights {_shares(saved)} -> {_shares(lane.weights)}; every "
                        "source continues from where it stopped")


def _shares(weights: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {weight:g}" for name, weight in weights.items())


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
    weights = {s.name: s.weight for s in sources}
    chooser = RowChooser.of(weights, seed)
    streams = []
    for lane in process_rows(global_batch_rows, process_index, process_count):
        readers = {s.name: _LaneDocuments(s.documents, tokenizer, lane=lane, lanes=global_batch_rows, seed=seed)
                   for s in sources}
        streams.append(_MixedLane(readers, weights, chooser, lane=lane, lanes=global_batch_rows, seq_len=seq_len,
                                  notify=notify if lane == 0 else None))
    pad_id = int(tokenizer.pad_id)
    return grain.experimental.ZipIterDataset(streams).map(functools.partial(_stack_mixed_lanes, pad_id=pad_id))
