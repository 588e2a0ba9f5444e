"""Tests for maxpar.io.data: tokenizers, packed text batches, synthetic batches."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from maxpar.io.data import (
                            ByteTokenizer,
                            Tokenizer,
                            load_tokenizer,
                            resolve_files,
                            split_files,
                            synthetic_batches,
                            text_batches,
                            )

KEYS = ("inputs", "targets", "segment_ids", "positions")
MARKER = re.compile(r"@F(\d\d)@")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _write_corpus(tmp_path, n: int, seed: int = 0) -> list[str]:
    """Files with a unique marker at the start and varied lengths (10..150 bytes)."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(1, 25)))
        path = tmp_path / f"doc{i:02d}.txt"
        path.write_text(f"@F{i:02d}@ " + " ".join(words) + "\n", encoding="utf-8")
        paths.append(str(path))
    return paths


@dataclasses.dataclass
class SpyTokenizer:
    """Byte tokenizer that records every text it encodes (= every file read)."""

    seen: list[str] = dataclasses.field(default_factory=list)
    vocab_size: int = 259
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def encode(self, text: str) -> list[int]:
        self.seen.append(text)
        return ByteTokenizer().encode(text)

    def decode(self, ids) -> str:
        return ByteTokenizer().decode(ids)

    def markers(self) -> list[str]:
        return [MARKER.match(t).group(0) for t in self.seen]


def _take(ds, n: int) -> list[dict[str, np.ndarray]]:
    it = iter(ds)
    return [next(it) for _ in range(n)]


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert set(x) == set(y) == set(KEYS)
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


# --- tokenizers -----------------------------------------------------------


def test_byte_tokenizer_ids_and_round_trip():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 0, 1, 2)
    assert tok.encode("A") == [ord("A") + 3]
    text = "héllo, wörld ✓\n"
    ids = tok.encode(text)
    assert ids == [b + 3 for b in text.encode("utf-8")]
    assert all(3 <= i < 259 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    assert load_tokenizer("") == tok


def test_load_tokenizer_errors_name_path(tmp_path):
    missing = str(tmp_path / "nope.model")
    with pytest.raises(ValueError, match=re.escape(missing)) as e:
        load_tokenizer(missing)
    assert ".model" in str(e.value) and "tokenizer.json" in str(e.value)
    bad = tmp_path / "vocab.txt"
    bad.write_text("x")
    with pytest.raises(ValueError, match="vocab.txt") as e:
        load_tokenizer(str(bad))
    assert ".model" in str(e.value)
    corrupt = tmp_path / "broken.json"
    corrupt.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        load_tokenizer(str(corrupt))


def test_hf_tokenizer_json_loads_and_encodes(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
    hf.train_from_iterator(["hello world", "hello there world", "the end"], trainer)
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))

    tok = load_tokenizer(str(path))
    assert isinstance(tok, Tokenizer)
    assert tok.eos_id == hf.token_to_id("</s>")
    assert tok.bos_id == hf.token_to_id("<s>")
    assert tok.pad_id == tok.eos_id  # no pad token defined: eos fills padding
    assert tok.vocab_size == hf.get_vocab_size()
    ids = tok.encode("hello world")
    assert ids == [hf.token_to_id("hello"), hf.token_to_id("world")]
    assert tok.decode(ids) == "hello world"

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello there world the end\n" * 5)
    batch = _take(text_batches([str(corpus)], tok, seq_len=8, global_batch_rows=2, seed=0), 1)[0]
    assert batch["inputs"].shape == (2, 8)
    assert batch["inputs"][0, 0] == tok.bos_id


def test_sentencepiece_model_loads_and_encodes(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    path = tmp_path / "sp.model"
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(["hello world", "hello there", "the world ends"] * 20),
            model_writer=f,
            vocab_size=24,
            model_type="bpe",
        )
    tok = load_tokenizer(str(path))
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.pad_id == tok.eos_id  # sentencepiece's default has no pad
    ids = tok.encode("hello world")
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == "hello world"


# --- files ------------------------------------------------------------------


