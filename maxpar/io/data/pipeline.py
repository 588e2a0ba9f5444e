"""Config -> train/eval Grain datasets for this process's share of each global batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain

from maxpar.core.config import Config, ConfigError, source_config
from maxpar.io.data.conversations import open_post_training
from maxpar.io.data.hf import open_hf
from maxpar.io.data.mixture import Notify, Source, mixture_batches
from maxpar.io.data.records import open_records
from maxpar.io.data.synthetic import synthetic_batches
from maxpar.io.data.text import (FilePart, FileTexts, Subset, document_batches, record_shards, resolve_files,
                                  split_files)
from maxpar.io.data.tokenizer import load_tokenizer

# The config keys that give a saved data position (each lane's document count and packer remainder) its meaning,
# by dataset_type: which documents, in which order, tokenized how, packed into rows how long. A checkpoint resumes
# only when they are equal (maxpar/io/checkpoint.py); every key a source reads belongs in its tuple.
_ROWS = ("dataset_type", "seed", "max_target_length")
_DOCUMENTS = _ROWS + ("tokenizer_path", "eval_fraction")
POSITION_KEYS = {
    "synthetic": _ROWS + ("vocab_size",),
    "text": _DOCUMENTS + ("dataset_path",),
    "grain": _DOCUMENTS + ("dataset_path", "grain_file_type", "dataset_text_field"),
    # hf_eval_split decides whether eval_fraction holds out training rows
    "hf": _DOCUMENTS + ("hf_path", "hf_data_files", "hf_train_split", "hf_eval_split", "dataset_text_field"),
    # the keys every source of a dataset_mixture shares; its sources are compared by mixture_differences
    "mixture": ("seed", "max_target_length", "tokenizer_path", "eval_fraction"),
}


# Post-training records (maxpar.io.data.conversations): what a record is, how it is tokenized (hence packed) and
# which of its tokens carry the loss.
POST_TRAINING_KEYS = ("use_sft", "use_dpo", "chat_template_path", "sft_train_on_completion_only")


def position_keys(config: Config) -> tuple[str, ...]:
    """The keys whose values a checkpoint's data position needs unchanged (a mixture's sources apart)."""
    keys = POSITION_KEYS["mixture" if config.dataset_mixture else config.dataset_type]
    return keys + POST_TRAINING_KEYS if config.use_sft or config.use_dpo else keys


def mixture_differences(saved: Mapping[str, Any], config: Config) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, this config's value) where a mixture's saved positions do not fit this config.

    Each source keeps its position under its name, so a source must keep its data keys and no source may go (a
    new one starts from its beginning); weights may change: that starts a new phase. Going from a single source
    to a mixture, or back, changes what a position is. A checkpoint older than the key is not compared."""
    if "dataset_mixture" not in saved:
        return []
    saved_sources = {entry["name"]: entry for entry in saved["dataset_mixture"] or []}
    now = {source.name: source for source in config.dataset_mixture}
    if bool(saved_sources) != bool(now):
        return [("dataset_mixture", list(saved_sources.values()), [s.to_dict() for s in now.values()])]
    differences = []
    for name, entry in saved_sources.items():
        if name not in now:
            differences.append((f"dataset_mixture source {name!r}", entry, "(no such source)"))
            continue
        old = {**saved, **{k: v for k, v in entry.items() if k not in ("name", "weight")}}
        new = source_config(config, now[name]).to_dict()
        keys = POSITION_KEYS[new["dataset_type"]]
        differences += [(f"dataset_mixture source {name!r} {key}", old[key], new[key])
                        for key in keys if key in old and old[key] != new[key]]
    return differences


