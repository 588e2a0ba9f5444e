"""Tokenizers behind one small protocol.

The byte tokenizer is the default so that a run needs no tokenizer file and no
optional dependency; SentencePiece and Hugging Face files are loaded lazily.
"""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from maxpar.core import storage

_ACCEPTED = (
    "accepted: '' (the built-in byte tokenizer), a SentencePiece '*.model' "
    "file or a Hugging Face 'tokenizer.json' ('*.json') file"
)


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and sampling need from a tokenizer.

    `encode` adds no BOS/EOS: document boundaries are the pipeline's business.
    `pad_id` only fills padding positions; losses are masked by segment id.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes shifted past three specials: works on any text, no file."""

    vocab_size: int = 259
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: Iterable[int]) -> str:
        # Specials and out-of-range ids are dropped so sampled output decodes.
        data = bytes(int(i) - 3 for i in ids if 3 <= int(i) < 259)
        return data.decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class SentencePieceTokenizer:
    """A SentencePiece `*.model` file behind the `Tokenizer` protocol."""

    processor: Any
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        return list(self.processor.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        return self.processor.decode([int(i) for i in ids])


@dataclasses.dataclass(frozen=True)
class HFTokenizer:
    """A Hugging Face `tokenizer.json` behind the `Tokenizer` protocol."""

    tokenizer: Any
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def _specials(*, pad: int | None, bos: int | None, eos: int | None):
    """Fills the protocol's special ids; why the fallbacks are safe:

    pad only fills masked positions, so eos serves; a missing bos falls back to
    eos (GPT-2 style document separator). Without eos documents cannot be
    delimited, so that is an error.
    """
    if eos is None:
        raise ValueError("it defines no end-of-sequence (eos) token")
    return (eos if pad is None else pad), (eos if bos is None else bos), eos


def load_sentencepiece(path: str) -> SentencePieceTokenizer:
    """Loads a SentencePiece model; the import is lazy (optional dependency)."""
    import sentencepiece  # pylint: disable=import-outside-toplevel

    sp = sentencepiece.SentencePieceProcessor(model_proto=storage.path(path).read_bytes())  # local or gs://

    def known(i: int) -> int | None:
        return i if i >= 0 else None

    pad, bos, eos = _specials(
        pad=known(sp.pad_id()), bos=known(sp.bos_id()), eos=known(sp.eos_id())
    )
    return SentencePieceTokenizer(sp, int(sp.get_piece_size()), pad, bos, eos)


_HF_CANDIDATES = types.MappingProxyType({
    "eos": ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]", "[SEP]"),
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "<|bos|>", "[BOS]", "[CLS]"),
    "pad": ("<pad>", "<|pad|>", "[PAD]", "<|padding|>"),
})


def _hf_config_tokens(path: str) -> dict[str, str]:
    """Special-token strings from a sibling tokenizer_config.json, if present.

    tokenizer.json itself does not say which token is eos; the config does.
    """
    config_path = storage.path(path).parent / "tokenizer_config.json"
    if not config_path.is_file():
        return {}
    config = json.loads(config_path.read_text(encoding="utf-8"))
    found = {}
    for role in ("eos", "bos", "pad"):
        value = config.get(f"{role}_token")
        if isinstance(value, dict):  # AddedToken serialization
            value = value.get("content")
        if isinstance(value, str):
            found[role] = value
    return found


def load_hf(path: str) -> HFTokenizer:
    """Loads a Hugging Face tokenizer.json; the import is lazy."""
    import tokenizers  # pylint: disable=import-outside-toplevel

    tok = tokenizers.Tokenizer.from_str(storage.path(path).read_text(encoding="utf-8"))  # local or gs://
    configured = _hf_config_tokens(path)

    def find(role: str) -> int | None:
        names = ((configured[role],) if role in configured else ()) + _HF_CANDIDATES[role]
        for name in names:
            token_id = tok.token_to_id(name)
            if token_id is not None:
                return int(token_id)
        return None

    pad, bos, eos = _specials(pad=find("pad"), bos=find("bos"), eos=find("eos"))
    vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
    return HFTokenizer(tok, vocab_size, pad, bos, eos)


def _char_offsets(text: str, byte_spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """UTF-8 byte spans of `text` as character spans."""
    char_of = [i for i, ch in enumerate(text) for _ in ch.encode("utf-8")] + [len(text)]
    return [(char_of[start], char_of[end - 1] + 1 if end > start else char_of[start]) for start, end in byte_spans]


def encode_with_offsets(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, each token's character span [start, end) in `text`): `encode` with where each token came from, so that
    a span of the text (an assistant turn) can be found among the tokens."""
    if isinstance(tokenizer, HFTokenizer):
        encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(span) for span in encoding.offsets]
    if isinstance(tokenizer, SentencePieceTokenizer):
        pieces = tokenizer.processor.encode_as_immutable_proto(text).pieces
        return [p.id for p in pieces], _char_offsets(text, [(p.begin, p.end) for p in pieces])
    ids = tokenizer.encode(text)  # the byte tokenizer: one token per UTF-8 byte
    return ids, _char_offsets(text, [(i, i + 1) for i in range(len(ids))])


def load_tokenizer(path: str) -> Tokenizer:
    """Picks the tokenizer from the path; every failure is a ValueError.

    ValueError lets the trainer report a clean configuration error naming
    `tokenizer_path` instead of a traceback.
    """
    if path == "":
        return ByteTokenizer()
    full = str(storage.path(path))
    if not full.endswith((".model", ".json")):
        raise ValueError(f"unsupported tokenizer file {path!r}; {_ACCEPTED}")
    if not storage.path(full).is_file():
        raise ValueError(f"tokenizer file {path!r} does not exist; {_ACCEPTED}")
    loader = load_sentencepiece if full.endswith(".model") else load_hf
    try:
        return loader(full)
    except Exception as e:  # corrupt file, missing optional package, ...
        raise ValueError(f"could not load tokenizer {path!r}: {e}; {_ACCEPTED}") from e
