"""Post-training data: conversations (use_sft) and preference pairs (use_dpo) as packed rows with a loss mask.

Records come from JSON Lines shards (dataset_type=grain, grain_file_type=jsonl) or a Hugging Face dataset
(dataset_type=hf), one conversation or pair each, in the formats TRL reads:
- a conversation: {"messages": [{"role": ..., "content": ...}, ...]} with at least one assistant turn;
- a pair: {"prompt": text, "chosen": text, "rejected": text}, or conversational with "prompt" (or "messages")
  a list of messages and "chosen"/"rejected" each an assistant message list or its text.
A conversation is the tokenizer's chat template rendered and tokenized whole (maxpar.io.data.chat); its loss mask
marks the assistant's tokens (sft_train_on_completion_only) or every token. A pair is two sequences, prompt +
chosen and prompt + rejected (the prompt rendered with the generation prompt, or its text; a text response ends in
EOS): the prompt is their tokens in common with the prompt's own, as TRL splits them, and the mask marks the rest.

Packing keeps records whole: each lane (a row of every global batch, as for documents: maxpar.io.data.text) fills
a row with its next records while they fit and starts the next row with the first that does not, so a
conversation is never split across rows and a pair's two sequences share a row, as its segments 2k - 1 (chosen)
and 2k (rejected) (what maxpar.training.dpo reads). Each sequence is a segment of its own, with positions from 0.
A conversation longer than a row is cut to it; a pair's sequences to half a row each. A lane's position is the
index of the first record of its next row: one integer, so a resumed run rebuilds the same rows.

Bad records (no messages, no assistant turn, an empty response, a prompt that leaves no room for the response)
are one line naming the record: a ConfigError, exit status 2.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from maxpar.core.config import Config, ConfigError
from maxpar.io.data.chat import ChatTemplate, load_chat_template, token_mask
from maxpar.io.data.hf import open_hf_records
from maxpar.io.data.records import JsonlRecords, Record
from maxpar.io.data.text import Subset, _LaneDocuments, process_rows, resolve_files, split_files
from maxpar.io.data.tokenizer import Tokenizer, encode_with_offsets

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Tokens:
    """One sequence: its token ids and which of them the loss counts (1) as targets."""

    ids: np.ndarray
    mask: np.ndarray

    @property
    def positions(self) -> int:
        """The row positions it takes: one per (input, target) pair."""
        return len(self.ids) - 1


# ---------------------------------------------------------------- records -> token sequences

def _messages(value: Any, key: str, where: str) -> list[dict[str, Any]]:
    """A list of role/content messages, or a ConfigError naming the record and the key."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: {key!r} must be a non-empty list of messages ({{role, content}}), got "
                          f"{type(value).__name__}")
    for index, message in enumerate(value):
        if not isinstance(message, Mapping) or message.get("role") not in ROLES or "content" not in message:
            raise ConfigError(f"{where}: {key}[{index}] is not a message with a role ({', '.join(ROLES)}) and a "
                              f"content")
    return [dict(message) for message in value]