def test_resolve_files_sorted_recursive_and_no_match_error(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("b")
    (tmp_path / "sub" / "a.txt").write_text("a")
    (tmp_path / "dir.txt").mkdir()  # matches the glob but is not a file
    files = resolve_files(str(tmp_path / "**" / "*.txt"))
    assert files == sorted([str(tmp_path / "b.txt"), str(tmp_path / "sub" / "a.txt")])
    pattern = str(tmp_path / "*.nothing")
    with pytest.raises(ValueError, match=re.escape(pattern)):
        resolve_files(pattern)
    with pytest.raises(ValueError, match="expanded to"):
        resolve_files("{stdlib}/definitely_not_here_*.xyz")


def test_split_files_deterministic_and_disjoint():
    files = [f"f{i}" for i in range(20)]
    train, evals = split_files(files, 0.1, seed=3)
    assert (train, evals) == split_files(files, 0.1, seed=3)
    assert len(evals) == 2 and not set(train) & set(evals)
    assert sorted(train + evals) == sorted(files)
    others = {tuple(split_files(files, 0.1, seed=s)[1]) for s in range(10)}
    assert len(others) > 1
    assert split_files(files, 0.0, seed=3) == (files, [])
    assert len(split_files(files, 0.001, seed=3)[1]) == 1  # at least one held out
    assert split_files(["only"], 0.5, seed=0) == (["only"], [])
    with pytest.raises(ValueError):
        split_files(files, 1.0, seed=0)


# --- packed text batches ----------------------------------------------------


def test_packing_layout(tmp_path):
    files = _write_corpus(tmp_path, 12)
    tok = ByteTokenizer()
    for batch in _take(text_batches(files, tok, seq_len=48, global_batch_rows=3, seed=0), 8):
        assert set(batch) == set(KEYS)
        for k in KEYS:
            assert batch[k].shape == (3, 48) and batch[k].dtype == np.int32
        for inp, tgt, seg, pos in zip(*(batch[k] for k in KEYS)):
            # The stream is endless, so the packer fills every row: no padding.
            assert (seg > 0).all()
            pad = seg == 0
            assert (inp[pad] == tok.pad_id).all() and (pos[pad] == 0).all()
            assert seg[0] == 1 and set(np.diff(seg)) <= {0, 1}
            for t in range(47):
                if seg[t + 1] == seg[t]:
                    assert pos[t + 1] == pos[t] + 1
                    assert tgt[t] == inp[t + 1]  # targets are inputs shifted
                else:  # a document ends inside the row; the next one starts
                    assert tgt[t] == tok.eos_id and inp[t + 1] == tok.bos_id
                    assert pos[t + 1] == 0
            assert (inp[pos == 0][1:] == tok.bos_id).all()
            assert tok.bos_id not in tgt and tok.eos_id not in inp


def _lane_documents(files, n_docs: int, seed: int) -> list[str]:
    """The documents of a single-lane stream, recovered by splitting at BOS."""
    tok = ByteTokenizer()
    it = iter(text_batches(files, tok, seq_len=32, global_batch_rows=1, seed=seed))
    stream: list[int] = []
    while stream.count(tok.bos_id) <= n_docs:
        stream.extend(next(it)["inputs"][0].tolist())
    docs, current = [], []
    for i in stream[1:]:
        if i == tok.bos_id:
            docs.append(tok.decode(current))
            current = []
        else:
            current.append(i)
    return docs[:n_docs]


def test_epochs_cover_all_files_and_reshuffle(tmp_path):
    files = _write_corpus(tmp_path, 8)
    texts = sorted(open(f, encoding="utf-8").read() for f in files)
    docs = _lane_documents(files, 24, seed=5)
    epochs = [docs[0:8], docs[8:16], docs[16:24]]
    for epoch in epochs:
        assert sorted(epoch) == texts
    assert len({tuple(e) for e in epochs}) == 3  # each epoch has its own order


def test_same_seed_same_stream_other_seed_differs(tmp_path):
    files = _write_corpus(tmp_path, 10)
    kwargs = dict(seq_len=32, global_batch_rows=4)
    a = _take(text_batches(files, ByteTokenizer(), seed=1, **kwargs), 5)
    b = _take(text_batches(files, ByteTokenizer(), seed=1, **kwargs), 5)
    c = _take(text_batches(files, ByteTokenizer(), seed=2, **kwargs), 5)
    _assert_batches_equal(a, b)
    assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c))


