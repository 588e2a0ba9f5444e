"""dataset_type=grain (JSONL / Parquet / ArrayRecord record shards) and dataset_type=hf (a Hugging Face dataset on
local disk): one record or row = one document, through the text pipeline."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import MICRO, kill_and_rerun, read_metrics, micro_config, train_command
from maxpar.core.config import Config, ConfigError
from maxpar.io import checkpoint
from maxpar.io.data.errors import DataError
from maxpar.io.data.pipeline import POSITION_KEYS, POST_TRAINING_KEYS, make_datasets
from maxpar.io.data.records import open_records
from maxpar.io.data.text import resolve_files
from maxpar.io.data.tokenizer import ByteTokenizer
from maxpar.train import main, setup_run, train

WORDS = "shards of records flow through the packer into lanes of the global batch".split()


def record_texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"record {i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(3, 30)))) for i in range(n)]


FILE_TYPES = ["jsonl", "parquet", "arrayrecord"]


def example_bytes(features: dict[str, bytes | int]) -> bytes:
    """A serialized tf.train.Example (bytes or int64 features), encoded here so the test needs no TensorFlow."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)

    def field(number: int, payload: bytes) -> bytes:
        return varint(number << 3 | 2) + varint(len(payload)) + payload

    entries = b""
    for key, value in features.items():
        feature = field(1, field(1, value)) if isinstance(value, bytes) else field(3, field(1, varint(value)))
        entries += field(1, field(1, key.encode()) + field(2, feature))
    return field(1, entries)


def write_shards(directory, file_type: str, texts: list[str], shards: int = 3, field: str = "text") -> str:
    """`texts` split over `shards` files (an extra field in every record); returns the glob. ArrayRecord shards
    alternate JSON-object and tf.train.Example records."""
    directory.mkdir(parents=True, exist_ok=True)
    parts = np.array_split(np.arange(len(texts)), shards)
    for s, ids in enumerate(parts):
        rows = [{"id": int(i), field: texts[i]} for i in ids]
        path = directory / f"part-{s:03d}.{file_type}"
        if file_type == "jsonl":
            path.write_text("".join(json.dumps(r) + "\n" + ("\n" if k == 0 else "") for k, r in enumerate(rows)))
        elif file_type == "arrayrecord":
            from array_record.python.array_record_module import ArrayRecordWriter
            writer = ArrayRecordWriter(str(path), "group_size:2")
            for k, r in enumerate(rows):
                writer.write(json.dumps(r).encode() if k % 2 else example_bytes({"id": r["id"], field: r[field].encode()}))
            writer.close()
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq
            pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)
    return str(directory / f"*.{file_type}")


