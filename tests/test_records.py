"""dataset_type=grain: JSONL / Parquet record shards, one record = one document, through the text pipeline."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from helpers import read_metrics, tiny_config
from maxpar.config import ConfigError
from maxpar.data.pipeline import make_datasets
from maxpar.data.records import open_records
from maxpar.data.text import resolve_files
from maxpar.data.tokenizer import ByteTokenizer
from maxpar.train import train

WORDS = "shards of records flow through the packer into lanes of the global batch".split()


def record_texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"record {i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(3, 30)))) for i in range(n)]


def write_shards(directory, file_type: str, texts: list[str], shards: int = 3, field: str = "text") -> str:
    """`texts` split over `shards` files (an extra field in every record); returns the glob."""
    directory.mkdir(parents=True, exist_ok=True)
    parts = np.array_split(np.arange(len(texts)), shards)
    for s, ids in enumerate(parts):
        rows = [{"id": int(i), field: texts[i]} for i in ids]
        path = directory / f"part-{s:03d}.{file_type}"
        if file_type == "jsonl":
            path.write_text("".join(json.dumps(r) + "\n" + ("\n" if k == 0 else "") for k, r in enumerate(rows)))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq
            pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)
    return str(directory / f"*.{file_type}")


def grain_config(pattern: str, file_type: str, *overrides: str):
    return tiny_config("dataset_type=grain", f"grain_file_type={file_type}", f"dataset_path={pattern}",
                       "per_device_batch_size=2", *overrides)


def datasets(config, rows: int = 1):
    return make_datasets(config, global_rows=rows, eval_rows=rows, shard_index=0, shard_count=1)


def stream_documents(dataset, n_docs: int) -> list[str]:
    """The first whole documents of a one-lane stream, checking segment ids and positions on the way."""
    tok = ByteTokenizer()
    iterator, tokens = iter(dataset), []
    while tokens.count(tok.bos_id) <= n_docs:
        batch = next(iterator)
        inputs, segments, positions = batch["inputs"][0], batch["segment_ids"][0], batch["positions"][0]
        starts = np.flatnonzero(inputs == tok.bos_id)
        # a new segment (and position 0) exactly where a document starts, except a row's first token
        assert segments[0] == 1 and (np.flatnonzero(np.diff(segments)) + 1).tolist() == [s for s in starts if s]
        expected = np.concatenate([np.arange(b - a) for a, b in zip([0, *[s for s in starts if s]],
                                                                     [*[s for s in starts if s], len(inputs)])])
        np.testing.assert_array_equal(positions, expected)
        tokens.extend(inputs.tolist())
    docs, current = [], []
    for token in tokens[tokens.index(tok.bos_id) + 1:]:
        if token == tok.bos_id:
            docs.append(tok.decode(current))
            current = []
        else:
            current.append(token)
    return docs[:n_docs]


@pytest.mark.parametrize("file_type", ["jsonl", "parquet"])
def test_records_are_documents_in_shard_order(tmp_path, file_type):
    texts = record_texts(11)
    pattern = write_shards(tmp_path, file_type, texts)
    documents = open_records(file_type, resolve_files(pattern), "text", pattern)
    assert len(documents) == 11  # blank JSONL lines are no records
    assert [documents[i] for i in range(11)] == texts


@pytest.mark.parametrize("file_type", ["jsonl", "parquet"])
def test_each_epoch_packs_every_training_record_once(tmp_path, file_type):
    texts = record_texts(9)
    config = grain_config(write_shards(tmp_path, file_type, texts), file_type, "eval_fraction=0")
    train_data, eval_data = datasets(config)
    assert eval_data is None
    docs = stream_documents(train_data, 18)
    assert sorted(docs[:9]) == sorted(texts) and sorted(docs[9:]) == sorted(texts)


def test_eval_records_are_disjoint_from_training(tmp_path):
    texts = record_texts(12)
    config = grain_config(write_shards(tmp_path, "jsonl", texts), "jsonl", "eval_fraction=0.25")
    train_data, eval_data = datasets(config)
    train_docs, eval_docs = set(stream_documents(train_data, 9)), set(stream_documents(eval_data(), 3))
    assert len(train_docs) == 9 and len(eval_docs) == 3
    assert train_docs.isdisjoint(eval_docs) and train_docs | eval_docs == set(texts)


def test_iterator_state_round_trips_through_json(tmp_path):
    config = grain_config(write_shards(tmp_path, "parquet", record_texts(10)), "parquet", "eval_fraction=0")
    iterator = iter(datasets(config, rows=2)[0])
    for _ in range(3):
        next(iterator)
    state = json.loads(json.dumps(iterator.get_state()))
    expected = [next(iterator) for _ in range(3)]
    resumed = iter(datasets(config, rows=2)[0])
    resumed.set_state(state)
    for want, got in zip(expected, [next(resumed) for _ in range(3)]):
        for key in want:
            np.testing.assert_array_equal(want[key], got[key])


def test_no_matching_shards(tmp_path):
    with pytest.raises(ConfigError, match=r"dataset_path=.*matches no files"):
        datasets(grain_config(str(tmp_path / "*.jsonl"), "jsonl"))


@pytest.mark.parametrize("file_type", ["jsonl", "parquet"])
def test_missing_column_lists_the_columns(tmp_path, file_type):
    config = grain_config(write_shards(tmp_path, file_type, record_texts(4), field="body"), file_type)
    with pytest.raises(ConfigError, match=r"dataset_text_field='text': .* no such (field|column); its \w+: (body, id|id, body)$"):
        datasets(config)


@pytest.mark.parametrize("file_type", ["jsonl", "parquet"])
def test_empty_shards(tmp_path, file_type):
    if file_type == "jsonl":
        (tmp_path / "a.jsonl").write_text("\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "a.parquet")
    with pytest.raises(ConfigError, match=r"dataset_path=.*1 \w+ shard\(s\) it matches hold no records"):
        datasets(grain_config(str(tmp_path / f"*.{file_type}"), file_type))


def test_bad_json_names_file_and_record(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    config = grain_config(str(tmp_path / "*.jsonl"), "jsonl", "eval_fraction=0")
    with pytest.raises(ConfigError, match=r"a.jsonl, record 2 is not a JSON object"):
        stream_documents(datasets(config)[0], 4)


def test_short_training_run_on_jsonl(tmp_path):
    pattern = write_shards(tmp_path / "corpus", "jsonl", record_texts(40))
    config = grain_config(pattern, "jsonl", "steps=8", "eval_interval=0", "eval_steps=1", "eval_fraction=0.1")
    train(config, devices=jax.devices()[:2], run_dir=tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["step"] == 8 and np.isfinite(rows[-1]["eval_loss"])
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5


@pytest.mark.parametrize("file_type", ["jsonl", "parquet"])
def test_global_batch_is_the_same_for_any_process_count(tmp_path, file_type):
    config = grain_config(write_shards(tmp_path, file_type, record_texts(10)), file_type, "eval_fraction=0.2")

    def batches(index, count):
        train_data, eval_data = make_datasets(config, global_rows=4, eval_rows=4, shard_index=index, shard_count=count)
        return [[next(it) for _ in range(3)] for it in (iter(train_data), iter(eval_data()))]

    whole = batches(0, 1)
    halves = [batches(i, 2) for i in range(2)]
    for split in range(2):
        for step in range(3):
            for key in whole[split][step]:
                np.testing.assert_array_equal(
                    whole[split][step][key],
                    np.concatenate([halves[i][split][step][key] for i in range(2)]))
