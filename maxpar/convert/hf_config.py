"""config.json <-> maxpar config.

The model keys come from config.json, never from a guess: a `model_name=` preset or a `key=value`
that disagrees with it is an error naming each key and both values, and a feature maxpar does not
implement (RoPE scaling, biases, another activation...) is refused rather than converted into a
model whose logits would silently differ.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from maxpar.convert.architectures import ARCHITECTURES, REQUIRED, Architecture
from maxpar.core import storage
from maxpar.core.config import (FUNCTION_KEYS, MODEL_KEYS, Config, ConfigError, load_config, parse_overrides,
                                validate)

DEFAULT_ROPE_THETA = 10000.0  # transformers' default when config.json names none
# Llama 3.1+'s `llama3` RoPE scaling: config.json's field -> maxpar key.
LLAMA3_ROPE_KEYS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
                    "high_freq_factor": "rope_high_freq_factor",
                    "original_max_position_embeddings": "rope_original_max_position_embeddings"}
# YaRN (DeepSeek-V3): config.json's field -> maxpar key, and transformers' value when the field is absent (None:
# required; `mscale` absent or null means no mscale ratio, which maxpar's rope_yarn_mscale=0 says).
YARN_ROPE_KEYS = {"factor": ("rope_scaling_factor", None),
                  "original_max_position_embeddings": ("rope_original_max_position_embeddings", None),
                  "beta_fast": ("rope_yarn_beta_fast", 32.0), "beta_slow": ("rope_yarn_beta_slow", 1.0),
                  "mscale": ("rope_yarn_mscale", 0.0), "mscale_all_dim": ("rope_yarn_mscale_all_dim", 0.0)}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")


class ConversionError(ConfigError):
    """Input that cannot be converted faithfully (the CLI prints it and exits with status 2)."""


def read_hf_config(directory: Path, name: str = "config.json") -> dict[str, Any]:
    """config.json (or `name`) of a Hugging Face checkpoint directory, local or gs://."""
    if not directory.is_dir():
        raise ConversionError(f"{directory}: no such directory (a Hugging Face checkpoint: "
                              f"config.json and *.safetensors)")
    path = directory / name
    if not path.is_file():
        raise ConversionError(f"{directory}: no {name} there; a Hugging Face checkpoint directory "
                              f"holds config.json and model.safetensors (or shards with model.safetensors.index.json)")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path}: cannot read it as JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    return hf


def architecture_of(hf: dict[str, Any], source: str = "config.json") -> Architecture:
    """The supported architecture config.json names (its `architectures`, else its `model_type`)."""
    names = hf.get("architectures") or []
    by_type = [arch for arch in ARCHITECTURES.values() if arch.model_type == hf.get("model_type")]
    if len(names) == 1 and names[0] in ARCHITECTURES:
        return ARCHITECTURES[names[0]]
    if not names and len(by_type) == 1:
        return by_type[0]
    named = names or hf.get("model_type")
    raise ConversionError(f"{source}: unsupported architecture {named!r}; maxpar converts "
                          f"{', '.join(ARCHITECTURES)}")


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings, wherever this transformers version put them (`rope_parameters` since 5.0)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return rope if isinstance(rope, dict) else {}


def rope_type(hf: dict[str, Any]) -> str:
    return _rope(hf).get("rope_type", _rope(hf).get("type", "default"))


def rope_scaling_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """maxpar's rope_scaling_* keys from config.json (a `llama3` block: all four of its fields)."""
    rope = _rope(hf)
    if rope_type(hf) == "yarn":
        if rope.get("factor") is None and hf.get("max_position_embeddings") and rope.get(
                "original_max_position_embeddings"):  # transformers' fallback, as DeepSeek-style configs expect
            rope = {**rope, "factor": hf["max_position_embeddings"] / rope["original_max_position_embeddings"]}
        missing = [field for field, (_, default) in YARN_ROPE_KEYS.items()
                   if default is None and rope.get(field) is None]
        if missing:
            raise ConversionError(f"config.json: RoPE scaling 'yarn' lacks {', '.join(missing)}")
        return {"rope_scaling_type": "yarn", **{
            key: (int if field.startswith("original") else float)(default if rope.get(field) is None else rope[field])
            for field, (key, default) in YARN_ROPE_KEYS.items()}}
    if rope_type(hf) != "llama3":
        return {"rope_scaling_type": ""}
    missing = [field for field in LLAMA3_ROPE_KEYS if rope.get(field) is None]
    if missing:
        raise ConversionError(f"config.json: RoPE scaling 'llama3' lacks {', '.join(missing)} "
                              f"(needs {', '.join(LLAMA3_ROPE_KEYS)})")
    return {"rope_scaling_type": "llama3", **{key: (int if field.startswith("original") else float)(rope[field])
                                               for field, key in LLAMA3_ROPE_KEYS.items()}}


