"""Hugging Face interop: tiny random models built by transformers itself, converted both ways.

maxpar's logits equal transformers' (one device, FSDP(8), FSDP(4)xTP(2), unrolled layers), a run
started from a converted checkpoint has transformers' loss at step 0, from_hf -> to_hf gives back the
original tensors, and bad input exits with status 2 and says why. A tiny DeepSeek-V3 (MLA, YaRN, dense prefix,
sigmoid group-limited experts, a shared expert, an MTP layer added to its safetensors) has its own tests at the end.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MixtralConfig, MixtralForCausalLM, MistralForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from helpers import REPO, layout_on, shared, shared_dir, write_corpus
from maxpar.convert.__main__ import OVERRIDES_FILE, main
from maxpar.convert.architectures import ARCHITECTURES
from maxpar.convert.hf_config import ConversionError, hf_config, model_keys, resolve_config, training_overrides
from maxpar.convert.tensor_blocks import hf_tensor, maxpar_block
from maxpar.convert.safetensors_io import HFTensors, write_safetensors
from maxpar.core.config import ConfigError, load_config, model_config
from maxpar.io import checkpoint
from maxpar.model import Transformer
from maxpar.train import setup_run, train

BASE = REPO / "configs" / "base.yml"
VOCAB = 264  # >= the byte tokenizer's 259, so the text pipeline can train these models

# name -> (transformers classes, config, save dtype, save_pretrained max_shard_size)
MODELS = {
    # GQA 4/2, sharded safetensors (index + several files)
    "llama": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, rms_norm_eps=1e-5), torch.float32, "40KB"),
    # GQA 4/2, head_dim != hidden/heads, rope_theta 5e5, a sliding window shorter than the sequence, one file
    "mistral": (MistralConfig, MistralForCausalLM, dict(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, rms_norm_eps=1e-6, sliding_window=4,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), torch.float32, None),
    # tied embeddings, multi-head (4/4), stored in bfloat16
    "tied": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=VOCAB, tie_word_embeddings=True), torch.bfloat16, None),
    # 4 experts, top-2, GQA 4/2, sharded safetensors (one tensor per expert on disk)
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(
        hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5),
        torch.float32, "40KB"),
    # QK-norm, GQA 4/2, head_dim != hidden/heads, tied embeddings (as Qwen3-0.6B), rope_theta 1e6
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), torch.float32, None),
    # QK-norm and 4 experts of moe_intermediate_size, top-2 renormalized (norm_topk_prob), every layer MoE
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        hidden_size=48, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        torch.float32, "40KB"),
}

# DeepSeek-V3 as the deepseek-tiny preset (its own tests below, not every test of MODELS): MLA with a compressed
# query and interleaved YaRN RoPE, 1 dense layer then 2 MoE layers of 8 sigmoid-routed experts in 4 groups (top-2
# of the best 2) scaled by 2.5, plus a shared expert. transformers saves no MTP layer (`deepseek_mtp` adds one).
DEEPSEEK = {"deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, vocab_size=VOCAB, rms_norm_eps=1e-6,
    max_position_embeddings=256, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}), torch.float32, None)}

MESHES = {
    "one": (1, ["ici_fsdp_parallelism=1"]),
    "fsdp8": (8, []),
    "fsdp4_tp2": (8, ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    "tp2_unrolled": (8, ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "scan_layers=false"]),
}


def save_hf_model(directory: Path, name: str, seed: int = 0, dtype: torch.dtype | None = None, **changes) -> Path:
    """A random model of MODELS[name] (its config `changes`d) saved by transformers in its dtype (or `dtype`), with
    the modules transformers keeps in float32 (DeepSeek-V3's router) so; weights far from init so every tensor
    matters."""
    config_class, model_class, dims, saved_dtype, shard = {**MODELS, **DEEPSEEK}[name]
    torch.manual_seed(seed)
    model = model_class._from_config(config_class(**{**dims, **changes}), dtype=dtype or saved_dtype)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):  # DeepSeek's routing bias: a saved buffer
                buffer.normal_(0.0, 0.15)
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return directory


def hf_model(directory: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(directory)(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def reference_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    """transformers' logits of a session-wide model directory (`hf_model_dir`): computed once per model and tokens,
    whichever mesh case or module asks first."""
    return shared(lambda: hf_logits(directory, tokens), "hf_logits", str(directory), tokens.shape, tokens.tobytes())


def hf_model_dir(name: str) -> Path:
    """MODELS[name] or DEEPSEEK[name] as `save_hf_model` saves it (seed 0): once per session, for every module."""
    return shared_dir(lambda directory: save_hf_model(directory, name), "hf_model", name)


def converted_dir(hf_dir: Path) -> Path:
    """`python -m maxpar.convert from_hf` of `hf_dir` (in process, FSDP over the 8 devices): once per session."""
    def convert(directory: Path) -> None:
        assert main(["from_hf", "--hf_path", str(hf_dir), "--out", str(directory / "converted")]) == 0
    return shared_dir(convert, "from_hf", str(hf_dir)) / "converted"


def overrides_of(converted: Path) -> list[str]:
    """What from_hf told us to train with (load_parameters_path and the model keys)."""
    return (converted / OVERRIDES_FILE).read_text().split()


def maxpar_logits(converted: Path, tokens: np.ndarray, devices, *overrides: str, segment_ids=None) -> np.ndarray:
    """Logits of the converted checkpoint, loaded as load_parameters_path= loads it, on `devices`."""
    config = load_config([str(BASE), *overrides_of(converted), "dtype=float32",
                          f"max_target_length={tokens.shape[1]}", *overrides])
    layout, mesh = layout_on(config, devices, optax.identity())
    model = Transformer(model_config(config), layout.model)
    target = checkpoint.Target(config, layout.state.abstract, layout.state_shardings(mesh), 0)
    params = checkpoint.load_parameters(config.load_parameters_path, target)
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    segments = np.ones_like(tokens) if segment_ids is None else segment_ids
    logits = jax.jit(lambda p, *xs: model.apply({"params": p}, *xs))(params, tokens, positions, segments)
    return np.asarray(logits)


@pytest.fixture(scope="module")
def hf_dirs() -> dict[str, Path]:
    """Each model saved by transformers (shared with tests/test_generate.py: read them, copy before changing)."""
    return {name: hf_model_dir(name) for name in MODELS}


@pytest.fixture(scope="module")
def converted(hf_dirs) -> dict[str, Path]:
    """Each model through `python -m maxpar.convert from_hf` (shared with tests/test_generate.py)."""
    return {name: converted_dir(directory) for name, directory in hf_dirs.items()}


def tokens_for(seed: int, rows: int = 8, length: int = 12) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(rows, length)).astype(np.int32)


# ---------------------------------------------------------------- logits

# Every model on one device and under TP (scanned and unrolled); FSDP(8) alone splits the same parameters more ways than
# FSDP(4)xTP(2) does, so its case is the model-independent loading's, kept for Mixtral and Qwen3-MoE (the experts).
LOGITS_CASES = [(name, mesh) for name in MODELS for mesh in MESHES
                if mesh != "fsdp8" or name in ("mixtral", "qwen3_moe")]


@pytest.mark.parametrize("name, mesh", LOGITS_CASES)
def test_logits_equal_transformers(name, mesh, hf_dirs, converted):
    tokens = tokens_for(1)
    count, overrides = MESHES[mesh]
    ours = maxpar_logits(converted[name], tokens, jax.devices()[:count], *overrides)
    theirs = reference_logits(hf_dirs[name], tokens)
    assert np.abs(theirs).max() > 1.0  # not a degenerate model whose logits all agree anyway
    np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=2e-5)  # observed: <= 1e-5 on logits up to 5.5


@pytest.mark.parametrize("overrides", [["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"],
                                       ["ici_expert_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                                        "capacity_factor=4.0"]], ids=["ep4_fsdp2", "ep2_fsdp2_tp2_capacity"])
def test_mixtral_logits_equal_transformers_under_expert_parallelism(overrides, hf_dirs, converted):
    """The experts split over the `expert` axis (and, with a capacity no token overflows, the capacity path)."""
    tokens = tokens_for(4)
    assert "num_experts_per_tok=2" in overrides_of(converted["mixtral"])
    ours = maxpar_logits(converted["mixtral"], tokens, jax.devices()[:8], *overrides)
    np.testing.assert_allclose(ours, reference_logits(hf_dirs["mixtral"], tokens), rtol=2e-5, atol=2e-5)


def test_sliding_window_is_what_makes_mistral_match(hf_dirs, converted):
    """Without the window the logits differ: the Mistral case really exercises sliding_window."""
    tokens = tokens_for(2)
    theirs = hf_logits(hf_dirs["mistral"], tokens)
    assert "sliding_window=4" in overrides_of(converted["mistral"])
    windowless = maxpar_logits(converted["mistral"], tokens, jax.devices()[:1], "sliding_window=0")
    assert np.abs(windowless - theirs).max() > 0.1
    # Within the window (first 4 positions) the two agree.
    np.testing.assert_allclose(windowless[:, :4], theirs[:, :4], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- training from a converted checkpoint

def hf_packed_loss(directory: Path, batch: dict[str, np.ndarray]) -> float:
    """transformers' mean loss over the real tokens of a packed batch: each document of each row on its own
    (the positions maxpar uses), which is what maxpar's document mask and per-document positions compute."""
    model = hf_model(directory)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in range(batch["inputs"].shape[0]):
            segments = batch["segment_ids"][row]
            for segment in sorted(set(segments.tolist()) - {0}):
                where = np.flatnonzero(segments == segment)
                assert np.array_equal(where, np.arange(where[0], where[-1] + 1)), "documents are contiguous"
                inputs = torch.tensor(batch["inputs"][row, where][None], dtype=torch.long)
                positions = torch.tensor(batch["positions"][row, where][None], dtype=torch.long)
                logits = model(inputs, position_ids=positions).logits[0]
                targets = torch.tensor(batch["targets"][row, where], dtype=torch.long)
                total += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
                count += len(where)
    return total / count


def short_documents(directory: Path, count: int = 24) -> str:
    """Documents of 6-25 bytes, so that a 32-token row packs several (and the document mask matters)."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True)
    for i in range(count):
        (directory / f"doc_{i:02d}.txt").write_text("ab cd ef gh ij"[:int(rng.integers(2, 14))] + f" {i}\n")
    return str(directory / "*.txt")


@pytest.mark.parametrize("name", ["mistral"])  # GQA, a head_dim of its own and a sliding window: Llama's case and more
def test_training_from_converted_checkpoint_starts_at_transformers_loss(name, hf_dirs, converted, tmp_path):
    corpus = short_documents(tmp_path / "corpus")
    config = load_config([str(BASE), *overrides_of(converted[name]), "dataset_type=text", f"dataset_path={corpus}",
                          "per_device_batch_size=1", "max_target_length=32", "steps=1", "dtype=float32",
                          "log_period=1", "eval_interval=-1", "enable_checkpointing=false"])
    batch = next(iter(setup_run(config, jax.devices()).train_data))
    documents_per_row = [len(set(row.tolist()) - {0}) for row in batch["segment_ids"]]
    assert max(documents_per_row) > 1, "the batch should pack several documents into a row"
    row = train(config, devices=jax.devices(), run_dir=tmp_path / "run")
    assert row["step"] == 1
    np.testing.assert_allclose(row["loss"], hf_packed_loss(hf_dirs[name], batch), rtol=1e-6)


# ---------------------------------------------------------------- back to Hugging Face

def read_all(directory: Path) -> dict[str, np.ndarray]:
    with HFTensors(directory) as tensors:
        return {name: tensors.read(name, ()) for name in tensors.names}


@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_gives_the_original_tensors(name, hf_dirs, converted, tmp_path):
    back = tmp_path / "back"
    dtype = ["--dtype", "bfloat16"] if MODELS[name][3] == torch.bfloat16 else []
    assert main(["to_hf", "--checkpoint", str(converted[name]), "--out", str(back), "--max_shard_size_mb", "0.03",
                 "--hf_template", str(hf_dirs[name]), *dtype]) == 0
    assert (back / "model.safetensors.index.json").is_file()  # sharded output, as transformers writes it
    original, ours = read_all(hf_dirs[name]), read_all(back)
    assert sorted(ours) == sorted(original)
    for tensor_name, value in original.items():
        assert ours[tensor_name].dtype == value.dtype, tensor_name
        assert np.array_equal(ours[tensor_name], value), tensor_name
    original_config = json.loads((hf_dirs[name] / "config.json").read_text())
    config = json.loads((back / "config.json").read_text())
    assert {key: config.get(key) for key in original_config} == original_config  # token ids, max positions kept
    tokens = tokens_for(3, rows=2)
    np.testing.assert_array_equal(hf_logits(back, tokens), hf_logits(hf_dirs[name], tokens))


def test_to_hf_after_training_loads_in_transformers_with_maxpar_logits(hf_dirs, converted, tmp_path):
    """A fine-tuned run's checkpoint (unrolled layers, changed weights) exports to what maxpar computes."""
    corpus = write_corpus(tmp_path / "corpus")
    run_dir = tmp_path / "run"
    config = load_config([str(BASE), *overrides_of(converted["llama"]), "dataset_type=text",
                          f"dataset_path={corpus}", "per_device_batch_size=1", "max_target_length=16", "steps=2",
                          "dtype=float32", "log_period=1", "eval_interval=-1", "enable_checkpointing=true",
                          "async_checkpointing=false", "scan_layers=false", "learning_rate=1e-2", "warmup_steps=0"])
    train(config, devices=jax.devices(), run_dir=run_dir)
    assert main(["to_hf", "--checkpoint", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    tokens = tokens_for(4)
    ours = maxpar_logits(converted["llama"], tokens, jax.devices()[:1], f"load_parameters_path={run_dir}")
    np.testing.assert_allclose(hf_logits(tmp_path / "hf", tokens), ours, rtol=1e-4, atol=1e-4)
    assert not np.allclose(ours, hf_logits(hf_dirs["llama"], tokens), atol=1e-3)  # training changed the model


# ---------------------------------------------------------------- slices and configs, without devices

def test_any_block_of_a_parameter_reads_only_its_slice():
    """Blocks of a stacked query [L, e, h, d] built from q_proj slices equal the same blocks of the whole."""
    rule = next(r for r in ARCHITECTURES["LlamaForCausalLM"].tensors if r.path.endswith("attention/query"))
    layers, emb, heads, head_dim = 3, 6, 4, 5
    hf = {f"model.layers.{i}.self_attn.q_proj.weight": np.random.default_rng(i).normal(size=(heads * head_dim, emb))
          for i in range(layers)}
    reads = []

    def read(name, index):
        reads.append(hf[name][index].size)
        return hf[name][index]

    whole = maxpar_block(rule, (layers, emb, heads, head_dim), (slice(None),) * 4, read)
    for i in range(layers):
        np.testing.assert_array_equal(hf_tensor(rule, whole[i]), hf[f"model.layers.{i}.self_attn.q_proj.weight"])
    reads.clear()
    index = (slice(1, 3), slice(2, 4), slice(1, 3), slice(0, 5))
    np.testing.assert_array_equal(maxpar_block(rule, whole.shape, index, read), whole[index])
    assert max(reads) == 2 * head_dim * 2  # two heads' rows by two embed columns, per layer


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_safetensors_files_get_the_umask_mode(umask, mode, tmp_path):
    """Written shards are readable as the user's other files are (safetensors alone writes them 0600)."""
    import os
    previous = os.umask(umask)
    try:
        files = write_safetensors(tmp_path, [("a", 8), ("b", 8)], lambda name: np.zeros(2, np.float32), 8)
    finally:
        os.umask(previous)
    assert [file.stat().st_mode & 0o777 for file in files] == [mode, mode]


def legacy_llama3_8b() -> dict:
    """Meta-Llama-3-8B's config.json as transformers 4 wrote it (rope_theta at the top level)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
            "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None,
            "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def test_config_of_both_transformers_layouts_matches_the_preset():
    legacy = legacy_llama3_8b()
    current = {key: value for key, value in legacy.items() if key not in ("rope_theta", "rope_scaling")}
    current["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    derived = model_keys(legacy, ARCHITECTURES["LlamaForCausalLM"])
    assert derived == model_keys(current, ARCHITECTURES["LlamaForCausalLM"])
    config = resolve_config(derived, ["model_name=llama3-8b"], BASE)
    assert training_overrides(config, BASE) == ["model_name=llama3-8b"]
    with pytest.raises(ConversionError, match=r"num_kv_heads: 8 in config.json, 32 from model_name=llama2-7b"):
        resolve_config(derived, ["model_name=llama2-7b"], BASE)


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling 'llama3' lacks low_freq_factor"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "RoPE scaling 'yarn'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
])
def test_unsupported_features_are_refused(change, message):
    with pytest.raises(ConversionError, match=message):
        model_keys({**legacy_llama3_8b(), **change}, ARCHITECTURES["LlamaForCausalLM"])


def test_a_mixture_of_experts_does_not_export_as_a_dense_architecture():
    config = load_config([str(BASE), "model_name=tiny-moe"])
    with pytest.raises(ConversionError, match=r"num_experts=8: LlamaForCausalLM has no such setting \(it needs 1\)"):
        hf_config(config, ARCHITECTURES["LlamaForCausalLM"], "float32")


def test_a_qk_norm_model_does_not_export_as_llama():
    config = load_config([str(BASE), "model_name=qwen3-8b"])
    with pytest.raises(ConversionError, match=r"qk_norm=True: LlamaForCausalLM has no such setting"):
        hf_config(config, ARCHITECTURES["LlamaForCausalLM"], "float32")


# ---------------------------------------------------------------- Qwen3 published configs

QWEN3 = {"rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "vocab_size": 151936, "head_dim": 128,
         "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
         "torch_dtype": "bfloat16"}


def qwen3_published(name: str) -> dict:
    """config.json of Qwen/Qwen3-0.6B, Qwen3-8B and Qwen3-30B-A3B as published (model keys)."""
    dense = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **QWEN3}
    return {
        "qwen3-0.6b": {**dense, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                       "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True,
                       "max_window_layers": 28},
        "qwen3-8b": {**dense, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
                     "max_window_layers": 36},
        "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **QWEN3,
                          "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                          "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                          "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                          "decoder_sparse_step": 1, "mlp_only_layers": [], "max_window_layers": 48,
                          "router_aux_loss_coef": 0.001, "tie_word_embeddings": False},
    }[name]


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"])
def test_qwen3_published_configs_are_the_presets(name):
    hf = qwen3_published(name)
    config = resolve_config(model_keys(hf, ARCHITECTURES[hf["architectures"][0]]), [f"model_name={name}"], BASE)
    assert training_overrides(config, BASE) == [f"model_name={name}"]


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_bfloat16_round_trip_is_bitwise_in_either_weight_dtype(name, tmp_path):
    """A bfloat16 checkpoint (DeepSeek-V3's router and routing bias in float32, as transformers keeps them) through
    from_hf -> to_hf gives back every tensor in its dtype, whether widened to float32 weights and exported with
    --dtype bfloat16, or kept in weight_dtype=bfloat16 (maxpar's router is float32 whatever weight_dtype)."""
    hf_dir = save_hf_model(tmp_path / "hf", name, dtype=torch.bfloat16)
    original = read_all(hf_dir)
    router = next(value for key, value in original.items() if key.endswith("mlp.gate.weight"))
    assert router.dtype == (np.float32 if name == "deepseek_v3" else original["model.embed_tokens.weight"].dtype)
    for weights, export in (("float32", ["--dtype", "bfloat16"]), ("bfloat16", [])):
        converted, back = tmp_path / f"maxpar_{weights}", tmp_path / f"back_{weights}"
        assert main(["from_hf", "--hf_path", str(hf_dir), "--out", str(converted), f"weight_dtype={weights}"]) == 0
        assert main(["to_hf", "--checkpoint", str(converted), "--out", str(back), "--hf_template", str(hf_dir),
                     *export]) == 0
        ours = read_all(back)
        assert sorted(ours) == sorted(original)
        for tensor_name, value in original.items():
            assert ours[tensor_name].dtype == value.dtype and np.array_equal(ours[tensor_name], value), tensor_name


def test_qwen3_moe_sparse_step_is_the_moe_layer_interval():
    """Every 2nd layer MoE (HF layer i is sparse when (i + 1) % step == 0), dense layers as wide as the experts."""
    hf = {**qwen3_published("qwen3-30b-a3b"), "decoder_sparse_step": 2, "intermediate_size": 768}
    assert model_keys(hf, ARCHITECTURES["Qwen3MoeForCausalLM"])["moe_layer_interval"] == 2
    del hf["norm_topk_prob"]  # absent: transformers' default, false
    assert model_keys(hf, ARCHITECTURES["Qwen3MoeForCausalLM"])["norm_topk_prob"] is False


def test_qwen3_moe_with_dense_layers_and_raw_topk_weights_converts_both_ways(tmp_path):
    """decoder_sparse_step=2: HF layers 0 and 2 dense, 1 and 3 MoE, stored by maxpar as 2 blocks of 2 sublayers
    (moe_layer_interval=2); norm_topk_prob=false (transformers' default): the top-k probabilities not renormalized.
    Logits equal transformers' under EP(2)xFSDP(2)xTP(2) (renormalized, they do not), and to_hf gives the tensors
    back."""
    hf_dir = save_hf_model(tmp_path / "hf", "qwen3_moe", decoder_sparse_step=2, intermediate_size=32,
                           num_hidden_layers=4, norm_topk_prob=False)
    converted = tmp_path / "maxpar" / "converted"
    assert main(["from_hf", "--hf_path", str(hf_dir), "--out", str(converted)]) == 0
    assert {"moe_layer_interval=2", "norm_topk_prob=false"} <= set(overrides_of(converted))
    tokens, mesh = tokens_for(5), ("ici_expert_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")
    theirs = hf_logits(hf_dir, tokens)
    np.testing.assert_allclose(maxpar_logits(converted, tokens, jax.devices()[:8], *mesh), theirs, rtol=2e-5, atol=2e-5)
    renormalized = maxpar_logits(converted, tokens, jax.devices()[:8], *mesh, "norm_topk_prob=true")
    assert np.abs(renormalized - theirs).max() > 1e-2
    back = tmp_path / "back"
    assert main(["to_hf", "--checkpoint", str(converted), "--out", str(back)]) == 0
    original, ours_back = read_all(hf_dir), read_all(back)
    assert sorted(ours_back) == sorted(original) and "model.layers.0.mlp.gate_proj.weight" in original
    assert all(np.array_equal(ours_back[name], value) for name, value in original.items())


@pytest.mark.parametrize("change, message", [
    ({"mlp_only_layers": [0, 47]}, r"mlp_only_layers=\[0, 47\]"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2 with intermediate_size=6144 != moe_intermediate_size=768"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window=true"),
])
def test_qwen3_moe_features_maxpar_cannot_represent_are_refused(change, message):
    with pytest.raises(ConversionError, match=message):
        model_keys({**qwen3_published("qwen3-30b-a3b"), **change}, ARCHITECTURES["Qwen3MoeForCausalLM"])


# ---------------------------------------------------------------- Llama 3.1+ RoPE scaling

# Llama 3.1's llama3 scaling with a pretraining context of 8 positions, so that the 24-token rows below reach
# the stretched (low-frequency) and the interpolated bands of the 16-wide heads, not only the kept ones.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}


def save_llama3_scaled(directory: Path) -> None:
    config_class, model_class, dims, _, _ = MODELS["llama"]
    torch.manual_seed(3)
    model = model_class(config_class(**dims, rope_parameters=dict(LLAMA3_ROPE)))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            param.copy_(1.0 + 0.2 * torch.randn_like(param)) if param_name.endswith("norm.weight") else \
                param.normal_(0.0, 0.15)
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def llama3_scaled() -> tuple[Path, Path]:
    """(transformers' directory, its from_hf conversion) of the tiny GQA Llama with llama3 RoPE scaling (shared)."""
    directory = shared_dir(save_llama3_scaled, "hf_model", "llama3_scaled")
    return directory, converted_dir(directory)


@pytest.mark.parametrize("mesh", ["one", "fsdp4_tp2"])
def test_llama3_rope_scaling_logits_equal_transformers(mesh, llama3_scaled):
    hf_dir, converted_dir = llama3_scaled
    assert "rope_scaling_type=llama3" in overrides_of(converted_dir)
    tokens = tokens_for(5, rows=8, length=24)
    count, overrides = MESHES[mesh]
    ours = maxpar_logits(converted_dir, tokens, jax.devices()[:count], *overrides)
    theirs = reference_logits(hf_dir, tokens)
    np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=2e-5)
    # Without the scaling the same weights give other logits past the pretraining context: the keys matter.
    unscaled = maxpar_logits(converted_dir, tokens, jax.devices()[:1], "ici_fsdp_parallelism=1",
                             "rope_scaling_type=")
    assert np.abs(unscaled[:, 8:] - theirs[:, 8:]).max() > 1e-2


def test_llama3_rope_scaling_survives_from_hf_to_hf(llama3_scaled, tmp_path):
    hf_dir, converted_dir = llama3_scaled
    assert main(["to_hf", "--checkpoint", str(converted_dir), "--out", str(tmp_path / "back")]) == 0
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["rope_parameters"] == LLAMA3_ROPE
    assert written["rope_scaling"] == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "back").config.rope_parameters == LLAMA3_ROPE


def test_llama3_rope_keys_are_validated():
    with pytest.raises(ConfigError, match="rope_low_freq_factor=4.0, rope_high_freq_factor=1.0"):
        load_config([str(BASE), "rope_scaling_type=llama3", "rope_low_freq_factor=4.0", "rope_high_freq_factor=1.0"])
    with pytest.raises(ConfigError, match="rope_scaling_type='dynamic': must be one of"):
        load_config([str(BASE), "rope_scaling_type=dynamic"])


# ---------------------------------------------------------------- bad input: exit 2 and why

def edited_copy(source: Path, destination: Path, **changes) -> Path:
    shutil.copytree(source, destination)
    config = json.loads((destination / "config.json").read_text())
    (destination / "config.json").write_text(json.dumps({**config, **changes}))
    return destination


def from_hf(capsys, hf_path: Path, out: Path, *overrides: str) -> tuple[int, str]:
    status = main(["from_hf", "--hf_path", str(hf_path), "--out", str(out), *overrides])
    return status, capsys.readouterr().err


@pytest.mark.slow
def test_missing_config_json_exits_2(tmp_path):
    (tmp_path / "empty").mkdir()
    result = subprocess.run([sys.executable, "-m", "maxpar.convert", "from_hf", "--hf_path", str(tmp_path / "empty"),
                             "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2
    assert "no config.json there" in result.stderr and "Traceback" not in result.stderr


def test_unsupported_architecture_exits_2(capsys, hf_dirs, tmp_path):
    source = edited_copy(hf_dirs["llama"], tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    status, err = from_hf(capsys, source, tmp_path / "out")
    assert status == 2
    assert "unsupported architecture ['GPT2LMHeadModel']" in err and "LlamaForCausalLM, MistralForCausalLM" in err


@pytest.mark.parametrize("overrides, expected", [
    (["model_name=tiny"], ["emb_dim: 64 in config.json, 256 from model_name=tiny",
                           "mlp_dim: 128 in config.json, 768 from model_name=tiny"]),
    (["num_kv_heads=4"], ["num_kv_heads: 2 in config.json, 4 on the command line"]),
])
def test_model_name_or_key_that_disagrees_exits_2(capsys, hf_dirs, tmp_path, overrides, expected):
    status, err = from_hf(capsys, hf_dirs["llama"], tmp_path / "out", *overrides)
    assert status == 2
    for line in expected:
        assert line in err
    assert not (tmp_path / "out").exists()


def test_other_rope_scaling_exits_2(capsys, hf_dirs, tmp_path):
    source = edited_copy(hf_dirs["llama"], tmp_path / "scaled", rope_parameters={
        "rope_type": "dynamic", "rope_theta": 5e5, "factor": 4.0})
    status, err = from_hf(capsys, source, tmp_path / "out")
    assert status == 2 and "RoPE scaling 'dynamic'" in err and "'llama3' and 'yarn' scaling only" in err


def test_tensors_that_do_not_fit_config_json_exit_2(capsys, hf_dirs, tmp_path):
    source = edited_copy(hf_dirs["llama"], tmp_path / "wider", intermediate_size=256)
    status, err = from_hf(capsys, source, tmp_path / "out")
    assert status == 2
    assert "model.layers.0.mlp.gate_proj.weight: (128, 64) in the safetensors, (256, 64) from config.json" in err


def test_missing_tensor_exits_2(capsys, hf_dirs, tmp_path):
    source = edited_copy(hf_dirs["llama"], tmp_path / "short", num_hidden_layers=3)
    status, err = from_hf(capsys, source, tmp_path / "out")
    assert status == 2 and "missing tensors: model.layers.2." in err


def test_full_state_of_a_converted_checkpoint_is_refused(converted):
    config = load_config([str(BASE), *overrides_of(converted["llama"])])
    layout, mesh = layout_on(config, tx=optax.adamw(1e-3))
    target = checkpoint.Target(config, layout.state.abstract, layout.state_shardings(mesh), 8)
    with pytest.raises(checkpoint.IncompatibleCheckpoint, match="holds no opt_state .* load_parameters_path="):
        checkpoint.load_full_state(str(converted["llama"]), target)


def test_template_of_another_model_exits_2(capsys, hf_dirs, converted, tmp_path):
    status = main(["to_hf", "--checkpoint", str(converted["llama"]), "--out", str(tmp_path / "hf"),
                   "--hf_template", str(hf_dirs["mistral"] / "config.json")])
    err = capsys.readouterr().err
    assert status == 2
    assert "emb_dim: 48 in the template, 64 in the checkpoint" in err and "sliding_window: 4 in the template" in err


def test_existing_output_is_not_overwritten(capsys, hf_dirs, converted):
    status, err = from_hf(capsys, hf_dirs["llama"], converted["llama"])
    assert status == 2 and "already holds checkpoints" in err


# ---------------------------------------------------------------- DeepSeek-V3

@pytest.fixture(scope="module")
def deepseek() -> tuple[Path, Path]:
    """A tiny random DeepseekV3ForCausalLM and its conversion (FSDP over the 8 devices), shared."""
    hf_dir = hf_model_dir("deepseek_v3")
    return hf_dir, converted_dir(hf_dir)


@pytest.mark.parametrize("mesh", [(1, ["ici_fsdp_parallelism=1"]),
                                  (8, ["ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                                       "ici_expert_parallelism=2"])], ids=["one", "fsdp2_tp2_ep2"])
def test_deepseek_v3_logits_equal_transformers(mesh, deepseek):
    hf_dir, converted = deepseek
    assert "first_num_dense_layers=1" in overrides_of(converted) and "mtp_num_layers=0" in overrides_of(converted)
    tokens = tokens_for(1)
    count, overrides = mesh
    ours = maxpar_logits(converted, tokens, jax.devices()[:count], *overrides)
    theirs = reference_logits(hf_dir, tokens)
    assert np.abs(theirs).max() > 1.0
    np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=2e-5)


def deepseek_mtp(source: Path, destination: Path) -> Path:
    """`source` with the MTP layer the released DeepSeek-V3 stores after its decoder layers: a decoder layer (here
    the last one's tensors, perturbed), enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding and
    the output head."""
    shutil.copytree(source, destination)
    tensors = read_all(destination)
    layers = json.loads((destination / "config.json").read_text())["num_hidden_layers"]
    rng = np.random.default_rng(5)
    prefix = f"model.layers.{layers - 1}."
    mtp = {f"model.layers.{layers}.{name[len(prefix):]}": value + rng.normal(0, 0.1, value.shape).astype(value.dtype)
           for name, value in tensors.items() if name.startswith(prefix)}
    emb = tensors["model.embed_tokens.weight"].shape[1]
    mtp.update({f"model.layers.{layers}.{name}": rng.normal(1, 0.2, (emb,)).astype(np.float32)
                for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
    mtp[f"model.layers.{layers}.eh_proj.weight"] = rng.normal(0, 0.1, (emb, 2 * emb)).astype(np.float32)
    mtp[f"model.layers.{layers}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    mtp[f"model.layers.{layers}.shared_head.head.weight"] = tensors["lm_head.weight"]
    (destination / "model.safetensors").unlink()
    write_safetensors(destination, [(name, value.nbytes) for name, value in {**tensors, **mtp}.items()],
                      {**tensors, **mtp}.__getitem__, 2**30)
    return destination


def test_deepseek_v3_round_trip_is_bitwise_with_and_without_the_mtp_layer(deepseek, tmp_path):
    """HF -> maxpar -> HF gives back every tensor; the MTP layer, when the safetensors hold one, lands in maxpar's
    MTP module (eh_proj is its [embedding; hidden] projection) and comes back too, less the copies of the
    embedding and the head, which maxpar shares with the model."""
    hf_dir, converted = deepseek
    with_mtp = deepseek_mtp(hf_dir, tmp_path / "hf_mtp")
    assert main(["from_hf", "--hf_path", str(with_mtp), "--out", str(tmp_path / "mtp")]) == 0
    assert "mtp_num_layers=1" in overrides_of(tmp_path / "mtp")
    for source, checkpoint_dir in ((hf_dir, converted), (with_mtp, tmp_path / "mtp")):
        back = tmp_path / f"back_{checkpoint_dir.name}"
        assert main(["to_hf", "--checkpoint", str(checkpoint_dir), "--out", str(back), "--hf_template",
                     str(source)]) == 0
        original, ours = read_all(source), read_all(back)
        copies = {name for name in original
                  if re.fullmatch(r"model\.layers\.3\.(embed_tokens|shared_head\.head)\.weight", name)}
        assert sorted(ours) == sorted(set(original) - copies)
        for tensor_name, value in ours.items():
            assert np.array_equal(value, original[tensor_name]), tensor_name
        config = json.loads((back / "config.json").read_text())
        original_config = json.loads((source / "config.json").read_text())
        assert {key: config.get(key) for key in original_config} == original_config
    config = load_config([str(BASE), *overrides_of(tmp_path / "mtp"), "dtype=float32"])
    layout, mesh = layout_on(config, jax.devices()[:1], optax.identity())
    target = checkpoint.Target(config, layout.state.abstract, layout.state_shardings(mesh), 0)
    params = checkpoint.load_parameters(config.load_parameters_path, target)
    np.testing.assert_array_equal(params["mtp"]["module_1"]["projection"]["kernel"],
                                  read_all(with_mtp)["model.layers.3.eh_proj.weight"].T)


def test_deepseek_v3_preset_is_what_its_config_json_converts_to():
    """The released config.json's values (transformers' DeepseekV3Config defaults; yarn as released) give the
    deepseek-v3 preset's model."""
    released = {**DeepseekV3Config().to_dict(), "architectures": ["DeepseekV3ForCausalLM"], "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, "max_position_embeddings": 163840}
    derived = model_keys(released, ARCHITECTURES["DeepseekV3ForCausalLM"])
    config = resolve_config(derived, ["model_name=deepseek-v3"], BASE)
    assert derived["mtp_num_layers"] == 1 and derived["first_num_dense_layers"] == 3
    assert training_overrides(config, BASE) == ["model_name=deepseek-v3"]


@pytest.mark.parametrize("change, message", [
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"n_group": 3}, "n_group=3 does not divide n_routed_experts=256"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "RoPE scaling 'longrope'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 64, "truncate": False}}, "truncate=false"),
])
def test_deepseek_v3_features_maxpar_cannot_compute_are_refused(change, message):
    with pytest.raises(ConversionError, match=message):
        model_keys({**DeepseekV3Config().to_dict(), **change}, ARCHITECTURES["DeepseekV3ForCausalLM"])
