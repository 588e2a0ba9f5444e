"""Config -> train/eval Grain datasets for this process's share of each global batch."""

from __future__ import annotations

from collections.abc import Callable

import grain

from maxpar.config import Config, ConfigError
from maxpar.data.synthetic import synthetic_batches
from maxpar.data.text import resolve_files, split_files, text_batches
from maxpar.data.tokenizer import load_tokenizer


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
    try:
        files = resolve_files(config.dataset_path)
    except ValueError as e:
        raise ConfigError(f"dataset_path={config.dataset_path!r}: {e}") from None
    train_files, eval_files = split_files(files, config.eval_fraction, config.seed)
    train = text_batches(train_files, tokenizer, global_batch_rows=global_rows, seed=config.seed, **share)
    if not eval_files:
        return train, None
    return train, lambda: text_batches(eval_files, tokenizer, global_batch_rows=eval_rows, seed=config.seed, **share)