@pytest.mark.parametrize("n_files", [3, 16])
def test_process_count_invariance(tmp_path, n_files):
    files = _write_corpus(tmp_path, n_files)
    kwargs = dict(seq_len=24, global_batch_rows=8, seed=7)
    whole = _take(text_batches(files, ByteTokenizer(), **kwargs), 12)
    for count in (2, 4):
        parts = [
            _take(text_batches(files, ByteTokenizer(), process_index=i, process_count=count,
                               **kwargs), 12)
            for i in range(count)
        ]
        for step, batch in enumerate(whole):
            for k in KEYS:
                assert all(p[step][k].shape == (8 // count, 24) for p in parts)
                joined = np.concatenate([p[step][k] for p in parts])
                np.testing.assert_array_equal(joined, batch[k], err_msg=f"{count} {step} {k}")
    with pytest.raises(ValueError, match="divisible"):
        text_batches(files, ByteTokenizer(), process_index=0, process_count=3, **kwargs)


def test_each_process_reads_only_its_lanes_files(tmp_path):
    files = _write_corpus(tmp_path, 24)
    kwargs = dict(seq_len=32, global_batch_rows=4, seed=0)
    steps = 3  # stays inside the first epoch (6 documents per lane)

    def run(index: int, count: int):
        spy = SpyTokenizer()
        batches = _take(text_batches(files, spy, process_index=index,
                                     process_count=count, **kwargs), steps)
        shown = {m for b in batches for row in b["inputs"]
                 for m in MARKER.findall(ByteTokenizer().decode(row))}
        return spy.markers(), shown

    read0, shown0 = run(0, 2)
    read1, shown1 = run(1, 2)
    read_all, _ = run(0, 1)
    assert len(read0) == len(set(read0)) and len(read1) == len(set(read1))
    assert not set(read0) & set(read1)
    assert sorted(read0 + read1) == sorted(read_all)
    assert not set(read0) & shown1 and not set(read1) & shown0
    assert len(read_all) < len(files)  # files are read lazily, not up front


def _check_resume(ds, advance: int, more: int = 4):
    it = iter(ds)
    for _ in range(advance):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # as Orbax stores it
    expected = [next(it) for _ in range(more)]
    restored = iter(ds)
    restored.set_state(state)
    _assert_batches_equal([next(restored) for _ in range(more)], expected)


def test_iterator_state_resumes_exactly(tmp_path):
    files = _write_corpus(tmp_path, 10)
    ds = text_batches(files, ByteTokenizer(), seq_len=20, global_batch_rows=2, seed=4)
    for advance in (0, 1, 3, 7, 15):
        _check_resume(ds, advance)


def test_resume_when_rows_end_on_document_boundaries(tmp_path):
    # 15 bytes -> 16 (input, target) pairs: every 32-token row holds exactly two
    # whole documents, so the packer's state has no remainder (empty slices).
    files = []
    for i in range(6):
        path = tmp_path / f"d{i}.txt"
        path.write_text(f"@F{i:02d}@ abcdefghi")
        files.append(str(path))
    ds = text_batches(files, ByteTokenizer(), seq_len=32, global_batch_rows=2, seed=0)
    for batch in _take(ds, 3):
        assert (batch["segment_ids"][:, :16] == 1).all()
        assert (batch["segment_ids"][:, 16:] == 2).all()
    for advance in (1, 2, 5):
        _check_resume(ds, advance)


def test_text_batches_argument_errors(tmp_path):
    files = _write_corpus(tmp_path, 2)
    with pytest.raises(ValueError):
        text_batches([], ByteTokenizer(), seq_len=8, global_batch_rows=2, seed=0)
    with pytest.raises(ValueError):
        text_batches(files, ByteTokenizer(), seq_len=8, global_batch_rows=2, seed=0,
                     process_index=2, process_count=2)


def test_stdlib_smoke():
    files = resolve_files("{stdlib}/*.py")
    assert len(files) > 10 and all(f.endswith(".py") for f in files)
    train, evals = split_files(files, 0.05, seed=0)
    batch = _take(text_batches(train, ByteTokenizer(), seq_len=64, global_batch_rows=2,
                               seed=0), 1)[0]
    assert batch["inputs"].shape == (2, 64)
    assert (batch["inputs"][:, 0] == ByteTokenizer().bos_id).all()


# --- synthetic batches ------------------------------------------------------


def test_synthetic_batches_in_range_and_process_count_invariant():
    kwargs = dict(vocab_size=50, seq_len=16, global_batch_rows=8, seed=3)
    whole = _take(synthetic_batches(**kwargs), 4)
    for batch in whole:
        for k in KEYS:
            assert batch[k].shape == (8, 16) and batch[k].dtype == np.int32
        assert batch["inputs"].min() >= 3 and batch["inputs"].max() < 50
        assert batch["targets"].min() >= 3 and batch["targets"].max() < 50
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
        assert (batch["segment_ids"] == 1).all()
        assert (batch["positions"] == np.arange(16)).all()
    assert not np.array_equal(whole[0]["inputs"], whole[1]["inputs"])
    for count in (2, 4):
        parts = [_take(synthetic_batches(process_index=i, process_count=count, **kwargs), 4)
                 for i in range(count)]
        for step, batch in enumerate(whole):
            for k in KEYS:
                joined = np.concatenate([p[step][k] for p in parts])
                np.testing.assert_array_equal(joined, batch[k])
    other = _take(synthetic_batches(**{**kwargs, "seed": 4}), 1)[0]
    assert not np.array_equal(other["inputs"], whole[0]["inputs"])
    _check_resume(synthetic_batches(**kwargs), 3)
