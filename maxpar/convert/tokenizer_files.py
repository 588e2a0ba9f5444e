"""The tokenizer of a `to_hf` export: files `transformers.AutoTokenizer` loads, giving the ids the model trained on.

maxpar's built-in byte tokenizer (`maxpar.io.data.tokenizer.ByteTokenizer`: a UTF-8 byte b is id b + 3 after pad 0,
bos 1, eos 2) has no file, so one is written: a `tokenizers` tokenizer.json whose byte-level pre-tokenizer turns
each byte into one symbol (GPT-2's byte-to-unicode map, no regex split) and whose BPE model has no merges, so each
byte is one token, of id byte + 3; its post-processor puts <s> first, as maxpar starts every document (and prompt)
with BOS. A Hugging Face tokenizer.json is copied with its tokenizer_config.json and special_tokens_map.json, a
SentencePiece model as tokenizer.model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from maxpar.core import storage
from maxpar.io.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

BYTE_SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: the byte tokenizer's pad, bos and eos
HF_SIBLINGS = ("tokenizer_config.json", "special_tokens_map.json")


@dataclasses.dataclass(frozen=True)
class TokenizerExport:
    """What was written, the special token ids config.json should name, and a note for the user ('' = none)."""
    files: tuple[str, ...]
    token_ids: dict[str, int]
    note: str = ""


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters (what a ByteLevel pre-tokenizer emits): the
    printable Latin-1 bytes stand for themselves, the others for the characters from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def byte_tokenizer_json() -> dict[str, Any]:
    """The byte tokenizer as a `tokenizers` tokenizer.json (its format version 1.0)."""
    specials = [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True} for i, name in enumerate(BYTE_SPECIALS)]
    vocab = {**{name: i for i, name in enumerate(BYTE_SPECIALS)},
             **{char: byte + len(BYTE_SPECIALS) for byte, char in byte_to_unicode().items()}}
    bos = BYTE_SPECIALS[ByteTokenizer.bos_id]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": specials, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                    {"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}}],
                           "special_tokens": {bos: {"id": bos, "ids": [ByteTokenizer.bos_id], "tokens": [bos]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """config.json's token id keys for maxpar's view of a tokenizer."""
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}


def write_tokenizer(directory: Path, tokenizer_path: str, max_length: int) -> TokenizerExport:
    """Write the tokenizer of `tokenizer_path` (a run's key: '' = the byte tokenizer) into `directory`."""
    try:
        tokenizer = load_tokenizer(tokenizer_path)
    except ValueError as e:
        return TokenizerExport((), {}, f"no tokenizer files written: tokenizer_path={tokenizer_path!r}: {e}; give "
                                       f"--tokenizer_path PATH")
    if not tokenizer_path:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                  "clean_up_tokenization_spaces": False, "split_special_tokens": True,  # text '<s>' is bytes
                  **{f"{role}_token": BYTE_SPECIALS[getattr(tokenizer, f"{role}_id")] for role in ("bos", "eos", "pad")}}
        (directory / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(), ensure_ascii=False), "utf-8")
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", "utf-8")
        return TokenizerExport(("tokenizer.json", "tokenizer_config.json"), special_ids(tokenizer))
    source = storage.path(tokenizer_path)
    if source.name.endswith(".model"):
        (directory / "tokenizer.model").write_bytes(source.read_bytes())
        return TokenizerExport(("tokenizer.model",), special_ids(tokenizer),
                               "the SentencePiece model is tokenizer.model; AutoTokenizer also needs a "
                               "tokenizer_config.json naming its class (e.g. LlamaTokenizer)")
    files = ["tokenizer.json"]
    (directory / "tokenizer.json").write_bytes(source.read_bytes())
    for name in HF_SIBLINGS:
        if (source.parent / name).is_file():
            (directory / name).write_bytes((source.parent / name).read_bytes())
            files.append(name)
    if "tokenizer_config.json" not in files:  # the special tokens maxpar found, for AutoTokenizer too
        names = {f"{role}_token": tokenizer.tokenizer.id_to_token(getattr(tokenizer, f"{role}_id"))
                 for role in ("bos", "eos", "pad")}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length, **names}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", "utf-8")
        files.append("tokenizer_config.json")
    return TokenizerExport(tuple(files), special_ids(tokenizer))
