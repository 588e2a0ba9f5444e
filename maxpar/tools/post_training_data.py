"""Offline post-training material from the running Python's standard library: a tiny Hugging Face model with its own
tokenizer and chat template, SFT conversations and DPO pairs built from the library's docstrings.

    python -m maxpar.tools.post_training_data model --out DIR     # config.json, model.safetensors, tokenizer files
    python -m maxpar.tools.post_training_data sft --out FILE.jsonl [--count N]
    python -m maxpar.tools.post_training_data dpo --out FILE.jsonl [--count N]
    python -m maxpar.tools.post_training_data text --out FILE.jsonl [--count N]    # pretraining text

Nothing is downloaded. The model is a random Llama built by transformers from a small config; its tokenizer is a
byte-level BPE trained here on the docstrings, with a ChatML template whose `{% generation %}` blocks mark the
assistant's tokens. A conversation asks what a function of the standard library does and answers with the first
paragraph of its docstring; a pair's chosen answer is that paragraph, its rejected one the same words garbled; a
text record is a function's name and that paragraph.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import random
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SYSTEM = "You answer questions about the Python standard library in one short paragraph."
MODULES = ("json", "os", "pathlib", "re", "string", "textwrap", "collections", "functools", "itertools", "shutil",
           "argparse", "logging", "datetime", "calendar", "random", "statistics", "fractions", "decimal", "csv",
           "difflib", "heapq", "bisect", "copy", "inspect", "tempfile", "glob", "fnmatch", "gzip", "zipfile",
           "tarfile", "base64", "hashlib", "hmac", "secrets", "uuid", "html", "urllib", "email", "http", "socket",
           "subprocess", "threading", "queue", "sched", "contextlib", "dataclasses", "enum", "typing", "abc", "ast",
           "dis", "tokenize", "pprint", "reprlib", "traceback", "warnings", "weakref", "gettext", "locale")


def answer_of(docstring: str, limit: int = 280) -> str:
    """The first paragraph of a docstring on one line, cut at a sentence end before `limit` characters."""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    if len(paragraph) <= limit:
        return paragraph
    cut = paragraph[:limit]
    return cut[:cut.rfind(". ") + 1] if ". " in cut else cut.rsplit(" ", 1)[0] + "."


@functools.cache
def docstrings(modules: Sequence[str] = MODULES) -> tuple[tuple[str, str], ...]:
    """(qualified name, answer) of every documented public function and method of the modules, read with `ast`
    (nothing is imported), in a fixed order."""
    return tuple(_read_docstrings(modules))


def _read_docstrings(modules: Sequence[str]) -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for module in modules:
        path = root / f"{module}.py"
        files = [path] if path.is_file() else sorted((root / module).glob("*.py"))
        for file in files:
            if file.stem.startswith("_") and file.stem != "__init__":
                continue
            try:
                tree = ast.parse(file.read_text(encoding="utf-8", errors="replace"))
            except SyntaxError:
                continue
            name = module if file.stem in (module, "__init__") else f"{module}.{file.stem}"
            yield from _documented(tree, name)


def _documented(tree: ast.Module, prefix: str) -> Iterator[tuple[str, str]]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from _documented(ast.Module(body=node.body, type_ignores=[]), f"{prefix}.{node.name}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            text = ast.get_docstring(node)
            if text and len(answer_of(text)) >= 20:
                yield f"{prefix}.{node.name}", answer_of(text)


def conversations(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` SFT records {"messages": [...]}: a question on a function, its docstring's answer; every third
    record opens with a system message, every fifth asks a second question."""
    items = list(docstrings())
    random.Random(seed).shuffle(items)
    records = []
    for i, (name, answer) in enumerate(items[:count]):
        messages = [{"role": "system", "content": SYSTEM}] if i % 3 == 0 else []
        messages += [{"role": "user", "content": f"What does {name}() do?"}, {"role": "assistant", "content": answer}]
        if i % 5 == 0 and i + 1 < len(items):
            other, other_answer = items[-(i + 1)]
            messages += [{"role": "user", "content": f"And {other}()?"}, {"role": "assistant", "content": other_answer}]
        records.append({"messages": messages})
    return records


def pairs(count: int, seed: int = 1) -> list[dict[str, Any]]:
    """`count` DPO records: {"prompt": [the question], "chosen": its answer, "rejected": the same words garbled
    (shuffled)}: a preference for well-formed answers, which a small model can learn beyond the pairs it sees."""
    items = [(name, answer) for name, answer in docstrings() if len(set(answer.split())) > 3]
    rng = random.Random(seed)
    rng.shuffle(items)
    records = []
    for name, answer in items[:count]:
        words = answer.split()
        while " ".join(words) == answer:
            rng.shuffle(words)
        records.append({"prompt": [{"role": "user", "content": f"What does {name}() do?"}],
                        "chosen": answer, "rejected": " ".join(words)})
    return records


def texts(count: int = 0) -> list[dict[str, str]]:
    """Pretraining records {"text": ...}: each documented function's name and docstring answer as a sentence (all of
    them when `count` is 0)."""
    items = list(docstrings())
    return [{"text": f"{name}(): {answer}"} for name, answer in (items[:count] if count else items)]


def write_jsonl(records: Sequence[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def build_tokenizer(directory: Path, vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained on the docstrings, with ChatML specials and template, saved by
    transformers into `directory` (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [f"What does {name}() do? {answer}" for name, answer in docstrings()]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def build_model(directory: Path, vocab_size: int, *, hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, intermediate: int = 128, seed: int = 0) -> Path:
    """A random Llama of these dimensions, built and saved (safetensors) by transformers, no download."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=hidden // heads, max_position_embeddings=1024, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def build(directory: Path, **dims: int) -> Path:
    """Tokenizer and model into one directory, as a hub model ships them."""
    tokenizer = build_tokenizer(directory)
    return build_model(directory, -(-len(tokenizer) // 64) * 64, **dims)  # rows to spare: a vocab TP can split


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maxpar.tools.post_training_data",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("model", "sft", "dpo", "text"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=400, help="records (sft, dpo; text: 0 = all)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (model)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (model)")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.what == "model":
        build(args.out, layers=args.layers, hidden=args.hidden, intermediate=2 * args.hidden)
        print(f"tiny Llama and tokenizer -> {args.out}")
    else:
        make, kind = {"sft": (conversations, "conversations"), "dpo": (pairs, "pairs"),
                      "text": (texts, "text records")}[args.what]
        records = make(args.count)
        write_jsonl(records, args.out)
        print(f"{len(records)} {kind} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