def rope_block(config: Config) -> dict[str, Any]:
    """config.json's RoPE scaling fields of `config` (empty without scaling)."""
    if not config.rope_scaling_type:
        return {}
    if config.rope_scaling_type == "yarn":
        return {"rope_type": "yarn", **{field: getattr(config, key) for field, (key, _) in YARN_ROPE_KEYS.items()}}
    return {"rope_type": config.rope_scaling_type,
            **{field: getattr(config, key) for field, key in LLAMA3_ROPE_KEYS.items()}}


def rope_theta(hf: dict[str, Any]) -> float:
    theta = _rope(hf).get("rope_theta", hf.get("rope_theta"))
    return float(DEFAULT_ROPE_THETA if theta is None else theta)


def unsupported(hf: dict[str, Any]) -> list[str]:
    """What config.json asks for that maxpar's model does not compute, one line each."""
    problems = []
    if rope_type(hf) not in SUPPORTED_ROPE_TYPES:
        problems.append(f"RoPE scaling {rope_type(hf)!r} (rope_parameters/rope_scaling): maxpar implements the "
                        f"default RoPE, Llama 3.1's 'llama3' and 'yarn' scaling only; {rope_type(hf)!r} would "
                        f"compute other rotation frequencies")
    if rope_type(hf) == "yarn" and _rope(hf).get("truncate") is False:
        problems.append("RoPE scaling 'yarn' with truncate=false: maxpar rounds the correction range to whole pairs "
                        "(truncate=true, transformers' default)")
    if rope_type(hf) == "yarn" and _rope(hf).get("attention_factor") is not None:
        problems.append(f"RoPE scaling 'yarn' with attention_factor={_rope(hf)['attention_factor']}: maxpar derives "
                        f"the factor from factor, mscale and mscale_all_dim")
    if hf.get("partial_rotary_factor") not in (None, 1, 1.0):
        problems.append(f"partial_rotary_factor={hf['partial_rotary_factor']}: maxpar rotates the whole head")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r}: maxpar's MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            problems.append(f"{key}=true: maxpar's attention and MLP projections have no biases")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window=true: Qwen3 windows only the layers from max_window_layers on; maxpar "
                        "applies one sliding_window to every layer")
    problems += _moe_layout_problems(hf) + _deepseek_problems(hf)
    if hf.get("quantization_config"):
        problems.append("quantization_config: quantized weights are not converted (use an unquantized checkpoint)")
    return problems


def _moe_layout_problems(hf: dict[str, Any]) -> list[str]:
    """Qwen3-MoE's layer pattern that maxpar's MoE cannot represent: dense layers listed by index, and dense
    layers of another width than the experts (maxpar's have mlp_dim)."""
    if hf.get("model_type") != "qwen3_moe":
        return []
    problems = []
    if hf.get("mlp_only_layers"):
        problems.append(f"mlp_only_layers={hf['mlp_only_layers']}: maxpar's dense layers are every layer but each "
                        f"decoder_sparse_step-th (moe_layer_interval), never a list")
    step, dense, expert = hf.get("decoder_sparse_step", 1), hf.get("intermediate_size"), hf.get("moe_intermediate_size")
    if step not in (None, 1) and dense != expert:
        problems.append(f"decoder_sparse_step={step} with intermediate_size={dense} != moe_intermediate_size="
                        f"{expert}: maxpar's dense and expert MLPs share mlp_dim")
    return problems