@dataclasses.dataclass(frozen=True)
class Formatter:
    """Turns records into token sequences with their loss masks, as a run's config says."""

    tokenizer: Tokenizer
    template: ChatTemplate | None
    completion_only: bool = True

    def _template(self, where: str) -> ChatTemplate:
        if self.template is None:
            raise ConfigError(f"{where}: a conversational record needs a chat template, and this tokenizer has none; "
                              f"set chat_template_path")
        return self.template

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        return encode_with_offsets(self.tokenizer, text)

    def conversation(self, record: Record) -> list[Tokens]:
        """SFT: the conversation of `record["messages"]`, masked to its assistant tokens (or not)."""
        data, where = record
        if "messages" not in data:
            raise ConfigError(f"{where}: no 'messages' (a conversation record holds a list of role/content messages; "
                              f"its keys: {', '.join(sorted(data)) or '(none)'})")
        messages = _messages(data["messages"], "messages", where)
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError(f"{where}: the conversation has no assistant turn, so nothing to train on")
        try:
            rendered = self._template(where).assistant_spans(messages)
        except ConfigError as e:
            raise type(e)(f"{where}: {e}") from None
        ids, offsets = self._encode(rendered.text)
        mask = token_mask(offsets, rendered.spans) if self.completion_only else [1] * len(ids)
        return [Tokens(np.asarray(ids, np.int32), np.asarray(mask, np.int32))]

    def pair(self, record: Record) -> list[Tokens]:
        """DPO: the chosen and the rejected sequence of `record`, each masked to its response."""
        data, where = record
        prompt_key = "prompt" if "prompt" in data else "messages" if "messages" in data else None
        missing = [key for key in (prompt_key or "prompt", "chosen", "rejected") if key not in data]
        if missing:
            raise ConfigError(f"{where}: no {missing[0]!r} (a pair holds prompt or messages, chosen and rejected; its "
                              f"keys: {', '.join(sorted(data)) or '(none)'})")
        for key in ("chosen", "rejected"):
            if data[key] in ("", [], None) or (isinstance(data[key], str) and not data[key].strip()):
                raise ConfigError(f"{where}: the {key} response is empty")
        prompt = data[prompt_key]
        if isinstance(prompt, str):
            return self._text_pair(prompt, data["chosen"], data["rejected"], where)
        messages = _messages(prompt, prompt_key, where)
        return self._conversational_pair(messages, data["chosen"], data["rejected"], where)

    def _text_pair(self, prompt: str, chosen: Any, rejected: Any, where: str) -> list[Tokens]:
        for key, value in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, str):
                raise ConfigError(f"{where}: a text prompt needs a text {key} response, got {type(value).__name__}")
        eos = [self.tokenizer.eos_id]
        prompt_ids = self._encode(prompt)[0]
        return _split_responses(prompt_ids, [self._encode(prompt + chosen)[0] + eos,
                                             self._encode(prompt + rejected)[0] + eos], where)

    def _conversational_pair(self, messages: list[dict[str, Any]], chosen: Any, rejected: Any,
                             where: str) -> list[Tokens]:
        template = self._template(where)

        def turns(value: Any, key: str) -> list[dict[str, Any]]:
            return [{"role": "assistant", "content": value}] if isinstance(value, str) else _messages(value, key, where)
        try:
            prompt_ids = self._encode(template.render(messages, add_generation_prompt=True).text)[0]
            full = [self._encode(template.render(messages + turns(value, key)).text)[0]
                    for key, value in (("chosen", chosen), ("rejected", rejected))]
        except ConfigError as e:
            raise type(e)(f"{where}: {e}") from None
        return _split_responses(prompt_ids, full, where)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _split_responses(prompt: Sequence[int], sequences: Sequence[Sequence[int]], where: str) -> list[Tokens]:
    """Each sequence masked after the prompt: where it and the prompt's own tokens part (TRL's split: the shortest
    common prefix over the pair)."""
    start = min(_common_prefix(prompt, ids) for ids in sequences)
    out = []
    for key, ids in zip(("chosen", "rejected"), sequences):
        if len(ids) <= start:
            raise ConfigError(f"{where}: the {key} response adds no tokens to the prompt")
        out.append(Tokens(np.asarray(ids, np.int32), np.asarray([0] * start + [1] * (len(ids) - start), np.int32)))
    return out


def fitted(group: list[Tokens], seq_len: int, where: str) -> list[Tokens]:
    """A record's sequences cut to fit one row: a conversation to the row, each of a pair's to half of it; a pair
    whose cut leaves a sequence no response token is refused (naming the record)."""
    room = seq_len if len(group) == 1 else seq_len // 2
    cut = [Tokens(t.ids[:room + 1], t.mask[:room + 1]) for t in group]
    if len(group) > 1 and not all(t.mask[1:].any() for t in cut):
        raise ConfigError(f"{where}: its prompt fills the {room} tokens each sequence of a pair may take in a row of "
                          f"max_target_length={seq_len}; raise max_target_length")
    return cut


# ---------------------------------------------------------------- packing

