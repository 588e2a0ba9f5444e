"""Documents from record shards (`dataset_type=grain`): JSON Lines, Parquet or ArrayRecord, one record = one document.

A corpus is a random-access sequence of texts (document i = record i of the shards in sorted path
order), so the same lanes, packing, shuffling and eval split as whole text files apply (text.py).
Opening a corpus indexes it once: JSONL shards are scanned for line offsets (8 bytes per record
kept), Parquet shards only have their footers read. A record is read when its document is needed:
a JSONL line by reading its byte range, a Parquet document by reading its row group's text column (a few
recent row groups are cached; shards written with small row groups read fastest at random), an
ArrayRecord record through Grain's `ArrayRecordDataSource` (random access is what the format is for).
Shards may be gs:// objects: JSONL and Parquet are read through gcsfs file objects and ranged reads;
ArrayRecord's C++ reader opens local files only, so its shards are read from node-local copies
(`storage.local_copy`) while every message and the record order still use the URLs.
An ArrayRecord record is a JSON object or a serialized `tf.train.Example` (what MaxText's and TFDS's
ArrayRecord corpora hold), read without TensorFlow by the few lines of protobuf decoding below.
"""

from __future__ import annotations

import bisect
import collections
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from maxpar.core import storage
from maxpar.core.config import ConfigError
from maxpar.io.data.errors import reading

FILE_TYPES = ("jsonl", "parquet", "arrayrecord")
CACHED_ROW_GROUPS = 8


class JsonlTexts(Sequence[str]):
    """The `field` of every non-blank line of JSONL shards."""

    def __init__(self, shards: Sequence[str], field: str):
        self._shards = tuple(shards)
        self._field = field
        # each shard's line offsets, ending with its size: line i is bytes [offsets[i], offsets[i + 1])
        self._offsets = [_line_offsets(path) for path in self._shards]
        self._starts = np.cumsum([0] + [len(o) - 1 for o in self._offsets]).tolist()
        for shard, offsets in enumerate(self._offsets):
            if len(offsets) > 1:  # a missing field is reported now, not hours into training
                self._text(shard, 0)

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        shard = bisect.bisect_right(self._starts, index) - 1
        return self._text(shard, index - self._starts[shard])

    def _text(self, shard: int, local: int) -> str:
        path, offset, end = self._shards[shard], int(self._offsets[shard][local]), int(self._offsets[shard][local + 1])
        where = f"{path}, record {local + 1}"
        with reading("grain_file_type=jsonl", f"{where} (byte {offset})"):
            line = storage.read_range(path, offset, end).split(b"\n", 1)[0]
        record = _json_object(line, where)
        return _field_text(record, self._field, where, sorted(record))


class Record(NamedTuple):
    """One record as a whole (a post-training conversation or pair), with where it is, for messages."""

    data: dict[str, Any]
    where: str


class JsonlRecords(Sequence[Record]):
    """Every non-blank line of JSONL shards as a whole JSON object (read on demand, like `JsonlTexts`)."""

    def __init__(self, shards: Sequence[str]):
        self._shards = tuple(shards)
        self._offsets = [_line_offsets(path) for path in self._shards]
        self._starts = np.cumsum([0] + [len(o) - 1 for o in self._offsets]).tolist()

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> Record:  # type: ignore[override]
        shard = bisect.bisect_right(self._starts, index) - 1
        local = index - self._starts[shard]
        path, offset, end = self._shards[shard], int(self._offsets[shard][local]), int(self._offsets[shard][local + 1])
        where = f"{path}, record {local + 1}"
        with reading("grain_file_type=jsonl", f"{where} (byte {offset})"):
            line = storage.read_range(path, offset, end).split(b"\n", 1)[0]
        return Record(_json_object(line, where), where)


def _json_object(line: bytes, where: str) -> dict[str, Any]:
    """A JSONL line as an object, or a ConfigError naming the record."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"grain_file_type=jsonl: {where} is not a JSON object: {e}") from None
    if not isinstance(record, dict):
        raise ConfigError(f"grain_file_type=jsonl: {where} is a JSON {type(record).__name__}, not an object")
    return record


def _line_offsets(path: str) -> np.ndarray:
    """Byte offsets of the non-blank lines of a file, then its size (where the last line's range ends)."""
    offsets, position = [], 0
    with reading("grain_file_type=jsonl", path), storage.open_binary(path) as f:
        for line in f:
            if line.strip():
                offsets.append(position)
            position += len(line)
    return np.asarray([*offsets, position], np.int64)


class ParquetTexts(Sequence[str]):
    """The `field` column of every row of Parquet shards."""

    def __init__(self, shards: Sequence[str], field: str):
        import pyarrow.parquet as pq

        self._field = field
        self._files = []
        group_rows: list[list[int]] = []
        for path in shards:
            with reading("grain_file_type=parquet", path):
                parquet = pq.ParquetFile(storage.open_binary(path))  # a file object: local or gs://
            names = parquet.schema_arrow.names
            if field not in names:
                raise ConfigError(f"dataset_text_field={field!r}: {path} has no such column; its columns: "
                                  f"{', '.join(names)}")
            self._files.append(parquet)
            group_rows.append([parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)])
        # (shard, row group) of every row group with rows, and the corpus index of its first row
        self._groups = [(s, g) for s, rows in enumerate(group_rows) for g, n in enumerate(rows) if n]
        self._starts = np.cumsum([0] + [group_rows[s][g] for s, g in self._groups]).tolist()
        shard_firsts = [np.cumsum([0, *rows]).tolist() for rows in group_rows]
        self._first_rows = [shard_firsts[s][g] for s, g in self._groups]  # each group's first row in its shard
        self._paths = tuple(shards)
        self._cache: collections.OrderedDict[int, list[Any]] = collections.OrderedDict()

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        group = bisect.bisect_right(self._starts, index) - 1
        local = index - self._starts[group]
        where = self._where(group, local)
        text = self._column(group, where)[local]
        return _field_text({self._field: text}, self._field, where, [self._field])

    def _where(self, group: int, local: int) -> str:
        """Row `local` of a row group as `PATH, record N (row group G)`, N counting from 1 in its shard."""
        shard, row_group = self._groups[group]
        return f"{self._paths[shard]}, record {self._first_rows[group] + local + 1} (row group {row_group})"

    def _column(self, group: int, where: str) -> list[Any]:
        if group in self._cache:
            self._cache.move_to_end(group)
            return self._cache[group]
        shard, row_group = self._groups[group]
        with reading("grain_file_type=parquet", where):
            column = self._files[shard].read_row_group(row_group, columns=[self._field]).column(0).to_pylist()
        self._cache[group] = column
        if len(self._cache) > CACHED_ROW_GROUPS:
            self._cache.popitem(last=False)
        return column


