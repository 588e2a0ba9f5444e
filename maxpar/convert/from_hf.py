"""`from_hf`: a Hugging Face checkpoint (local or gs://) -> a maxpar parameters checkpoint for load_parameters_path=.

Streaming: every maxpar parameter is built directly as a sharded jax.Array on the local devices
(`jax.make_array_from_callback`); each device's shard is read from the memory-mapped safetensors
by its own slice: each device holds only its shards, and the host only one device's shard of one
parameter at a time while reading. The checkpoint is written by maxpar's own Orbax manager in the
canonical layout (maxpar/io/checkpoint.py), so any mesh and either layer layout can load it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from maxpar.convert.architectures import Architecture, TensorRule, tensor_rules
from maxpar.convert.hf_config import (ConversionError, architecture_of, model_keys, notes, read_hf_config,
                                      resolve_config, without_absent_mtp)
from maxpar.convert.tensor_blocks import maxpar_block
from maxpar.convert.safetensors_io import TENSOR_FILES, HFTensors
from maxpar.core import storage
from maxpar.core.config import Config, parse_overrides, to_yaml
from maxpar.core.mesh import build_mesh, local_mesh_shape
from maxpar.io import checkpoint
from maxpar.training.train_step import run_layout


def path_name(path: tuple[Any, ...]) -> str:
    """'decoder/layers/attention/query' for a jax key path."""
    return "/".join(str(getattr(key, "key", key)) for key in path)


def parameter_targets(config: Config, devices: Sequence[jax.Device]) -> dict[str, jax.ShapeDtypeStruct]:
    """Every parameter of `config`'s model in the canonical layout, with its sharding on `devices`'
    mesh (the one the config's parallelism keys describe), by path."""
    layout = run_layout(config, local_mesh_shape(config, devices), optax.identity(), check_batch=False)  # no optimizer
    target = checkpoint.Target.of(layout, build_mesh(layout.mesh, devices)).on_disk("params")
    return {path_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(target)}


def check_tensors(tensors: HFTensors, rules: dict[str, TensorRule], leaves: dict[str, jax.ShapeDtypeStruct],
                  architecture: Architecture) -> None:
    """Every HF tensor the model needs is there with the shape config.json implies, and nothing else is.

    Leftover tensors would mean the checkpoint computes something this conversion drops. Tensors of
    rules this model does not use (lm_head of a tied model, which transformers also ignores) may stay.
    """
    expected = {name: rules[path].hf_shape(leaf.shape)
                for path, leaf in leaves.items() for _, name in rules[path].hf_names(leaf.shape)}
    unused = {rule.hf_name for rule in architecture.tensors if rule.path not in rules and not rule.stacked}
    missing = sorted(set(expected) - tensors.names)
    extra = sorted(name for name in tensors.names - set(expected) - unused if not architecture.ignored.fullmatch(name))
    wrong = [f"{name}: {tensors.shape(name)} in the safetensors, {shape} from config.json"
             for name, shape in expected.items() if name in tensors.names and tensors.shape(name) != shape]
    problems = ([f"missing tensors: {_some(missing)}"] if missing else []) + (
        [f"tensors {architecture.name} has no place for: {_some(extra)}"] if extra else []) + wrong[:8]
    if problems:
        raise ConversionError(f"{tensors.directory} does not match its config.json:\n  " + "\n  ".join(problems))


def _some(names: Sequence[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def read_parameter(tensors: HFTensors, rule: TensorRule, leaf: jax.ShapeDtypeStruct) -> jax.Array:
    """One maxpar parameter as a sharded array: each device's shard read from the HF tensors it covers."""
    def shard(index: tuple[slice, ...]) -> np.ndarray:
        return maxpar_block(rule, leaf.shape, index, tensors.read).astype(leaf.dtype)
    return jax.make_array_from_callback(leaf.shape, leaf.sharding, shard)


def hf_tokenizer(hf_path: Path) -> str:
    """The tokenizer file beside a Hugging Face checkpoint that maxpar reads (tokenizer.json, else a SentencePiece
    tokenizer.model), as an absolute path; '' (the byte tokenizer) without one."""
    for name in ("tokenizer.json", "tokenizer.model"):
        if (hf_path / name).is_file():
            return str(storage.absolute(hf_path / name))
    return ""


def convert_from_hf(hf_path: Path, out: Path, argv: Sequence[str], base_config: Path,
                    devices: Sequence[jax.Device] | None = None, log: Callable[[str], None] = print) -> Config:
    """Convert the checkpoint in `hf_path` to OUT/checkpoints/0 (and its config to OUT/config.yml, as a run writes
    it); returns the config it was written with, which the checkpoint carries (`maxpar.io.run_config`).

    `argv` are maxpar `key=value` overrides (model_name=, weight_dtype=, mesh degrees...); model keys
    among them must agree with config.json.
    """
    hf = read_hf_config(hf_path)
    architecture = architecture_of(hf, str(hf_path / "config.json"))
    derived = model_keys(hf, architecture)
    if (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir()):
        raise ConversionError(f"--out {out}: already holds checkpoints; give a new or empty directory")
    with storage.local_directory(hf_path, TENSOR_FILES) as local, HFTensors(local) as tensors:  # safetensors maps files
        derived, dropped = without_absent_mtp(derived, tensors.names)
        config = resolve_config(derived, argv, base_config)
        if "tokenizer_path" not in parse_overrides(argv):  # the checkpoint carries its tokenizer too
            config = dataclasses.replace(config, tokenizer_path=hf_tokenizer(hf_path))
        for note in notes(hf) + dropped:
            log(f"maxpar.convert: note: {note}")
        leaves = parameter_targets(config, list(jax.devices() if devices is None else devices))
        interleaved_rope = config.qk_rope_head_dim if hf.get("rope_interleave", True) else 0
        try:
            rules = tensor_rules(architecture, {path: leaf.shape for path, leaf in leaves.items()},
                                 config.num_decoder_layers, interleaved_rope)
        except ValueError as e:
            raise ConversionError(str(e)) from None
        check_tensors(tensors, rules, leaves, architecture)
        params: dict[str, Any] = {}
        for path, leaf in leaves.items():
            node = params
            *parents, name = path.split("/")
            for parent in parents:
                node = node.setdefault(parent, {})
            node[name] = read_parameter(tensors, rules[path], leaf)
    step_dir = checkpoint.save_parameters(out, params, config)
    (out / "config.yml").write_text(to_yaml(config), encoding="utf-8")  # as a run directory has it
    count = sum(math.prod(leaf.shape) for leaf in leaves.values())
    log(f"maxpar.convert: {architecture.name} from {hf_path}: {count:,} parameters, {config.num_decoder_layers} "
        f"layers, {config.weight_dtype} -> {step_dir}")
    return config
