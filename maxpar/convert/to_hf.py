"""`to_hf`: a maxpar checkpoint's parameters -> config.json + safetensors that transformers loads.

Tensor by tensor: each HF tensor is read from the Orbax checkpoint on its own (one layer of a
stacked parameter is one TensorStore read of that slice), and safetensors shards are written one
at a time, so memory holds at most one shard.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (bfloat16 for numpy)
import numpy as np

from maxpar.convert.adapters import open_source, write_peft
from maxpar.convert.architectures import ARCHITECTURES, Architecture, TensorRule, tensor_rules
from maxpar.convert.hf_config import ConversionError, architecture_of, hf_config, read_hf_config
from maxpar.convert.tensor_blocks import hf_tensor
from maxpar.convert.safetensors_io import write_safetensors
from maxpar.convert.tokenizer_files import write_tokenizer
from maxpar.core import storage
from maxpar.core.config import Config, config_from_dict, load_config

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


def saved_config(saved: dict[str, Any], base_config: Path) -> Config:
    """The checkpoint's config; keys it predates take base_config's defaults (e.g. sliding_window: 0)."""
    defaults = load_config([str(base_config), "model_name="]).to_dict()
    unknown = sorted(set(saved) - set(defaults))
    if unknown:
        raise ConversionError(f"the checkpoint's config has keys this maxpar does not know: {', '.join(unknown)} "
                              f"(written by another version?)")
    return config_from_dict({**defaults, **saved})


def default_architecture(config: Config) -> Architecture:
    """DeepSeek-V3 for multi-head latent attention; with QK-norm Qwen3 (Qwen3-MoE for a mixture of experts), the
    only family that has it; else Mixtral for a mixture of experts, Mistral when the model has a sliding window
    (Llama has none), else Llama."""
    if config.attention_type == "mla":
        return ARCHITECTURES["DeepseekV3ForCausalLM"]
    if config.qk_norm:
        return ARCHITECTURES["Qwen3MoeForCausalLM" if config.num_experts > 1 else "Qwen3ForCausalLM"]
    if config.num_experts > 1:
        return ARCHITECTURES["MixtralForCausalLM"]
    return ARCHITECTURES["MistralForCausalLM" if config.sliding_window else "LlamaForCausalLM"]


HF_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def hf_order(rules: dict[str, TensorRule], shapes: dict[str, tuple[int, ...]]
             ) -> list[tuple[str, str, tuple[int, ...]]]:
    """(HF name, maxpar path, stacked index) in transformers' order: embedding, layer by layer, norm, head."""
    keyed = []
    for position, (path, rule) in enumerate(rules.items()):
        for index, name in rule.hf_names(shapes[path]):
            layer = HF_LAYER.match(name)
            group = 1 if layer else 0 if name == "model.embed_tokens.weight" else 2
            keyed.append(((group, int(layer[1]) if layer else 0, position, index), (name, path, index)))
    return [entry for _, entry in sorted(keyed)]


def convert_to_hf(checkpoint_path: str, out: Path, base_config: Path, architecture: str | None = None,
                  dtype: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                  template_path: Path | None = None, log: Callable[[str], None] = print,
                  tokenizer_path: str | None = None, peft: bool = False) -> Path:
    """Write OUT/config.json, OUT/*.safetensors and the tokenizer's files from the checkpoint at `checkpoint_path`
    (a LoRA run's: its adapters merged into its base); with `peft`, a LoRA run's adapters as a PEFT adapter instead
    (maxpar.convert.adapters).

    `template_path`: a config.json, or a directory holding one, whose other keys (token ids,
    max_position_embeddings...) the output keeps; it also names the architecture unless `architecture` does.
    `tokenizer_path`: the tokenizer to write (None: the one the checkpoint's run trained with; '' the byte one).
    """
    source = open_source("--checkpoint", checkpoint_path)
    step, saved = source.step, source.saved
    config = saved_config(saved, base_config)
    template = None
    if template_path is not None:
        is_dir = template_path.is_dir()
        template = read_hf_config(template_path if is_dir else template_path.parent,
                                  "config.json" if is_dir else template_path.name)
    if architecture:
        arch = ARCHITECTURES[architecture]
    else:
        arch = architecture_of(template, str(template_path)) if template else default_architecture(config)
    dtype = dtype or config.weight_dtype
    if peft:
        base_model = str(template_path if template_path is None or template_path.is_dir() else template_path.parent)
        return write_peft(source, arch, out, dtype, base_model if template_path else "", log)
    shapes = source.arrays.shapes
    try:
        rules = tensor_rules(arch, shapes, config.num_decoder_layers, config.qk_rope_head_dim)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    entries = hf_order(rules, shapes)
    targets = {path: np.dtype("float32" if rule.float32 else dtype) for path, rule in rules.items()}
    sizes = [(name, int(np.prod(rules[path].hf_shape(shapes[path]))) * targets[path].itemsize)
             for name, path, _ in entries]
    where = {name: (path, index) for name, path, index in entries}

    def produce(name: str) -> np.ndarray:
        path, index = where[name]
        return hf_tensor(rules[path], source.arrays.read(path, index)).astype(targets[path])

    with storage.staged_directory(out) as directory:  # safetensors writes local files; a gs:// OUT gets them after
        directory.mkdir(parents=True, exist_ok=True)
        tokenizer = write_tokenizer(directory, config.tokenizer_path if tokenizer_path is None else tokenizer_path,
                                    config.max_target_length)
        hf = hf_config(config, arch, dtype, template, tokenizer.token_ids)
        (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
        files = write_safetensors(directory, sizes, produce, max_shard_bytes)
    log(f"maxpar.convert: step {step} of {checkpoint_path} -> {arch.name} in {out} ({len(entries)} tensors, "
        f"{dtype}, {len(files)} safetensors file(s); tokenizer: {', '.join(tokenizer.files) or 'none'})")
    if tokenizer.note:
        log(f"maxpar.convert: note: {tokenizer.note}")
    return out
