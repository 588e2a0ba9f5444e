"""Config -> train/eval Grain datasets for this process's share of each global batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grain

from maxpar.config import Config, ConfigError
from maxpar.data.hf import open_hf
from maxpar.data.records import open_records
from maxpar.data.synthetic import synthetic_batches
from maxpar.data.text import FileTexts, Subset, document_batches, resolve_files, split_files
from maxpar.data.tokenizer import load_tokenizer


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
            train_files, eval_files = split_files(files, config.eval_fraction, config.seed)
            return FileTexts(train_files), FileTexts(eval_files)
        documents = open_records(config.grain_file_type, files, config.dataset_text_field, config.dataset_path)
    train_ids, eval_ids = split_files(range(len(documents)), config.eval_fraction, config.seed)
    return Subset(documents, train_ids), Subset(documents, eval_ids)


def make_datasets(config: Config, *, global_rows: int, eval_rows: int, shard_index: int, shard_count: int
                  ) -> tuple[grain.IterDataset, Callable[[], grain.IterDataset] | None]:
    """(train dataset, factory of fresh eval datasets or None when nothing is held out)."""
    share = dict(seq_len=config.max_target_length, process_index=shard_index, process_count=shard_count)
    if config.dataset_type == "synthetic":
        def synthetic(rows: int, seed: int) -> grain.IterDataset:
            return synthetic_batches(vocab_size=config.vocab_size, global_batch_rows=rows, seed=seed, **share)
        return synthetic(global_rows, config.seed), lambda: synthetic(eval_rows, config.seed + 1)

    try:
        tokenizer = load_tokenizer(config.tokenizer_path)
    except ValueError as e:
        raise ConfigError(f"tokenizer_path={config.tokenizer_path!r}: {e}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise ConfigError(f"vocab_size={config.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer.vocab_size}); set vocab_size >= {tokenizer.vocab_size}")
    train_docs, eval_docs = corpus(config)
    train = document_batches(train_docs, tokenizer, global_batch_rows=global_rows, seed=config.seed, **share)
    if not len(eval_docs):
        return train, None
    return train, lambda: document_batches(eval_docs, tokenizer, global_batch_rows=eval_rows, seed=config.seed,
                                           **share)