def corpus(config: Config) -> tuple[Sequence[str], Sequence[str]]:
    """(training documents, eval documents) of a text, grain or hf dataset. Without a named eval split, whole
    documents (files, records, rows) are held out: `eval_fraction` of them, chosen by the seed."""
    if config.dataset_type == "hf":
        documents, named_eval = open_hf(config)
        if named_eval is not None:
            return documents, named_eval
    else:
        try:
            files = resolve_files(config.dataset_path)
        except ValueError as e:
            raise ConfigError(f"dataset_path={config.dataset_path!r}: {e}") from None
        if config.dataset_type == "text":
            return _text_corpus(config, files)
        documents = open_records(config.grain_file_type, files, config.dataset_text_field, config.dataset_path)
    train_ids, eval_ids = split_files(range(len(documents)), config.eval_fraction, config.seed)
    return Subset(documents, train_ids), Subset(documents, eval_ids)


def _text_corpus(config: Config, files: Sequence[str]) -> tuple[Sequence[str], Sequence[str]]:
    """(training, eval) documents of text files: whole files held out, or a single file's tail (`FilePart`). Record
    shards are refused: dataset_type=text would train on their JSON (or binary) as text."""
    shards = record_shards(files)
    if shards:
        raise ConfigError(f"dataset_path={config.dataset_path!r} matches {shards[1]} record shards ({shards[0]}), "
                          f"which dataset_type=text would train on as raw text, JSON syntax and all; use "
                          f"dataset_type=grain grain_file_type={shards[1]} (the text is the dataset_text_field, "
                          f"default 'text')")
    if len(files) == 1:
        held_out = FilePart(files[0], config.eval_fraction, tail=True) if config.eval_fraction else FileTexts([])
        return FilePart(files[0], config.eval_fraction, tail=False), held_out
    train_files, eval_files = split_files(files, config.eval_fraction, config.seed)
    return FileTexts(train_files), FileTexts(eval_files)


@dataclasses.dataclass(frozen=True)
class Datasets:
    """A run's data: the training dataset, a factory of fresh eval datasets (None: nothing is held out), and what
    they read, in words (the run header's data line)."""

    train: grain.IterDataset
    eval: Callable[[], grain.IterDataset] | None
    description: str
    sources: tuple[SourceData, ...] = ()  # a mixture's sources, in the order of the batches' `source_tokens`


@dataclasses.dataclass(frozen=True)
class SourceData:
    """A mixture source as the loop sees it: its name (`tokens/NAME`, `eval_loss/NAME`), its weight, and a factory
    of fresh datasets of its held-out documents (None: nothing held out)."""

    name: str
    weight: float
    eval: Callable[[], grain.IterDataset] | None


def make_datasets(config: Config, *, global_rows: int, eval_rows: int, shard_index: int, shard_count: int
                  ) -> tuple[grain.IterDataset, Callable[[], grain.IterDataset] | None]:
    """(train dataset, factory of fresh eval datasets or None when nothing is held out)."""
    datasets = open_datasets(config, global_rows=global_rows, eval_rows=eval_rows, shard_index=shard_index,
                             shard_count=shard_count)
    return datasets.train, datasets.eval


def open_datasets(config: Config, *, global_rows: int, eval_rows: int, shard_index: int, shard_count: int,
                  notify: Notify | None = None) -> Datasets:
    """The train and eval datasets of this process's share of each global batch, and what they read. `notify`
    hears what a mixture does (a source repeats, a new phase)."""
    share = dict(seq_len=config.max_target_length, process_index=shard_index, process_count=shard_count)
    if config.dataset_type == "synthetic":
        def synthetic(rows: int, seed: int) -> grain.IterDataset:
            return synthetic_batches(vocab_size=config.vocab_size, global_batch_rows=rows, seed=seed, **share)
        return Datasets(synthetic(global_rows, config.seed), lambda: synthetic(eval_rows, config.seed + 1),
                        f"synthetic: random tokens below vocab_size={config.vocab_size}, no tokenizer")

    try:
        tokenizer = load_tokenizer(config.tokenizer_path)
    except ValueError as e:
        raise ConfigError(f"tokenizer_path={config.tokenizer_path!r}: {e}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise ConfigError(f"vocab_size={config.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer.vocab_size}); set vocab_size >= {tokenizer.vocab_size}")
    if config.use_sft or config.use_dpo:
        train, evaluation, description = open_post_training(config, tokenizer, global_rows=global_rows,
                                                            eval_rows=eval_rows, share=share)
        return Datasets(train, evaluation, description)
    if config.dataset_mixture:
        return _open_mixture(config, tokenizer, global_rows=global_rows, eval_rows=eval_rows, share=share,
                             notify=notify)
    train_docs, eval_docs = corpus(config)
    train = document_batches(train_docs, tokenizer, global_batch_rows=global_rows, seed=config.seed, **share)
    description = describe_corpus(config, train_docs, eval_docs, tokenizer.vocab_size)
    if not len(eval_docs):
        return Datasets(train, None, description)
    return Datasets(train, lambda: document_batches(eval_docs, tokenizer, global_batch_rows=eval_rows,
                                                    seed=config.seed, **share), description)


