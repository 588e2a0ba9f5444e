"""Hugging Face safetensors checkpoints on local disk (a gs:// one is copied or staged by the caller): read
one slice, write shard by shard.

Reading memory-maps the files (safetensors' `safe_open`/`get_slice`), so a slice costs only its own
bytes. bfloat16 reads as numpy arrays of ml_dtypes' bfloat16 (numpy has none of its own).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy reader needs)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from maxpar.convert.hf_config import ConversionError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TENSOR_FILES = (INDEX, "*.safetensors")  # what HFTensors reads of a checkpoint directory


class HFTensors(contextlib.AbstractContextManager):
    """The tensors of a Hugging Face checkpoint directory: one `model.safetensors`, or the shards that
    `model.safetensors.index.json` lists. Use as a context manager (files stay open inside it)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, Any] = {}
        index = directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConversionError(f"{index}: not a safetensors index (a JSON object with weight_map): {e}") from None
            self._files = {name: directory / file for name, file in weight_map.items()}
        elif (directory / SINGLE).is_file():
            self._files = {name: directory / SINGLE for name in self._handle(directory / SINGLE).keys()}
        else:
            other = sorted(p.name for p in directory.glob("*.bin"))
            raise ConversionError(f"{directory}: no {SINGLE} or {INDEX}"
                                  + (f" (found {', '.join(other)}: re-save with transformers' save_pretrained, "
                                     f"which writes safetensors)" if other else ""))
        absent = sorted({str(path) for path in self._files.values() if not path.is_file()})
        if absent:
            raise ConversionError(f"{index}: lists shard files that do not exist: {', '.join(absent)}")

    def __exit__(self, *exc_info: Any) -> None:
        self._stack.close()
        self._handles.clear()

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            try:
                self._handles[path] = self._stack.enter_context(safe_open(str(path), framework="numpy"))
            except Exception as e:  # safetensors raises its own error types for a damaged header
                raise ConversionError(f"{path}: cannot open as safetensors: {e}") from None
        return self._handles[path]

    @property
    def names(self) -> set[str]:
        return set(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._files[name]).get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """tensor[index] (contiguous slices), reading only those bytes."""
        return np.asarray(self._handle(self._files[name]).get_slice(name)[index])


def shard_plan(sizes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Names grouped into shards of at most `max_shard_bytes` each, in order (a larger tensor gets its own)."""
    shards: list[list[str]] = []
    used = 0
    for name, size in sizes:
        if not shards or (used + size > max_shard_bytes and shards[-1]):
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def with_default_mode(path: Path) -> None:
    """Give `path` the mode of any file this process creates (0666 less the umask): safetensors writes its files
    0600, which would keep a converted model from the other users and services that load it."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def write_safetensors(directory: Path, sizes: Sequence[tuple[str, int]], produce: Callable[[str], np.ndarray],
                      max_shard_bytes: int) -> list[Path]:
    """Write tensors named in `sizes` (name, bytes) as Hugging Face shards, made one by one by `produce`.

    Only one shard's tensors are in memory at a time. One shard is `model.safetensors`; several are
    `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`, as transformers writes them.
    """
    shards = shard_plan(sizes, max_shard_bytes)
    files = ([SINGLE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for names, file in zip(shards, files):
        tensors = {name: np.ascontiguousarray(produce(name)) for name in names}
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        with_default_mode(directory / file)
        del tensors
    if len(shards) > 1:
        weight_map = {name: file for names, file in zip(shards, files) for name in names}
        index = {"metadata": {"total_size": sum(size for _, size in sizes)}, "weight_map": weight_map}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return [directory / file for file in files]