class ArrayRecordTexts(Sequence[str]):
    """The `field` of every record of ArrayRecord shards (JSON objects or tf.train.Example protos)."""

    def __init__(self, shards: Sequence[str], field: str):
        from grain.sources import ArrayRecordDataSource

        lengths, local = [], []
        for path in shards:  # opened one by one so that a damaged shard is reported now, by name
            with reading("grain_file_type=arrayrecord", path):
                local.append(storage.local_copy(path))
                lengths.append(len(ArrayRecordDataSource([local[-1]])))
        self._source = ArrayRecordDataSource(local)
        self._starts = np.cumsum([0, *lengths]).tolist()
        self._paths = tuple(shards)
        self._field = field
        if len(self):
            self[0]  # a missing field or an unknown record encoding is reported now, not hours into training

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        shard = bisect.bisect_right(self._starts, index) - 1
        where = f"{self._paths[shard]}, record {index - self._starts[shard] + 1}"
        with reading("grain_file_type=arrayrecord", where):
            data = self._source[index]
        record = decode_record(data, where)
        return _field_text(record, self._field, where, sorted(record))


def decode_record(data: bytes, where: str) -> dict[str, Any]:
    """An ArrayRecord record as a dict: a JSON object, or a tf.train.Example's features (bytes values)."""
    if data[:1] == b"{":
        try:
            record = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"grain_file_type=arrayrecord: {where} is not a JSON object: {e}") from None
        if isinstance(record, dict):
            return record
    try:
        return example_features(data)
    except ValueError as e:
        raise ConfigError(f"grain_file_type=arrayrecord: {where} is neither a JSON object nor a tf.train.Example "
                          f"({e})") from None


def example_features(data: bytes) -> dict[str, Any]:
    """A serialized tf.train.Example -> {feature name: its first bytes value, or its list of numbers}.

    Example {Features features = 1}; Features {map<string, Feature> feature = 1}; Feature {oneof
    bytes_list = 1 | float_list = 2 | int64_list = 3}; each list holds `repeated value = 1`."""
    features: dict[str, Any] = {}
    for number, wire, features_message in _protobuf_fields(data):
        if (number, wire) != (1, 2):
            raise ValueError(f"unexpected field {number} in Example")
        for _, _, entry in _protobuf_fields(features_message):  # map entries {string key = 1; Feature value = 2}
            entry_fields = {n: value for n, _, value in _protobuf_fields(entry)}
            key = bytes(entry_fields.get(1, b"")).decode("utf-8", errors="replace")
            for kind, _, values in _protobuf_fields(entry_fields.get(2, b"")):
                items = [v for _, _, v in _protobuf_fields(values)]
                features[key] = bytes(items[0]) if kind == 1 and len(items) == 1 else items
    if not features:
        raise ValueError("no features")
    return features


def _protobuf_fields(data: bytes):
    """(field number, wire type, value) of a protobuf message: varints as ints, length-delimited as bytes."""
    view, position = memoryview(data), 0

    def varint() -> int:
        nonlocal position
        result, shift = 0, 0
        while True:
            if position >= len(view) or shift > 63:
                raise ValueError("truncated varint")
            byte = view[position]
            position += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return result

    while position < len(view):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            yield number, wire, varint()
        elif wire == 2:
            length = varint()
            if position + length > len(view):
                raise ValueError("truncated field")
            yield number, wire, view[position:position + length]
            position += length
        elif wire in (1, 5):  # fixed 64 / 32 bits (float and double values are not text: kept as bytes)
            size = 8 if wire == 1 else 4
            yield number, wire, view[position:position + size]
            position += size
        else:
            raise ValueError(f"unsupported wire type {wire}")


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
    texts = {"jsonl": JsonlTexts, "parquet": ParquetTexts, "arrayrecord": ArrayRecordTexts}[file_type](shards, field)
    if not len(texts):
        raise ConfigError(f"dataset_path={pattern!r}: the {len(shards)} {file_type} shard(s) it matches hold no "
                          f"records")
    return texts