def _deepseek_problems(hf: dict[str, Any]) -> list[str]:
    """DeepSeek-V3 routing and layer settings maxpar's MoE does not compute."""
    if hf.get("model_type") != "deepseek_v3":
        return []
    problems = []
    expected = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}
    for key, value in expected.items():
        if hf.get(key, value) != value:
            problems.append(f"{key}={hf[key]!r}: maxpar's DeepSeek-V3 routing is {key}={value!r} (sigmoid scores, "
                            f"the e_score_correction_bias for the choice, every layer after the dense ones MoE)")
    experts, groups = hf.get("n_routed_experts"), hf.get("n_group", 8)
    if experts and groups and experts % groups:
        problems.append(f"n_group={groups} does not divide n_routed_experts={experts}: group-limited routing needs "
                        f"equal groups")
    return problems


def without_absent_mtp(derived: dict[str, Any], names: set[str] | frozenset[str]
                       ) -> tuple[dict[str, Any], list[str]]:
    """`derived` with mtp_num_layers cut to the MTP layers the safetensors hold (transformers writes
    num_nextn_predict_layers but saves no MTP layer: it drops them at load), and a note when it cut."""
    declared = derived.get("mtp_num_layers", 0)
    if not declared:
        return derived, []
    layers = derived["num_decoder_layers"]
    held = next((k for k in range(declared) if f"model.layers.{layers + k}.eh_proj.weight" not in names), declared)
    if held == declared:
        return derived, []
    return {**derived, "mtp_num_layers": held}, [
        f"num_nextn_predict_layers={declared} but the safetensors hold {held} MTP layer(s): mtp_num_layers={held}"]


def notes(hf: dict[str, Any]) -> list[str]:
    """Settings that do not change the logits but that the user should know are dropped."""
    dropout, jitter = hf.get("attention_dropout") or 0.0, hf.get("router_jitter_noise") or 0.0
    return ([f"attention_dropout={dropout} is ignored: maxpar has no dropout"] if dropout else []) + (
        [f"router_jitter_noise={jitter} is ignored: maxpar's router adds no noise"] if jitter else [])


def model_keys(hf: dict[str, Any], architecture: Architecture) -> dict[str, Any]:
    """maxpar model keys -> values, from config.json. Raises ConversionError for what maxpar cannot compute."""
    problems = unsupported(hf)
    if problems:
        raise ConversionError(f"{architecture.name} checkpoint uses what maxpar does not implement:\n  "
                              + "\n  ".join(problems))
    values: dict[str, Any] = {"rope_theta": rope_theta(hf), **rope_scaling_keys(hf)}
    missing = []
    for spec in architecture.keys:
        value = hf.get(spec.hf_key) if spec.hf_key else None
        if value is None:
            if spec.default is REQUIRED:
                missing.append(spec.hf_key)
                continue
            value = spec.default(hf) if callable(spec.default) else spec.default
        else:
            value = spec.from_hf(value)
        values[spec.key] = value
    if missing:
        raise ConversionError(f"config.json lacks {', '.join(missing)} (needed for {architecture.name})")
    return values


def resolve_config(derived: dict[str, Any], argv: Sequence[str], base_config: Path) -> Config:
    """The converted checkpoint's config: base_config + `argv` overrides + the `derived` model keys.

    With `model_name=NAME` every derived key must equal the preset's value; without it, the preset that is
    exactly this model is named (`matching_preset`), and model keys given on the command line must equal the
    derived ones. Either way a disagreement is a
    ConversionError naming each key with both values.
    """
    given = parse_overrides(argv)
    preset = given.get("model_name") or ""
    named = [] if "model_name" in given else [f"model_name={matching_preset(derived, base_config)}"]
    config = load_config([str(base_config), *named, *argv])
    checked = list(derived) if preset else [key for key in derived if key in given]
    conflicts = [(key, derived[key], getattr(config, key)) for key in checked if getattr(config, key) != derived[key]]
    if conflicts:
        lines = "\n".join(f"  {key}: {hf!r} in config.json, {mine!r} "
                          f"{'on the command line' if key in given else f'from model_name={preset}'}"
                          for key, hf, mine in conflicts)
        raise ConversionError(f"the Hugging Face config.json and the maxpar config disagree:\n{lines}\n"
                              f"Drop {'model_name= and ' if preset else ''}these keys to take config.json's values.")
    config = dataclasses.replace(config, **derived)
    validate(config)
    return config


