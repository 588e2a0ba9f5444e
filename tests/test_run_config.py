"""A checkpoint carries its model (maxpar/io/run_config.py): `load_parameters_path=DIR` with configs/base.yml and no
model keys is enough for train, generate, plan and to_hf; from_hf names the preset its model is; a user setting that
contradicts the checkpoint's parameter shapes is one ConfigError naming the key and both values.

The checkpoints here hold parameters only (written by `checkpoint.save_parameters`, as from_hf writes them; a run's
steps carry their model in the same config/ item), so nothing is trained or compiled."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

import maxpar.generate
import maxpar.train
from helpers import REPO, layout_on
from maxpar.convert.__main__ import main as convert_main
from maxpar.core.config import MODEL_KEYS, CarriedModel, ConfigError, load_config, model_config
from maxpar.io import checkpoint
from maxpar.io.data.tokenizer import ByteTokenizer, load_tokenizer
from maxpar.io.run_config import load_run_config
from maxpar.model import stack

BASE = str(REPO / "configs" / "base.yml")
# A trained DeepSeek: the deepseek-tiny preset with a key of the run's own over it.
PRESET_VOCAB = load_config([BASE, "model_name=deepseek-tiny"]).vocab_size
VOCAB = PRESET_VOCAB + 8
DEEPSEEK = ["model_name=deepseek-tiny", f"vocab_size={VOCAB}"]


def carried(*overrides: str) -> CarriedModel:
    """What a checkpoint written with base.yml + `overrides` carries (every key of the model)."""
    return CarriedModel("load_parameters_path=X (step 1)", load_config([BASE, *overrides]).to_dict())


# ---------------------------------------------------------------- the config (pure)

def test_the_carried_model_replaces_the_defaults_and_keeps_its_preset_name():
    config = load_config([BASE], carried(*DEEPSEEK))
    assert config.model_name == "deepseek-tiny" and config.vocab_size == VOCAB and config.attention_type == "mla"
    assert config.routed_bias_update_rate == load_config([BASE, *DEEPSEEK]).routed_bias_update_rate  # its preset's


def test_a_preset_renamed_since_leaves_the_checkpoints_keys_standing():
    saved = {**carried(*DEEPSEEK).values, "model_name": "gone-preset"}
    config = load_config([BASE], CarriedModel("X", saved))
    assert config.model_name == "" and config.emb_dim == 64 and config.vocab_size == VOCAB


def test_user_settings_change_what_the_parameters_compute_but_not_their_shapes(tmp_path):
    config = load_config([BASE, "rope_scaling_factor=8", "tokenizer_path=t.json", "dtype=float32"],
                         carried(*DEEPSEEK))
    assert (config.rope_scaling_factor, config.tokenizer_path, config.emb_dim) == (8.0, "t.json", 64)
    with pytest.raises(ConfigError, match=r"carries its model, which these settings contradict: emb_dim=32 on the "
                                          r"command line, 64 in the checkpoint\. Drop them"):
        load_config([BASE, "emb_dim=32"], carried(*DEEPSEEK))
    with pytest.raises(ConfigError, match=rf"vocab_size={PRESET_VOCAB} from model_name=deepseek-tiny, {VOCAB} in the checkpoint"):
        load_config([BASE, "model_name=deepseek-tiny"], carried(*DEEPSEEK))
    (tmp_path / "mine.yml").write_text(f"base_config: {BASE}\nmlp_dim: 64\n")
    with pytest.raises(ConfigError, match=rf"mlp_dim=64 in {tmp_path / 'mine.yml'}, 128 in the checkpoint"):
        load_config([str(tmp_path / "mine.yml")], carried(*DEEPSEEK))
    # the same values are no conflict, whoever sets them
    assert load_config([BASE, *DEEPSEEK], carried(*DEEPSEEK)).vocab_size == VOCAB


# ---------------------------------------------------------------- a DeepSeek checkpoint, base.yml and nothing else

@pytest.fixture(scope="module")
def deepseek_run(tmp_path_factory) -> Path:
    """RUN/checkpoints/0 of a deepseek-tiny model (zero parameters: only shapes and the config matter here)."""
    config = load_config([BASE, *DEEPSEEK, "ici_fsdp_parallelism=1"])
    layout, _ = layout_on(config, jax.devices()[:1], optax.identity())
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), layout.state.abstract.params)
    run = tmp_path_factory.mktemp("deepseek") / "run"
    checkpoint.save_parameters(run, stack.to_canonical(params, model_config(config)), config)
    return run


def test_generate_loads_a_deepseek_checkpoint_with_base_yml_alone(deepseek_run, monkeypatch, capsys):
    loaded = {}

    def load(config, prompts):  # generate up to its sampling: the parameters on this config's model
        loaded["config"] = config
        loaded["params"] = maxpar.generate.load_model(config, jax.devices()[:1])[1]
        return [""], maxpar.generate.Generation([[]], 0.0, 0.0)
    monkeypatch.setattr(maxpar.generate, "generate", load)
    assert maxpar.generate.main([BASE, f"load_parameters_path={deepseek_run}", "ici_fsdp_parallelism=1",
                                 "--prompt", "hi"]) == 0
    assert f"maxpar: model from load_parameters_path={deepseek_run} (step 0): deepseek-tiny" in capsys.readouterr().err
    config = loaded["config"]
    assert {k: getattr(config, k) for k in MODEL_KEYS} == {k: getattr(load_config([BASE, *DEEPSEEK]), k)
                                                          for k in MODEL_KEYS}
    assert loaded["params"]["token_embedding"].shape == (VOCAB, 64)


def test_train_takes_a_deepseek_checkpoints_model(deepseek_run, tmp_path, monkeypatch, capsys):
    taken = {}
    monkeypatch.setattr(maxpar.train, "train", lambda config: taken.setdefault("config", config))
    assert maxpar.train.main([BASE, f"load_parameters_path={deepseek_run}", f"base_output_directory={tmp_path}",
                              "dataset_type=synthetic"]) == 0
    assert "model from" in capsys.readouterr().out
    assert (taken["config"].model_name, taken["config"].num_experts, taken["config"].vocab_size) == (
        "deepseek-tiny", 8, VOCAB)
    assert maxpar.train.main([BASE, f"load_parameters_path={deepseek_run}", "num_decoder_layers=4"]) == 2
    assert "num_decoder_layers=4 on the command line, 3 in the checkpoint" in capsys.readouterr().err


def test_to_hf_of_a_deepseek_checkpoint_with_base_yml_writes_its_byte_tokenizer(deepseek_run, tmp_path):
    """The export loads with AutoTokenizer, which gives the byte tokenizer's ids (BOS first by default, as maxpar
    starts documents and prompts), and config.json names its special ids (DeepSeek's defaults are others)."""
    from transformers import AutoTokenizer
    assert convert_main(["to_hf", "--checkpoint", str(deepseek_run), "--out", str(tmp_path / "hf")]) == 0
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["architectures"] == ["DeepseekV3ForCausalLM"] and exported["vocab_size"] == VOCAB
    assert (exported["bos_token_id"], exported["eos_token_id"], exported["pad_token_id"]) == (1, 2, 0)
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "héllo wörld\n\tdef f():  ✓ 🙂 <s></s>"
    assert hf.encode(text, add_special_tokens=False) == ByteTokenizer().encode(text)
    assert hf(text)["input_ids"] == [ByteTokenizer.bos_id, *ByteTokenizer().encode(text)]
    assert hf.decode(ByteTokenizer().encode(text)) == text
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 0)


