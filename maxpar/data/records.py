"""Documents from record shards (`dataset_type=grain`): JSON Lines or Parquet, one record = one document.

A corpus is a random-access sequence of texts (document i = record i of the shards in sorted path
order), so the same lanes, packing, shuffling and eval split as whole text files apply (text.py).
Opening a corpus indexes it once: JSONL shards are scanned for line offsets (8 bytes per record
kept), Parquet shards only have their footers read. A record is read when its document is needed:
a JSONL line by seeking to it, a Parquet document by reading its row group's text column (a few
recent row groups are cached; shards written with small row groups read fastest at random).
"""

from __future__ import annotations

import bisect
import collections
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from maxpar.config import ConfigError

FILE_TYPES = ("jsonl", "parquet")
CACHED_ROW_GROUPS = 8


class JsonlTexts(Sequence[str]):
    """The `field` of every non-blank line of JSONL shards."""

    def __init__(self, shards: Sequence[str], field: str):
        self._shards = tuple(shards)
        self._field = field
        self._offsets = [_line_offsets(path) for path in self._shards]
        self._starts = np.cumsum([0] + [len(o) for o in self._offsets]).tolist()
        for path, offsets in zip(self._shards, self._offsets):
            if len(offsets):  # a missing field is reported now, not hours into training
                self._text(path, int(offsets[0]), 1)

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        shard = bisect.bisect_right(self._starts, index) - 1
        local = index - self._starts[shard]
        return self._text(self._shards[shard], int(self._offsets[shard][local]), local + 1)

    def _text(self, path: str, offset: int, record_number: int) -> str:
        with open(path, "rb") as f:
            f.seek(offset)
            line = f.readline()
        where = f"{path}, record {record_number}"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"grain_file_type=jsonl: {where} is not a JSON object: {e}") from None
        if not isinstance(record, dict):
            raise ConfigError(f"grain_file_type=jsonl: {where} is a JSON {type(record).__name__}, not an object")
        return _field_text(record, self._field, where, sorted(record))


def _line_offsets(path: str) -> np.ndarray:
    """Byte offsets of the non-blank lines of a file."""
    offsets, position = [], 0
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    offsets.append(position)
                position += len(line)
    except OSError as e:
        raise ConfigError(f"grain_file_type=jsonl: cannot read {path}: {e}") from None
    return np.asarray(offsets, np.int64)


class ParquetTexts(Sequence[str]):
    """The `field` column of every row of Parquet shards."""

    def __init__(self, shards: Sequence[str], field: str):
        import pyarrow.parquet as pq

        self._field = field
        self._files = []
        group_rows: list[list[int]] = []
        for path in shards:
            try:
                parquet = pq.ParquetFile(path)
            except Exception as e:  # pyarrow raises ArrowInvalid/OSError for a file that is not Parquet
                raise ConfigError(f"grain_file_type=parquet: cannot read {path}: {e}") from None
            names = parquet.schema_arrow.names
            if field not in names:
                raise ConfigError(f"dataset_text_field={field!r}: {path} has no such column; its columns: "
                                  f"{', '.join(names)}")
            self._files.append(parquet)
            group_rows.append([parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)])
        # (shard, row group) of every row group with rows, and the corpus index of its first row
        self._groups = [(s, g) for s, rows in enumerate(group_rows) for g, n in enumerate(rows) if n]
        self._starts = np.cumsum([0] + [group_rows[s][g] for s, g in self._groups]).tolist()
        self._paths = tuple(shards)
        self._cache: collections.OrderedDict[int, list[Any]] = collections.OrderedDict()

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        group = bisect.bisect_right(self._starts, index) - 1
        local = index - self._starts[group]
        text = self._column(group)[local]
        shard, row_group = self._groups[group]
        return _field_text({self._field: text}, self._field,
                           f"{self._paths[shard]}, row group {row_group}, row {local}", [self._field])

    def _column(self, group: int) -> list[Any]:
        if group in self._cache:
            self._cache.move_to_end(group)
            return self._cache[group]
        shard, row_group = self._groups[group]
        column = self._files[shard].read_row_group(row_group, columns=[self._field]).column(0).to_pylist()
        self._cache[group] = column
        if len(self._cache) > CACHED_ROW_GROUPS:
            self._cache.popitem(last=False)
        return column


def _field_text(record: dict[str, Any], field: str, where: str, present: Sequence[str]) -> str:
    if field not in record:
        raise ConfigError(f"dataset_text_field={field!r}: {where} has no such field; its fields: "
                          f"{', '.join(present) or '(none)'}")
    text = record[field]
    if isinstance(text, bytes):
        return text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise ConfigError(f"dataset_text_field={field!r}: {where} holds a {type(text).__name__}, not text")
    return text


def open_records(file_type: str, shards: Sequence[str], field: str, pattern: str) -> Sequence[str]:
    """The documents of the shards; an empty corpus is a ConfigError naming `pattern` (dataset_path)."""
    if file_type not in FILE_TYPES:
        raise ConfigError(f"grain_file_type={file_type!r}: must be one of {', '.join(FILE_TYPES)}")
    texts = (JsonlTexts if file_type == "jsonl" else ParquetTexts)(shards, field)
    if not len(texts):
        raise ConfigError(f"dataset_path={pattern!r}: the {len(shards)} {file_type} shard(s) it matches hold no "
                          f"records")
    return texts
