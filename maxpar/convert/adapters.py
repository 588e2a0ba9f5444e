"""Reading a checkpoint's parameters for export, a LoRA run's merged into its base; and LoRA adapters as PEFT's.

A checkpoint is read tensor by tensor (one stacked entry at a time, TensorStore slices), never whole. A LoRA run's
checkpoint holds only its adapters (maxpar.training.trainable): its weights are its base's (the run's
load_parameters_path, read the same way, so a chain of LoRA runs merges in order) with each adapted entry
W + lora_alpha / lora_rank x A B (`maxpar.model.lora.merged`).

PEFT's layout of an adapter of the nn.Linear `M` (transformers' module of the adapted weight): tensors
`base_model.model.M.lora_A.weight` [rank, in] and `.lora_B.weight` [out, rank], `adapter_config.json` with the
rank, lora_alpha and the target modules' names; `peft.PeftModel.from_pretrained(base, DIR)` applies it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from maxpar.convert.architectures import Architecture, TensorRule, tensor_rules
from maxpar.convert.hf_config import ConversionError
from maxpar.convert.tensor_blocks import hf_tensor
from maxpar.convert.safetensors_io import write_safetensors
from maxpar.core import storage
from maxpar.io import checkpoint, logs
from maxpar.model.lora import merged
from maxpar.model.roles import ParamRole, adapter_name, param_role

Index = tuple[int, ...]


def _leaf_paths(tree: Any, prefix: str = "") -> dict[str, Any]:
    """'a/b/c' -> leaf of a nested mapping (Orbax's metadata tree of the params item)."""
    leaves = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        leaves.update(_leaf_paths(value, path + "/") if hasattr(value, "items") else {path: value})
    return leaves


def open_array(metadata: Any, use_zarr3: bool) -> ts.TensorStore:
    """One array of an Orbax (OCDBT) checkpoint item, opened for reading slices."""
    directory = str(metadata.directory)
    logs.tensorstore_credentials(directory)
    base = directory if "://" in directory else Path(directory).absolute().as_uri()
    spec = {"driver": "zarr3" if use_zarr3 else "zarr",
            "kvstore": {"driver": "ocdbt", "base": base, "path": metadata.name}}
    return ts.open(spec, open=True, read=True).result()


class StoredArrays:
    """The arrays of a checkpoint's params item, by path ('decoder/layers/attention/query'), read by stacked entry."""

    def __init__(self, metadata: Any):
        self._arrays = _leaf_paths(metadata.tree)
        self._zarr3 = metadata.use_zarr3
        self._stores: dict[str, ts.TensorStore] = {}
        self.shapes = {path: tuple(meta.shape) for path, meta in self._arrays.items()}

    def read(self, path: str, index: Index) -> np.ndarray:
        if path not in self._stores:
            self._stores[path] = open_array(self._arrays[path], self._zarr3)
        store = self._stores[path]
        return np.asarray((store[index] if index else store).read().result())


@dataclasses.dataclass
class Merged:
    """A LoRA run's model: its base's arrays, each adapted one with the adapter's product added."""

    base: Any  # StoredArrays or Merged
    adapters: StoredArrays
    factor: float

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self.base.shapes

    def read(self, path: str, index: Index) -> np.ndarray:
        w = self.base.read(path, index)
        *parents, name = path.split("/")
        a_path = "/".join((*parents, adapter_name(name, ParamRole.LORA_A)))
        if a_path not in self.adapters.shapes:
            return w
        b_path = "/".join((*parents, adapter_name(name, ParamRole.LORA_B)))
        inputs = param_role(tuple(path.split("/"))).projection.inputs
        return np.asarray(merged(w, self.adapters.read(a_path, index), self.adapters.read(b_path, index), inputs,
                                 self.factor))


@dataclasses.dataclass(frozen=True)
class Source:
    """What a checkpoint holds for export: the step, its saved config, its model's arrays (merged under LoRA) and,
    for a LoRA run, its adapters alone."""

    step: int
    saved: dict[str, Any]
    arrays: Any  # StoredArrays or Merged
    adapters: StoredArrays | None


def open_source(key: str, value: str) -> Source:
    """The checkpoint `value` names (a step directory or a run) as a `Source`."""
    step, saved, metadata = checkpoint.parameters_metadata(key, value)
    stored = StoredArrays(metadata)
    if not saved.get("lora_rank"):
        return Source(step, saved, stored, None)
    base_path = saved.get("load_parameters_path") or ""
    if not base_path:
        raise ConversionError(f"{key}={value}: a LoRA run (lora_rank={saved['lora_rank']}) that started from a seeded "
                              f"initialization has no base weights to merge its adapters into")
    base = open_source(f"{key}={value}'s load_parameters_path", base_path)
    return Source(step, saved, Merged(base.arrays, stored, saved["lora_alpha"] / saved["lora_rank"]), stored)


def write_peft(source: Source, architecture: Architecture, out: Path, dtype: str, base_model: str = "",
               log: Callable[[str], None] = print) -> Path:
    """OUT/adapter_config.json and OUT/adapter_model.safetensors: a LoRA run's adapters as a PEFT LoRA adapter of
    the Hugging Face model its base was converted from."""
    if source.adapters is None:
        raise ConversionError("--peft: the checkpoint is not a LoRA run's (lora_rank=0): it has no adapters")
    saved = source.saved
    targets = sorted({path.rsplit("_lora_", 1)[0] for path in source.adapters.shapes})
    experts = [path for path in targets if param_role(tuple(path.split("/"))).block.value == "experts"]
    if experts:
        raise ConversionError(f"--peft: adapters of expert weights ({experts[0]}) have no PEFT form here (transformers "
                              f"keeps a MoE layer's experts in one fused parameter); export the merged model instead "
                              f"(without --peft)")
    rules = tensor_rules(architecture, {path: source.arrays.shapes[path] for path in targets},
                         saved["num_decoder_layers"], saved["qk_rope_head_dim"])
    entries: list[tuple[str, str, Index, TensorRule]] = []  # (PEFT name, adapter path, stacked index, rule)
    modules = set()
    for path, rule in rules.items():
        *parents, name = path.split("/")
        for index, hf_name in rule.hf_names(source.arrays.shapes[path]):
            module = hf_name.removesuffix(".weight")
            modules.add(module.rsplit(".", 1)[-1])
            for factor, own_rule in ((ParamRole.LORA_A, dataclasses.replace(rule, order=None)),
                                     (ParamRole.LORA_B, dataclasses.replace(rule, inputs=1))):
                letter = "A" if factor is ParamRole.LORA_A else "B"
                entries.append((f"base_model.model.{module}.lora_{letter}.weight",
                                "/".join((*parents, adapter_name(name, factor))), index, own_rule))
    where = {name: (path, index, rule) for name, path, index, rule in entries}

    def produce(name: str) -> np.ndarray:
        path, index, rule = where[name]
        return hf_tensor(rule, source.adapters.read(path, index)).astype(dtype)

    sizes = []
    for name, path, index, _ in entries:
        shape = source.adapters.shapes[path][len(index):]
        sizes.append((name, int(np.prod(shape)) * np.dtype(dtype).itemsize))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": saved["lora_rank"],
              "lora_alpha": saved["lora_alpha"], "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "target_modules": sorted(modules), "base_model_name_or_path": base_model or None,
              "inference_mode": True}
    with storage.staged_directory(out) as directory:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        files = write_safetensors(directory, sizes, produce, max_shard_bytes=2**62)
        files[0].rename(directory / "adapter_model.safetensors")
    log(f"maxpar.convert: step {source.step}'s LoRA adapters (rank {saved['lora_rank']}, {len(modules)} target "
        f"modules: {', '.join(sorted(modules))}) -> PEFT adapter in {out} ({len(entries)} tensors, {dtype})")
    return out