def matching_preset(derived: dict[str, Any], base_config: Path) -> str:
    """The preset (configs/models/NAME.yml beside base_config) whose model is exactly the converted one, so that
    the checkpoint's config names it (the run header, `maxpar.io.run_config`); '' when none is."""
    for path in sorted((storage.path(base_config).parent / "models").glob("*.yml"), key=str):
        preset = load_config([str(base_config), f"model_name={path.stem}"])
        if all(getattr(preset, key) == value for key, value in derived.items()):
            return path.stem
    return ""


def training_overrides(config: Config, base_config: Path) -> list[str]:
    """The `key=value`s that make a training run's model the converted one: model_name, then every model key
    (only those that differ from the preset when model_name names one)."""
    reference = load_config([str(base_config), f"model_name={config.model_name}"])
    keys = dict.fromkeys(MODEL_KEYS + FUNCTION_KEYS)
    return [f"model_name={config.model_name}"] + [
        f"{key}={_yaml(getattr(config, key))}" for key in keys
        if not config.model_name or getattr(config, key) != getattr(reference, key)]


def _yaml(value: Any) -> str:
    """A value as the command line's YAML typing reads it back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)  # floats keep a '.' or an exponent, which YAML reads as floats


def hf_config(config: Config, architecture: Architecture, dtype: str,
              template: dict[str, Any] | None = None, token_ids: dict[str, int] | None = None) -> dict[str, Any]:
    """config.json for `config`'s model under `architecture`, with tensors of `dtype`.

    `template` (e.g. the original model's config.json) supplies what maxpar does not model: token
    ids, max_position_embeddings and the like. Its model keys must be this model's. `token_ids` (bos_token_id...:
    the tokenizer the model trained with) stand where the template names none.
    """
    # transformers writes num_nextn_predict_layers but saves no MTP layer: a template may claim one the model lacks.
    mtp_claimed = bool(template) and not config.mtp_num_layers and bool(template.get("num_nextn_predict_layers"))
    if template is not None:
        conflicts = [(key, value, getattr(config, key)) for key, value in model_keys(template, architecture).items()
                     if getattr(config, key) != value and not (mtp_claimed and key == "mtp_num_layers")]
        if conflicts:
            raise ConversionError("the template config.json describes another model:\n" + "\n".join(
                f"  {key}: {theirs!r} in the template, {ours!r} in the checkpoint" for key, theirs, ours in conflicts))
    hf: dict[str, Any] = {"architectures": [architecture.name], "model_type": architecture.model_type}
    for spec in architecture.keys:
        if spec.hf_key:
            hf[spec.hf_key] = spec.to_hf(getattr(config, spec.key))
        elif getattr(config, spec.key) != spec.default:
            raise ConversionError(f"{spec.key}={getattr(config, spec.key)!r}: {architecture.name} has no such "
                                  f"setting (it needs {spec.default!r})")
    hf.update(architecture.hf_constants)
    if mtp_claimed:
        del hf["num_nextn_predict_layers"]  # the template's value stays, as transformers itself would save it
    hf["rope_theta"] = config.rope_theta  # transformers < 5 reads this, >= 5 rope_parameters
    scaling = rope_block(config)
    hf["rope_scaling"] = scaling or None  # transformers < 5; >= 5 reads rope_parameters
    hf["rope_parameters"] = {"rope_type": "default", **scaling, "rope_theta": config.rope_theta}
    hf["torch_dtype"] = hf["dtype"] = dtype
    result = {**(template or {}), **hf}
    for key, source in architecture.hf_defaults.items():
        result.setdefault(key, result[source])
    result.setdefault("max_position_embeddings", config.max_target_length)  # without a template: what it trained on
    for key, value in (token_ids or {}).items():  # a template's own, null included, stand
        result.setdefault(key, value)
    return result