def grain_config(pattern: str, file_type: str, *overrides: str):
    return micro_config("dataset_type=grain", f"grain_file_type={file_type}", f"dataset_path={pattern}",
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


def save_hf(directory, texts: list[str], eval_texts: list[str] | None = None) -> str:
    """`texts` as a Dataset written by save_to_disk (a DatasetDict with a validation split when eval_texts)."""
    import datasets
    train_set = datasets.Dataset.from_dict({"id": list(range(len(texts))), "text": texts})
    saved = train_set if eval_texts is None else datasets.DatasetDict(
        train=train_set, validation=datasets.Dataset.from_dict({"id": list(range(len(eval_texts))), "text": eval_texts}))
    saved.save_to_disk(str(directory))
    return str(directory)


def hf_config(hf_path: str, *overrides: str):
    return micro_config("dataset_type=hf", f"hf_path={hf_path}", "per_device_batch_size=2", *overrides)


SOURCES = ["jsonl", "parquet", "arrayrecord", "hf-saved", "hf-json"]


def source_config(kind: str, directory, texts: list[str], *overrides: str):
    if kind == "hf-saved":
        return hf_config(save_hf(directory, texts), *overrides)
    if kind == "hf-json":
        return hf_config("json", f"hf_data_files={write_shards(directory, 'jsonl', texts)}", *overrides)
    return grain_config(write_shards(directory, kind, texts), kind, *overrides)


@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_records_are_documents_in_shard_order(tmp_path, file_type):
    texts = record_texts(11)
    pattern = write_shards(tmp_path, file_type, texts)
    documents = open_records(file_type, resolve_files(pattern), "text", pattern)
    assert len(documents) == 11  # blank JSONL lines are no records
    assert [documents[i] for i in range(11)] == texts


@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_each_epoch_packs_every_training_record_once(tmp_path, file_type):
    texts = record_texts(9)
    config = grain_config(write_shards(tmp_path, file_type, texts), file_type, "eval_fraction=0")
    train_data, eval_data = datasets(config)
    assert eval_data is None
    docs = stream_documents(train_data, 18)
    assert sorted(docs[:9]) == sorted(texts) and sorted(docs[9:]) == sorted(texts)


@pytest.mark.parametrize("kind", SOURCES)
def test_eval_records_are_disjoint_from_training(tmp_path, kind):
    texts = record_texts(12)
    train_data, eval_data = datasets(source_config(kind, tmp_path, texts, "eval_fraction=0.25"))
    train_docs, eval_docs = set(stream_documents(train_data, 9)), set(stream_documents(eval_data(), 3))
    assert len(train_docs) == 9 and len(eval_docs) == 3
    assert train_docs.isdisjoint(eval_docs) and train_docs | eval_docs == set(texts)


@pytest.mark.parametrize("kind", SOURCES)
def test_iterator_state_round_trips_through_json(tmp_path, kind):
    config = source_config(kind, tmp_path, record_texts(10), "eval_fraction=0")
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


@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_missing_column_lists_the_columns(tmp_path, file_type):
    config = grain_config(write_shards(tmp_path, file_type, record_texts(4), field="body"), file_type)
    with pytest.raises(ConfigError, match=r"dataset_text_field='text': .* no such (field|column); its \w+: (body, id|id, body)$"):
        datasets(config)


@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_empty_shards(tmp_path, file_type):
    if file_type == "jsonl":
        (tmp_path / "a.jsonl").write_text("\n")
    elif file_type == "arrayrecord":
        write_shards(tmp_path, file_type, [], shards=1)
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


# ---------------------------------------------------------------- dataset_type=hf

def test_hf_named_eval_split(tmp_path):
    texts, held = record_texts(6), record_texts(3, seed=1)
    config = hf_config(save_hf(tmp_path / "ds", texts, held), "hf_eval_split=validation", "eval_fraction=0.5")
    train_data, eval_data = datasets(config)
    assert sorted(stream_documents(train_data, 6)) == sorted(texts)  # the named split replaces the held-out share
    assert sorted(stream_documents(eval_data(), 3)) == sorted(held)


def test_hf_builder_reads_local_files(tmp_path):
    texts = record_texts(8)
    pattern = write_shards(tmp_path / "json", "jsonl", texts, shards=2)
    config = hf_config("json", f"hf_data_files={pattern}", "eval_fraction=0")
    assert sorted(stream_documents(datasets(config)[0], 8)) == sorted(texts)


@pytest.mark.parametrize("overrides, message", [
    (("hf_path=someone/some-dataset",), r"hf_path=.someone/some-dataset.: neither a local directory .* save_to_disk nor a builder of data files \(arrow, csv, json, parquet, text\)"),
    (("hf_path=json",), r"hf_path='json' \(a builder\) needs hf_data_files"),
    (("hf_path=json", "hf_data_files=/nonexistent/*.jsonl"), r"hf_data_files='/nonexistent/\*.jsonl': .* matches no"),
    (("hf_eval_split=test",), r"hf_eval_split='test': .* no such split; its splits: train, validation"),
    (("hf_train_split=all",), r"hf_train_split='all': .* no such split; its splits: train, validation"),
    (("dataset_text_field=body",), r"dataset_text_field='body': .* no such column; its columns: id, text"),
])
def test_hf_errors_name_the_key(tmp_path, overrides, message):
    saved = save_hf(tmp_path / "ds", record_texts(4), record_texts(2))
    with pytest.raises(ConfigError, match=message):
        datasets(hf_config(saved, *overrides))


def test_garbled_arrayrecord_shard_is_named(tmp_path):
    (tmp_path / "a.arrayrecord").write_bytes(b"not an array record file" * 10)
    with pytest.raises(ConfigError, match=r"grain_file_type=arrayrecord: cannot read .*a.arrayrecord"):
        datasets(grain_config(str(tmp_path / "*.arrayrecord"), "arrayrecord"))


def test_arrayrecord_record_of_unknown_encoding_is_named(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter
    writer = ArrayRecordWriter(str(tmp_path / "a.arrayrecord"), "group_size:1")
    writer.write(b"\xff\xfe plain bytes")
    writer.close()
    with pytest.raises(ConfigError, match=r"a.arrayrecord, record 1 is neither a JSON object nor a tf.train.Example"):
        datasets(grain_config(str(tmp_path / "*.arrayrecord"), "arrayrecord"))


# ---------------------------------------------------------------- every source: training, resume, process counts

# A checkpoint keeps the data iterator's state as the JSON its get_state() returns, whatever the source, so each
# source's part of an exact resume is that its state round-trips (test_iterator_state_round_trips_through_json, every
# source) and holds out the same records (test_eval_records_are_disjoint_from_training). Training through a resume,
# eval loss included, on one record-shard source after a clean stop at a checkpoint, and on a Hugging Face dataset
# after kill -9 of a real process (test_kill_9_then_rerun_matches_the_uninterrupted_run).
RESUMED_SOURCES, KILLED_SOURCES = ["jsonl"], ["hf-saved"]
RESUMED = ("eval_interval=4", "eval_steps=1", "eval_fraction=0.1", "enable_checkpointing=true", "checkpoint_period=4",
           "learning_rate_final_fraction=1.0")


@pytest.mark.parametrize("kind", RESUMED_SOURCES)
def test_training_loss_falls_and_resume_is_exact(tmp_path, kind):
    """8 steps in one go equal 4 steps, a checkpoint (model, optimizer and the data iterator's state) and 4 more."""
    config = source_config(kind, tmp_path / "corpus", record_texts(40), "steps=8", *RESUMED)
    train(config, devices=jax.devices()[:2], run_dir=tmp_path / "whole")
    train(dataclasses.replace(config, steps=4), devices=jax.devices()[:2], run_dir=tmp_path / "halves")
    train(config, devices=jax.devices()[:2], run_dir=tmp_path / "halves")
    whole, halves = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "halves")
    assert [r["step"] for r in halves] == list(range(1, 9))
    assert [r["loss"] for r in halves] == [r["loss"] for r in whole]
    assert [r["eval_loss"] for r in halves] == [r["eval_loss"] for r in whole]
    assert whole[-1]["loss"] < whole[0]["loss"] - 0.5 and np.isfinite(whole[-1]["eval_loss"])


@pytest.mark.parametrize("kind", SOURCES)
def test_global_batch_is_the_same_for_any_process_count(tmp_path, kind):
    config = source_config(kind, tmp_path / "corpus", record_texts(10), "eval_fraction=0.2")

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


@pytest.mark.slow
@pytest.mark.parametrize("kind", KILLED_SOURCES)
def test_kill_9_then_rerun_matches_the_uninterrupted_run(tmp_path, kind):
    """A real process killed mid-run (no chance to save) resumes from its newest checkpoint, data iterators
    included, and finishes with the uninterrupted run's losses and eval losses, bit for bit; the loss falls."""
    steps = 12
    config = source_config(kind, tmp_path / "corpus", record_texts(40), f"steps={steps}", *RESUMED,
                           "per_device_batch_size=1")
    train(config, devices=jax.devices(), run_dir=tmp_path / "reference")
    source = ("hf_path",) if kind == "hf-saved" else ("grain_file_type", "dataset_path")
    overrides = [f"dataset_type={config.dataset_type}", *(f"{key}={getattr(config, key)}" for key in source)]
    command = train_command(*overrides, f"steps={steps}", *RESUMED, "per_device_batch_size=1",
                            f"base_output_directory={tmp_path}", "run_name=run")
    kill_and_rerun(command, tmp_path / "run", steps, kill_at=6, checkpoint_step=4, logs=tmp_path)
    rows, expected = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "reference")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["loss"] for r in rows] == [r["loss"] for r in expected]
    assert [r["eval_loss"] for r in rows] == [r["eval_loss"] for r in expected]
    assert expected[-1]["loss"] < expected[0]["loss"] - 0.5 and np.isfinite(expected[-1]["eval_loss"])


