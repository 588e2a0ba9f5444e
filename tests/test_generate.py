"""maxpar.generate: KV-cache decoding of converted transformers models (a GQA Llama, a Mistral whose sliding
window is shorter than the prompts, a Mixtral, a Llama with llama3 RoPE scaling, a Qwen3, a Qwen3-MoE and a
DeepSeek-V3) gives transformers' greedy
tokens on one device and FSDP(4)xTP(2); 1 or 3 prompts on meshes of 2 and 4 batch shards (FSDP, EP, EP x DP with
capacity) give the one-device tokens; the cache path's logits equal re-running the whole prefix; top_p=0 keeps the
most likely token; bad requests exit 2; the command a training run's summary prints samples from it."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
import torch

from helpers import REPO, shared, micro_config, train_command
from test_convert import BASE, MESHES, converted_dir, deepseek, hf_model, hf_model_dir, llama3_scaled, overrides_of
import maxpar.generate
from maxpar.core.config import load_config, to_yaml
from maxpar.core.mesh import resolve_mesh_shape
from maxpar.generate import check_request, decode, load_model, main, sample
from maxpar.io.checkpoint import CheckpointError
from maxpar.training.summary import sampling_overrides
from maxpar.training.train_step import run_layout

PROMPTS = [[5, 17, 200, 33, 9], [71, 3, 250, 12, 99, 140, 8, 61, 2], [44, 10, 7], [180, 181, 182, 183]]
NEW = 6


def converted_model(name):
    """(transformers directory, maxpar conversion) of test_convert.MODELS[name], shared with tests/test_convert.py."""
    hf_dir = hf_model_dir(name)
    return hf_dir, converted_dir(hf_dir)


@pytest.fixture(scope="module")
def llama():
    return converted_model("llama")


@pytest.fixture(scope="module")
def mixtral():
    return converted_model("mixtral")


@pytest.fixture(scope="module")
def models(llama, mixtral, llama3_scaled):
    """name -> (transformers directory, maxpar conversion)."""
    return {"llama": llama, "mixtral": mixtral, "llama3_scaled": llama3_scaled,
            **{name: converted_model(name) for name in ("mistral", "qwen3", "qwen3_moe")}}


def config_for(converted, *overrides):
    return load_config([str(BASE), *overrides_of(converted), "dtype=float32", "max_target_length=32",
                        f"max_new_tokens={NEW}", *overrides])


# Every model decodes under FSDP(4)xTP(2) as transformers does: its cache and arithmetic, split over the mesh. One
# device, the same code unsplit: the Llama's case (each model's one-device forward: test_convert.py's [name-one]).
@pytest.mark.parametrize("name, mesh", [("llama", "one"), *((name, "fsdp4_tp2") for name in (
    "llama", "mistral", "mixtral", "llama3_scaled", "qwen3", "qwen3_moe"))])
def test_greedy_tokens_equal_transformers_generate(name, mesh, models):
    assert_greedy_tokens_equal_transformers(*models[name], mesh)


def test_deepseek_v3_greedy_tokens_equal_transformers_generate(deepseek):
    """MLA decoding from its latent cache, sigmoid group-limited routing, the dense prefix, under FSDP(4)xTP(2); MTP
    plays no part."""
    assert_greedy_tokens_equal_transformers(*deepseek, "fsdp4_tp2")


def transformers_greedy(hf_dir) -> list[list[int]]:
    """transformers' greedy NEW tokens after each of PROMPTS, once per model for every mesh."""
    def generate():
        model = hf_model(hf_dir)
        model.generation_config.eos_token_id = None
        with torch.no_grad():
            return [model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt):]
                    .tolist() for prompt in PROMPTS]
    return shared(generate, "hf_greedy", str(hf_dir), PROMPTS, NEW)


def assert_greedy_tokens_equal_transformers(hf_dir, converted, mesh):
    count, overrides = MESHES[mesh]
    config = config_for(converted, *overrides)
    apply, params = load_model(config, jax.devices()[:count])
    ours = decode(apply, params, PROMPTS, config, eos_id=-1).tokens  # no EOS: every row runs NEW steps
    assert ours == transformers_greedy(hf_dir)