def _open_mixture(config: Config, tokenizer: Any, *, global_rows: int, eval_rows: int, share: dict[str, Any],
                  notify: Notify | None) -> Datasets:
    """A mixture's training batches, each source's eval datasets, and a description line per source."""
    sources, lines = [], []
    for source in config.dataset_mixture:
        try:
            train_docs, eval_docs = corpus(source_config(config, source))
        except ConfigError as e:
            raise type(e)(f"dataset_mixture source {source.name!r}: {e}") from None
        sources.append((Source(source.name, source.weight, train_docs), eval_docs))
        lines.append(f"{source.name} (weight {source.weight:g}) "
                     + describe_documents(source_config(config, source), train_docs, eval_docs))

    def evaluation(eval_docs: Sequence[str]) -> Callable[[], grain.IterDataset] | None:
        if not len(eval_docs):
            return None
        return lambda: document_batches(eval_docs, tokenizer, global_batch_rows=eval_rows, seed=config.seed, **share)

    train = mixture_batches([s for s, _ in sources], tokenizer, global_batch_rows=global_rows, seed=config.seed,
                            notify=notify, **share)
    description = (f"mixture by tokens of {len(sources)} sources: {'; '.join(lines)}; "
                   f"{describe_tokenizer(config, tokenizer.vocab_size)}")
    return Datasets(train, None, description, tuple(SourceData(s.name, s.weight, evaluation(e)) for s, e in sources))


def describe_corpus(config: Config, train_docs: Sequence[str], eval_docs: Sequence[str], vocab_size: int) -> str:
    """Where a text, grain or hf run's documents come from, how many it trains and evaluates on, and its tokenizer."""
    return f"{describe_documents(config, train_docs, eval_docs)}; {describe_tokenizer(config, vocab_size)}"


def describe_tokenizer(config: Config, vocab_size: int) -> str:
    return f"tokenizer {config.tokenizer_path or 'byte-level'} ({vocab_size:,} tokens)"


def describe_documents(config: Config, train_docs: Sequence[str], eval_docs: Sequence[str]) -> str:
    """Where a text, grain or hf source's documents come from, and how many it trains and evaluates on (a single
    text file: which part of it)."""
    if isinstance(train_docs, FilePart):
        if not train_docs.fraction:
            return f"text file {config.dataset_path}: all of it for training, nothing held out (eval_fraction=0)"
        return (f"text file {config.dataset_path}: its first {1 - train_docs.fraction:.0%} for training, its last "
                f"{train_docs.fraction:.0%} (from a line start) for eval")
    if config.dataset_type == "text":
        source, unit = f"text files {config.dataset_path}", "files"
    elif config.dataset_type == "grain":
        source, unit = f"{config.grain_file_type} records {config.dataset_path}", "records"
    else:
        source, unit = f"Hugging Face dataset {config.hf_path or config.hf_data_files}", "rows"
        source += f" (split {config.hf_train_split}" + (f", eval split {config.hf_eval_split})"
                                                        if config.hf_eval_split else ")")
    return f"{source}: {len(train_docs):,} {unit} for training, {len(eval_docs):,} for eval"