# ---------------------------------------------------------------- shards damaged past what opening reads

def resume_newest(run_dir, config, warn=checkpoint.warn_stderr):
    """The state of `run_dir`'s newest usable checkpoint, restored as a resumed run of `config` would."""
    run = setup_run(config, jax.devices())
    manager = checkpoint.make_manager(run_dir, config)
    try:
        return checkpoint.resume(manager, run.restore_target(), iter(run.train_data), warn)
    finally:
        manager.close()


def damage_parquet_row_group(path, row_group: int) -> None:
    """Overwrites the start of a row group's `text` column chunk (its first page header); the footer stays intact."""
    import pyarrow.parquet as pq
    column = pq.ParquetFile(path).metadata.row_group(row_group).column(1)
    start = min(o for o in (column.dictionary_page_offset, column.data_page_offset) if o is not None)
    data = bytearray(path.read_bytes())
    data[start:start + 16] = b"\xff" * 16
    path.write_bytes(bytes(data))


def damage_arrayrecord_record(path, text: str) -> None:
    """Flips the bytes of one record of an uncompressed shard, so its chunk fails Riegeli's hash check."""
    data = bytearray(path.read_bytes())
    start = data.find(text.encode())
    assert start > 0
    data[start:start + len(text)] = bytes(b ^ 0x5A for b in data[start:start + len(text)])
    path.write_bytes(bytes(data))