def test_to_hf_copies_a_hugging_face_tokenizer(deepseek_run, tmp_path):
    import tokenizers
    from transformers import AutoTokenizer
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.train_from_iterator(["hello world", "hello there world"], tokenizers.trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<s>", "</s>"]))
    (tmp_path / "tok").mkdir()
    words.save(str(tmp_path / "tok" / "tokenizer.json"))
    assert convert_main(["to_hf", "--checkpoint", str(deepseek_run), "--out", str(tmp_path / "hf"),
                         "--tokenizer_path", str(tmp_path / "tok" / "tokenizer.json")]) == 0
    ours = load_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf.encode("hello there world", add_special_tokens=False) == ours.encode("hello there world")
    assert (hf.eos_token_id, json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"]) == (
        ours.eos_id, ours.eos_id)


def test_no_checkpoint_there_is_left_to_the_load_to_report():
    assert load_run_config([BASE, "load_parameters_path=/nonexistent/run"]).note == ""


# ---------------------------------------------------------------- from_hf names the preset

def test_from_hf_of_the_default_model_names_its_preset_and_prints_no_keys(tmp_path, capsys):
    tiny = load_config([BASE])
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        hidden_size=tiny.emb_dim, intermediate_size=tiny.mlp_dim, num_hidden_layers=tiny.num_decoder_layers,
        num_attention_heads=tiny.num_query_heads, num_key_value_heads=tiny.num_kv_heads, head_dim=tiny.head_dim,
        vocab_size=tiny.vocab_size, rms_norm_eps=tiny.normalization_layer_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": tiny.rope_theta})).save_pretrained(tmp_path / "hf")
    out = tmp_path / "out"
    assert convert_main(["from_hf", "--hf_path", str(tmp_path / "hf"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "the checkpoint carries its model (tiny)" in printed
    assert f"  python -m maxpar.train configs/base.yml load_parameters_path={out}\n" in printed
    assert yaml.safe_load((out / "config.yml").read_text())["model_name"] == "tiny"
    assert load_run_config([BASE, f"load_parameters_path={out}"]).config.model_name == "tiny"