def pack_row(groups: Sequence[list[Tokens]], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """One row [seq_len] of whole records' sequences: inputs, targets, loss_mask, segment_ids (1, 2, ... per
    sequence; 0 = padding) and positions (from 0 in each)."""
    row = {key: np.zeros(seq_len, np.int32) for key in ("inputs", "targets", "loss_mask", "segment_ids",
                                                        "positions")}
    row["inputs"][:], row["targets"][:] = pad_id, pad_id
    at, segment = 0, 0
    for group in groups:
        for tokens in group:
            n, segment = tokens.positions, segment + 1
            row["inputs"][at:at + n], row["targets"][at:at + n] = tokens.ids[:-1], tokens.ids[1:]
            row["loss_mask"][at:at + n] = tokens.mask[1:]
            row["segment_ids"][at:at + n], row["positions"][at:at + n] = segment, np.arange(n)
            at += n
    return row


class _LaneRows(grain.DatasetIterator):
    """One lane's rows: its records (an endless reshuffled sequence) packed whole, next fit. State: the index of the
    lane's first record of its next row."""

    def __init__(self, documents: _LaneDocuments, features: Callable[[Record], list[Tokens]], seq_len: int,
                 pad_id: int):
        super().__init__()
        self._documents, self._features, self._seq_len, self._pad_id = documents, features, seq_len, pad_id
        self._next = 0
        self._cached: tuple[int, list[Tokens]] | None = None  # the record that did not fit the last row

    def _group(self, m: int) -> list[Tokens]:
        if self._cached is None or self._cached[0] != m:
            record = self._documents.document(m)
            self._cached = (m, fitted(self._features(record), self._seq_len, record.where))
        return self._cached[1]

    def __next__(self) -> dict[str, np.ndarray]:
        groups, used = [], 0
        while True:
            group = self._group(self._next)
            size = sum(t.positions for t in group)
            if used + size > self._seq_len:
                break
            groups.append(group)
            used += size
            self._next += 1
        return pack_row(groups, self._seq_len, self._pad_id)

    def get_state(self) -> dict[str, Any]:
        return {"next_record": self._next}

    def set_state(self, state: dict[str, Any]) -> None:
        self._next = int(state["next_record"])


class _Lanes(grain.IterDataset):
    def __init__(self, make: Callable[[], grain.DatasetIterator]):
        super().__init__()
        self._make = make

    def __iter__(self) -> grain.DatasetIterator:
        return self._make()


def record_batches(records: Sequence[Record], features: Callable[[Record], list[Tokens]], *, pad_id: int,
                   seq_len: int, global_batch_rows: int, seed: int, process_index: int = 0,
                   process_count: int = 1) -> grain.IterDataset:
    """This process's rows of an endless stream of packed global batches of whole records: dicts of int32
    [rows, seq_len] arrays inputs, targets, loss_mask, segment_ids, positions. Same seed, same stream, for any
    process count; the iterators' state is JSON."""
    if not len(records):
        raise ConfigError("no records to train on")
    lanes = process_rows(global_batch_rows, process_index, process_count)
    streams = [_Lanes(functools.partial(_LaneRows, _LaneDocuments(records, None, lane=lane, lanes=global_batch_rows,
                                                                  seed=seed), features, seq_len, pad_id))
               for lane in lanes]
    return grain.experimental.ZipIterDataset(streams).map(
        lambda rows: {key: np.stack([row[key] for row in rows]) for key in rows[0]})


# ---------------------------------------------------------------- the run's datasets

def record_corpus(config: Config) -> tuple[Sequence[Record], Sequence[Record]]:
    """(training records, held-out records): a named eval split, else eval_fraction of the records, chosen by the
    seed."""
    if config.dataset_type == "hf":
        records, named_eval = open_hf_records(config)
        if named_eval is not None:
            return records, named_eval
    else:
        try:
            records = JsonlRecords(resolve_files(config.dataset_path))
        except ValueError as e:
            raise ConfigError(f"dataset_path={config.dataset_path!r}: {e}") from None
    if not len(records):
        raise ConfigError(f"dataset_path={config.dataset_path!r}: no records" if config.dataset_type == "grain" else
                          f"hf_path={config.hf_path!r}: no rows")
    train_ids, eval_ids = split_files(range(len(records)), config.eval_fraction, config.seed)
    return Subset(records, train_ids), Subset(records, eval_ids)


def formatter(config: Config, tokenizer: Tokenizer) -> Formatter:
    """The run's formatter; SFT needs the chat template now (DPO's text pairs need none)."""
    try:
        template = load_chat_template(config.tokenizer_path, config.chat_template_path)
    except ConfigError as e:
        if config.use_sft:
            raise type(e)(f"tokenizer_path={config.tokenizer_path!r}: {e}") from None
        template = None
    return Formatter(tokenizer, template, completion_only=config.sft_train_on_completion_only)


def open_post_training(config: Config, tokenizer: Tokenizer, *, global_rows: int, eval_rows: int,
                       share: Mapping[str, int]) -> tuple[grain.IterDataset, Callable[[], grain.IterDataset] | None,
                                                          str]:
    """(training batches, a factory of fresh held-out batches or None, what they read) of a use_sft / use_dpo run.
    The first training record is formatted now, so that a bad template or record format shows before training."""
    fmt = formatter(config, tokenizer)
    features = fmt.pair if config.use_dpo else fmt.conversation
    train, held_out = record_corpus(config)
    fitted(features(train[0]), config.max_target_length, train[0].where)

    def batches(records: Sequence[Record], rows: int) -> grain.IterDataset:
        return record_batches(records, features, pad_id=int(tokenizer.pad_id), global_batch_rows=rows,
                              seed=config.seed, **share)
    kind = "preference pairs" if config.use_dpo else "conversations"
    source = (f"JSONL records {config.dataset_path}" if config.dataset_type == "grain"
              else f"Hugging Face dataset {config.hf_path or config.hf_data_files}")
    template = f"chat template {fmt.template.where}" if fmt.template else "no chat template (text pairs)"
    description = (f"{kind} from {source}: {len(train):,} for training, {len(held_out):,} held out; packed whole; "
                   f"{template}; tokenizer {config.tokenizer_path or 'byte-level'} ({tokenizer.vocab_size:,} tokens)")
    evaluation = (lambda: batches(held_out, eval_rows)) if len(held_out) else None
    return batches(train, global_rows), evaluation, description