def damaged_shard(directory, file_type: str, texts: list[str], damaged: int):
    """`texts` in one shard (with an `id` column / field) whose record `damaged` (from 0) fails to read, while
    the shard opens and its first record reads."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"part-000.{file_type}"
    if file_type == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist([{"id": i, "text": t} for i, t in enumerate(texts)]), path,
                       row_group_size=4)
        damage_parquet_row_group(path, damaged // 4)
    else:
        from array_record.python.array_record_module import ArrayRecordWriter
        writer = ArrayRecordWriter(str(path), "group_size:1,uncompressed")
        for i, t in enumerate(texts):
            writer.write(json.dumps({"id": i, "text": t}).encode())
        writer.close()
        damage_arrayrecord_record(path, texts[damaged])
    return path


@pytest.mark.parametrize("file_type, named", [("parquet", r"record (37|38|39|40) \(row group 9\): OSError: "),
                                              ("arrayrecord", r"record 39: RuntimeError: .*hash mismatch")])
def test_a_record_damaged_mid_shard_stops_the_run_with_a_data_error(tmp_path, capsys, file_type, named):
    """Read at whatever step first needs it (step 8 with this corpus and seed): one line naming the shard and the
    record, exit 2; the checkpoint saved before (every step here, so one is in flight when the read fails) restores."""
    path = damaged_shard(tmp_path / "corpus", file_type, record_texts(40), damaged=38)
    overrides = ["dataset_type=grain", f"grain_file_type={file_type}", f"dataset_path={path}", "eval_fraction=0",
                 "per_device_batch_size=1", "steps=40", "enable_checkpointing=true", "checkpoint_period=1"]
    status = main(["configs/base.yml", *MICRO, *overrides, f"base_output_directory={tmp_path}", "run_name=run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, err
    assert re.fullmatch(rf"maxpar: data error: grain_file_type={file_type}: cannot read {re.escape(str(path))}, "
                        rf"{named}.*", err[-1]), err[-1]
    saved = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] >= 2 and not list((tmp_path / "run" / "checkpoints").glob("*.unusable"))
    warnings: list[str] = []
    assert int(resume_newest(tmp_path / "run", micro_config(*overrides), warnings.append).step) == saved[-1]
    assert not warnings


def test_a_text_file_that_vanishes_mid_run_is_a_data_error(tmp_path):
    (tmp_path / "a.txt").write_text("a document")
    (tmp_path / "b.txt").write_text("another document")  # files are read as the lanes reach them (one is read at once)
    config = micro_config("dataset_type=text", f"dataset_path={tmp_path / '*.txt'}", "eval_fraction=0")
    train_data, _ = datasets(config)
    (tmp_path / "a.txt").unlink()
    with pytest.raises(DataError, match=r"dataset_type=text: cannot read .*a.txt: FileNotFoundError: "):
        next(iter(train_data))


# ---------------------------------------------------------------- resuming on other data

def test_every_config_key_the_data_sources_read_is_checked_on_resume():
    """A key a source reads (`config.KEY` in maxpar/io/data/) must be compared when a run resumes (a mixture's
    sources by pipeline.mixture_differences, tests/test_mixture.py)."""
    sources = Path(open_records.__code__.co_filename).parent.glob("*.py")
    read = ({key for path in sources for key in re.findall(r"\bconfig\.(\w+)", path.read_text())}
            & {field.name for field in dataclasses.fields(Config)})
    checked = set(checkpoint.MODEL_KEYS).union(*POSITION_KEYS.values(), POST_TRAINING_KEYS, {"dataset_mixture"})
    assert read and read <= checked


def test_hf_resume_on_another_dataset_split_field_or_tokenizer_is_refused(tmp_path, capsys):
    import datasets as hf_datasets
    tokenizers = pytest.importorskip("tokenizers")
    splits = {name: hf_datasets.Dataset.from_dict({"text": record_texts(12, seed), "body": record_texts(12, seed + 2)})
              for name, seed in (("train", 0), ("validation", 1))}
    hf_datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "ds"))
    shutil.copytree(tmp_path / "ds", tmp_path / "copy")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(WORDS, tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    overrides = ["eval_fraction=0", "per_device_batch_size=1", "steps=2", "enable_checkpointing=true"]
    train(hf_config(str(tmp_path / "ds"), *overrides), devices=jax.devices(), run_dir=tmp_path / "run")

    def resume(*changes: str):
        return resume_newest(tmp_path / "run", hf_config(str(tmp_path / "ds"), *overrides, *changes))

    assert int(resume().step) == 2
    changes = {"hf_path": f"hf_path={tmp_path / 'copy'}", "hf_train_split": "hf_train_split=validation",
               "dataset_text_field": "dataset_text_field=body",
               "tokenizer_path": f"tokenizer_path={tmp_path / 'tokenizer.json'}"}
    for key, change in changes.items():
        with pytest.raises(checkpoint.IncompatibleCheckpoint, match=rf"keys differ:\n  {key}: .* in the checkpoint, "):
            resume(change)
    status = main(["configs/base.yml", *MICRO, "dataset_type=hf", f"hf_path={tmp_path / 'ds'}", *overrides,
                   *changes.values(), f"base_output_directory={tmp_path}", "run_name=run"])
    err = capsys.readouterr().err
    assert status == 2 and "maxpar: config error: checkpoint step 2" in err
    assert all(f"\n  {key}: " in err for key in changes), err