def test_cache_logits_equal_rerunning_the_prefix(llama):
    _, converted = llama
    config = config_for(converted, "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    apply, params = load_model(config, jax.devices())
    rng = np.random.default_rng(0)
    prompt_lengths = np.array([3, 7])
    full = rng.integers(0, 264, size=(2, 12)).astype(np.int32)
    width = int(prompt_lengths.max())
    positions = np.broadcast_to(np.arange(width), (2, width)).astype(np.int32)
    _, cache = apply(params, None, full[:, :width], positions, (positions < prompt_lengths[:, None]).astype(np.int32))
    # Reference: the whole sequence through the model without a cache; causal, so its logits at position p are
    # those of re-running the prefix up to p.
    whole = np.broadcast_to(np.arange(full.shape[1]), full.shape).astype(np.int32)
    reference, _ = apply(params, None, full, whole, np.ones_like(full))
    for step in range(4):
        at = prompt_lengths + step
        token = full[np.arange(2), at][:, None]
        cached, cache = apply(params, cache, token, at[:, None].astype(np.int32), np.ones((2, 1), np.int32))
        np.testing.assert_allclose(np.asarray(cached[:, 0]), np.asarray(reference)[np.arange(2), at],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prompt, overrides, message", [
    ("", [], "prompt 0 is empty"),
    ("x" * 30, [], "prompt 0 has 31 tokens + max_new_tokens=6 > max_target_length=32"),
    ("hi", ["load_parameters_path=/nonexistent/run"], "load_parameters_path='/nonexistent/run': no checkpoint there"),
    ("hi", ["load_parameters_path="], "load_parameters_path is empty"),
    ("hi", ["tokenizer_path=/nonexistent/tokenizer.json"],
     "tokenizer_path='/nonexistent/tokenizer.json': tokenizer file '/nonexistent/tokenizer.json' does not exist"),
    ("hi", ["tokenizer_path=words.txt"], "tokenizer_path='words.txt': unsupported tokenizer file"),
    ("hi", ["ici_stage_parallelism=2"], "does not run pipelined"),
])
def test_bad_requests_exit_2(prompt, overrides, message, llama, capsys):
    _, converted = llama
    argv = [str(BASE), *overrides_of(converted), "max_target_length=32", f"max_new_tokens={NEW}", *overrides]
    assert main([*argv, "--prompt", prompt]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_prompts_file_is_a_batch_and_a_bad_one_exits_2(llama, tmp_path, capsys):
    _, converted = llama
    argv = [str(BASE), *overrides_of(converted), "max_target_length=32", "max_new_tokens=2"]
    (tmp_path / "prompts.txt").write_text("one\n\n  two\n")  # empty lines skipped, other text kept as it is
    (tmp_path / "empty.txt").write_text("\n\n")
    assert main([*argv, "--prompt", "zero", "--prompts_file", str(tmp_path / "prompts.txt")]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("--- prompt:")] == [
        "--- prompt: 'zero'", "--- prompt: 'one'", "--- prompt: '  two'"]
    for name, message in (("missing.txt", "cannot read it"), ("empty.txt", "holds no prompt")):
        assert main([*argv, "--prompts_file", str(tmp_path / name)]) == 2
        assert f"maxpar: config error: --prompts_file {str(tmp_path / name)!r}" in capsys.readouterr().err


@pytest.mark.parametrize("error, status, message", [
    (KeyboardInterrupt(), 130, "maxpar: interrupted; nothing was generated"),
    (CheckpointError("no usable checkpoint in RUN"), 1, "maxpar: checkpoint error: no usable checkpoint in RUN"),
])
def test_interrupt_and_unreadable_checkpoint_are_one_line(error, status, message, monkeypatch, capsys):
    def fail(*_):
        raise error
    monkeypatch.setattr(maxpar.generate, "generate", fail)
    assert main([str(BASE), "load_parameters_path=RUN", "--prompt", "hi"]) == status
    assert capsys.readouterr().err.strip() == message


RUN_KINDS = {  # a run the trainer accepts: (overrides, devices, slices, platform)
    "gPipe": (["ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_microbatches=4"], 8, 1, "cpu"),
    "circular": (["ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "num_decoder_layers=4",
                  "num_pipeline_repeats=2", "num_pipeline_microbatches=4", "pipeline_fsdp_ag_per_repeat=true"],
                 8, 1, "cpu"),
    "stages fill": (["ici_stage_parallelism=-1", "ici_fsdp_parallelism=2", "num_decoder_layers=4"], 8, 1, "cpu"),
    "2 processes": (["dcn_data_parallelism=2", "ici_fsdp_parallelism=4"], 8, 2, "cpu"),
    "stages across slices": (["dcn_stage_parallelism=2", "dcn_data_parallelism=1", "ici_fsdp_parallelism=2",
                              "ici_tensor_parallelism=2", "num_slices=2"], 8, 2, "cpu"),
    "expert-parallel": (["model_name=tiny-moe", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2"], 8, 1, "cpu"),
    "experts across slices": (["model_name=tiny-moe", "dcn_expert_parallelism=2", "dcn_data_parallelism=1",
                               "ici_expert_parallelism=2", "ici_fsdp_parallelism=2"], 8, 2, "cpu"),
    "context-parallel": (["attention=blockwise", "ici_context_parallelism=4", "ici_fsdp_parallelism=2",
                          "per_device_batch_size=0.5"], 8, 1, "cpu"),
    "2 GPU hosts": (["dcn_data_parallelism=2", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"], 16, 2, "gpu"),
}


@pytest.mark.parametrize("kind", RUN_KINDS)
def test_the_printed_command_lays_out_every_kind_of_run_in_one_process(kind, tmp_path):
    """The summary's overrides on the run's saved config.yml give a config maxpar.generate accepts in one process, on
    the devices it names (CPU: num_simulated_devices; elsewhere: one slice's), with the run's degrees but stages."""
    overrides, devices, slices, platform = RUN_KINDS[kind]
    config = micro_config(*overrides, "max_new_tokens=4")
    mesh = run_layout(config, resolve_mesh_shape(config, devices, slices)).mesh  # the trainer accepts the run
    (tmp_path / "config.yml").write_text(to_yaml(config))
    sampled = load_config([str(tmp_path / "config.yml"), "model_name=", "load_parameters_path=RUN",
                           *sampling_overrides(config, mesh, platform)])
    assert sampled.num_slices in (-1, 1)  # one process: one slice
    one_host = sampled.num_simulated_devices if platform == "cpu" else devices // slices
    check_request(sampled, [[1, 2, 3]])
    layout = run_layout(sampled, resolve_mesh_shape(sampled, one_host), optax.identity(), check_batch=False)
    run_degrees = dict(zip(mesh.axis_names, mesh.shape if platform == "cpu" else mesh.ici))
    run_degrees["data"] *= run_degrees.pop("stage")
    assert {**layout.axis_sizes, "stage": None} == {**run_degrees, "stage": None} and layout.axis_sizes["stage"] == 1


@pytest.mark.slow
def test_the_command_a_run_prints_samples_from_it(tmp_path, capsys):
    """A circular pipeline on 2 simulated devices (num_simulated_devices=2 in its config.yml), trained in this process
    on 2 of its devices: the summary's command runs as printed, in a fresh process, which makes those 2 devices from
    the run's config.yml. (A bad tokenizer_path exits 2 without a traceback: test_bad_requests_exit_2, through the same
    `main`. The trainer's command line applying num_simulated_devices before JAX starts: tests/test_preflight.py.)"""
    from maxpar.train import train

    train(micro_config("steps=1", "enable_checkpointing=true", "num_simulated_devices=2", "ici_stage_parallelism=2",
                       "ici_fsdp_parallelism=1", "num_decoder_layers=4", "num_pipeline_repeats=2",
                       "num_pipeline_microbatches=4", "max_new_tokens=3", f"base_output_directory={tmp_path}",
                       "run_name=run"), devices=jax.devices()[:2])
    printed = capsys.readouterr().out
    assert f"library logs (absl, Orbax, JAX): {tmp_path / 'run' / 'libraries.log'}" in printed
    printed = next(line for line in printed.splitlines() if "sample from it: " in line)
    command = shlex.split(printed.split("sample from it: ")[1])
    assert command[:3] == ["python", "-m", "maxpar.generate"] and "ici_data_parallelism=2" in command
    sampled = subprocess.run([sys.executable, *command[1:]], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert "Given directory is read only" not in sampled.stderr and "WARNING" not in sampled.stderr, sampled.stderr
    lines = sampled.stdout.splitlines()
    assert lines[0] == "--- prompt: 'def '" and lines[1].startswith("def ")
    assert re.fullmatch(r"prefill [\d,]+ tokens/s, decode [\d,.]+ tokens/s \(1 rows; compilation excluded\)",
                        lines[-1]), lines


def test_sampling_keys_restrict_the_draw():
    logits = jax.numpy.asarray(np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 512, np.float32)))
    keys = jax.random.split(jax.random.key(0), 3)
    assert set(np.asarray(sample(logits, keys[0], 1.0, 2, 1.0)).tolist()) == {0, 1}  # top_k=2
    assert set(np.asarray(sample(logits, keys[1], 1.0, 0, 0.7)).tolist()) == {0, 1}  # 0.5 + 0.3 reach 0.7
    drawn = np.asarray(sample(logits, keys[2], 1.0, 0, 1.0))
    assert set(drawn.tolist()) == {0, 1, 2, 3} and abs((drawn == 0).mean() - 0.5) < 0.08
    assert (np.asarray(sample(logits, keys[2], 0.0, 0, 1.0)) == 0).all()  # temperature 0: greedy


# Meshes whose batch shards (2 or 4) divide neither 1 nor 3 prompts, on the Mixtral: its MoE dispatch is what needs
# even rows, and the padding is the same for a dense model (a Llama's fsdp2 case showed nothing more). Dropless
# experts padded: ep2; 4 batch shards: ep2_dp2_capacity, where capacity_factor=4.0 gives every expert room for every
# token of a row, so the capacity path drops nothing and decodes as dropless does.
UNEVEN_MESHES = {
    "fsdp2": (2, ["ici_fsdp_parallelism=2"]),
    "ep2": (2, ["ici_expert_parallelism=2", "ici_fsdp_parallelism=1"]),
    "ep2_dp2_capacity": (4, ["ici_expert_parallelism=2", "ici_data_parallelism=2", "ici_fsdp_parallelism=1",
                             "capacity_factor=4.0"]),
}


@pytest.mark.parametrize("mesh", list(UNEVEN_MESHES))
def test_any_prompt_count_decodes_as_on_one_device(mesh, mixtral):
    """The rows are padded to the batch shards (the MoE dispatch's shard_map splits them evenly) and the padding
    dropped: 1 or 3 prompts on 2 or 4 batch shards give the tokens of one device."""
    _, converted = mixtral
    one = config_for(converted, "max_new_tokens=3", "ici_fsdp_parallelism=1")
    alone = shared(lambda: decode(*load_model(one, jax.devices()[:1]), PROMPTS[:3], one, eos_id=-1).tokens,
                   "decoded_on_one_device", str(converted), PROMPTS[:3], 3)
    count, overrides = UNEVEN_MESHES[mesh]
    config = config_for(converted, "max_new_tokens=3", *overrides)
    apply, params = load_model(config, jax.devices()[:count])
    for rows in (1, 3):
        assert decode(apply, params, PROMPTS[:rows], config, eos_id=-1).tokens == alone[:rows]


def test_top_p_0_samples_the_most_likely_token():
    logits = jax.random.normal(jax.random.key(1), (64, 32))
    drawn = sample(logits, jax.random.key(2), 1.0, 0, 0.0)
    np.testing.assert_array_equal(np.asarray(drawn), np.asarray(jax.numpy.argmax(logits, axis=-1)))


def test_rows_stop_at_their_eos_and_unrolled_layers_decode_alike(llama):
    _, converted = llama
    config = config_for(converted, "ici_fsdp_parallelism=1")
    apply, params = load_model(config, jax.devices()[:1])
    full = decode(apply, params, PROMPTS, config, eos_id=-1).tokens
    eos = full[0][2]
    stopped = decode(apply, params, PROMPTS, config, eos_id=eos).tokens
    for row, tokens in zip(full, stopped):  # each row ends at its first EOS (kept), the others run to NEW tokens
        assert tokens == (row[:row.index(eos) + 1] if eos in row else row)
    unrolled = config_for(converted, *MESHES["tp2_unrolled"][1])
    apply, params = load_model(unrolled, jax.devices())
    assert decode(apply, params, PROMPTS, unrolled, eos_id=-1).tokens == full
