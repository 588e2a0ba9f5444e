"""Post-training on the trainer: SFT's masked loss, DPO against TRL, LoRA adapters and their exports, each sharding
equal to one device, and the bad inputs refused with one line and exit status 2.

The batches are real: conversations and pairs built from the standard library's docstrings
(maxpar.tools.post_training_data), tokenized with a tokenizer trained on them, packed by the trainer's own
pipeline. Sharded runs are compiled train steps on those batches, two steps each (the second starts from updated
parameters and moments), against one device's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers import REPO, layout_on, read_metrics, micro_config
from maxpar.convert.__main__ import main as convert
from maxpar.core.config import ConfigError, load_config, model_config
from maxpar.io import checkpoint
from maxpar.io.data.chat import load_chat_template
from maxpar.io.data.conversations import Formatter, fitted, pack_row, record_batches
from maxpar.io.data.records import JsonlRecords, Record
from maxpar.io.data.tokenizer import load_tokenizer
from maxpar.model import Transformer
from maxpar.model.lora import merge_adapters
from maxpar.tools.post_training_data import build_tokenizer, conversations, pairs, write_jsonl
from maxpar.train import main as train_main
from maxpar.train import train
from maxpar.training import dpo
from maxpar.training.optimizer import make_optimizer
from maxpar.training.train_step import create_state, jit_train_step, objective, trace_state
from maxpar.training.trainable import policy

BASE = str(REPO / "configs" / "base.yml")
LENGTH, ROWS = 128, 8
VOCAB = ["vocab_size=512"]


@pytest.fixture(scope="module")
def material(tmp_path_factory) -> dict[str, Path]:
    """A tokenizer with its chat template, and JSONL conversations and pairs."""
    root = tmp_path_factory.mktemp("post_training")
    build_tokenizer(root / "tokenizer")
    return {"tokenizer": root / "tokenizer" / "tokenizer.json", "root": root,
            "sft": write_jsonl(conversations(48), root / "sft.jsonl"),
            "dpo": write_jsonl(pairs(48), root / "dpo.jsonl")}


@pytest.fixture(scope="module")
def fmt(material) -> Formatter:
    path = str(material["tokenizer"])
    return Formatter(load_tokenizer(path), load_chat_template(path))


def first_batch(records: Path, features, fmt: Formatter, rows: int = ROWS, length: int = LENGTH) -> dict:
    return next(iter(record_batches(JsonlRecords([str(records)]), features, pad_id=fmt.tokenizer.pad_id,
                                    seq_len=length, global_batch_rows=rows, seed=0)))


@pytest.fixture(scope="module")
def sft_batch(material, fmt):
    return first_batch(material["sft"], fmt.conversation, fmt)


@pytest.fixture(scope="module")
def dpo_batch(material, fmt):
    return first_batch(material["dpo"], fmt.pair, fmt)


def step_losses(config, devices, batch, steps: int = 2) -> np.ndarray:
    """(loss, grad_norm) of `steps` compiled train steps on `batch`, from the seeded state, on `devices`."""
    tx = make_optimizer(config)
    layout, mesh = layout_on(config, devices, tx)
    model = Transformer(model_config(config), layout.model)
    state = create_state(model, tx, layout, mesh)
    step = jit_train_step(model, tx, layout, mesh)
    sharded = {key: jax.device_put(value, layout.input_sharding(mesh)) for key, value in batch.items()}
    out = []
    for _ in range(steps):
        state, metrics = step(state, sharded)
        out.append((float(metrics["loss"]), float(metrics["grad_norm"]),
                    float(metrics.get("dpo_reward_accuracy", 0.0))))
    return np.array(out)


# ---------------------------------------------------------------- SFT

def test_sft_masked_loss_equals_hand_computed(sft_batch):
    """The objective's loss counts the assistant targets only: the float32 log-softmax of the model's own logits
    at those positions, summed by hand, is what it returns."""
    config = micro_config(*VOCAB, f"max_target_length={LENGTH}", "use_sft=true", "dataset_type=grain",
                         "dataset_path=unused")
    layout, mesh = layout_on(config, jax.devices()[:1])
    model = Transformer(model_config(config), layout.model)
    state = create_state(model, make_optimizer(config), layout, mesh)
    batch = {key: jnp.asarray(value) for key, value in sft_batch.items()}
    _, sums = jax.jit(lambda p, b: objective(p, {}, b, model=model, config=config))(state.params, batch)
    logits = np.asarray(jax.jit(model.apply)({"params": state.params}, batch["inputs"], batch["positions"],
                                             batch["segment_ids"]), np.float64)
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    picked = np.take_along_axis(log_probs, sft_batch["targets"][..., None], -1)[..., 0]
    mask = sft_batch["loss_mask"] != 0
    assert 0 < mask.sum() < (sft_batch["segment_ids"] != 0).sum()  # the prompts and markup are left out
    np.testing.assert_allclose(float(sums["loss_sum"]), -picked[mask].sum(), rtol=1e-5)
    assert float(sums["tokens"]) == mask.sum()


SFT = ["use_sft=true", "dataset_type=grain", "dataset_path=unused", f"max_target_length={LENGTH}", *VOCAB,
       "warmup_steps=0"]
LORA = ["lora_rank=4", "lora_alpha=8", "lora_target_roles=[query,value,attention_out,mlp_gate,mlp_down]"]
# LoRA adapters on PP(2)xFSDP(2)xTP(2) gPipe are DPO's case (dpo_lora_gpipe below): the adapters' sharding and
# their pipelined gradients do not depend on the loss, and SFT's masked loss on a pipeline is sft_1f1b's.
MESHES = {
    "sft_1f1b": (SFT + ["num_decoder_layers=4"],
                 ["ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "pipeline_schedule=1f1b"]),
    "sft_lora_experts_ep": (SFT + ["num_experts=4", "num_experts_per_tok=2", "lora_rank=4",
                                   "lora_target_roles=[query,expert_gate,expert_up,expert_down]"],
                            ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"]),
}


@pytest.mark.parametrize("name", list(MESHES))
def test_sft_on_a_mesh_equals_one_device(name, sft_batch):
    keys, mesh = MESHES[name]
    reference = step_losses(micro_config(*keys), jax.devices()[:1], sft_batch)
    sharded = step_losses(micro_config(*keys, *mesh), jax.devices(), sft_batch)
    assert reference[1, 0] < reference[0, 0]  # it learns
    np.testing.assert_allclose(sharded, reference, rtol=2e-5, atol=1e-6)


# ---------------------------------------------------------------- DPO

DPO = ["use_dpo=true", "dataset_type=grain", "dataset_path=unused", f"max_target_length={LENGTH}", *VOCAB,
       "learning_rate=3e-2", "warmup_steps=0"]


@pytest.mark.parametrize("name, keys, mesh", [
    ("dpo_fsdp_tp", DPO, ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    ("dpo_lora_gpipe", DPO + LORA + ["num_decoder_layers=4"],
     ["ici_stage_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "pipeline_schedule=gpipe"]),
])
def test_dpo_on_a_mesh_equals_one_device(name, keys, mesh, dpo_batch):
    reference = step_losses(micro_config(*keys), jax.devices()[:1], dpo_batch)
    sharded = step_losses(micro_config(*keys, *mesh), jax.devices(), dpo_batch)
    np.testing.assert_allclose(reference[0, 0], np.log(2.0), rtol=1e-6)  # the policy starts as the reference
    assert reference[1, 0] < reference[0, 0]
    np.testing.assert_allclose(sharded, reference, rtol=2e-5, atol=1e-6)


def test_a_bad_dpo_lora_step_moves_nothing(dpo_batch):
    """The bad-step guard holds for DPO with LoRA: a good step moves the adapters; a step judged a spike (the guard
    remembers losses averaging 0.01, this one is ln 2) and one with a NaN in an adapter keep the adapters, their
    moments and the frozen base and reference bitwise; only `step` and the guard's counts move."""
    config = micro_config(*DPO, *LORA, "skip_step_on_spike_factor=2")
    tx = make_optimizer(config)
    layout, mesh = layout_on(config, jax.devices()[:1], tx)
    model = Transformer(model_config(config), layout.model)
    step = jit_train_step(model, tx, layout, mesh)
    batch = {key: jax.device_put(value, layout.input_sharding(mesh)) for key, value in dpo_batch.items()}
    state = create_state(model, tx, layout, mesh)
    before = jax.device_get(state.params)
    good, _ = step(state, batch)  # donates `state`
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                        jax.tree.leaves(jax.device_get(good.params))))

    def assert_skipped(held, cause: str):
        kept = jax.device_get(held)
        out, metrics = step(held, batch)
        held, out = kept, jax.device_get(out)
        assert int(out.step) == int(held.step) + 1
        assert int(metrics[cause]) == int(getattr(held.opt_state.guard, cause)) + 1
        for got, want in ((out.params, held.params), (out.frozen, held.frozen), (out.fp8_meta, held.fp8_meta),
                          (out.opt_state.rule, held.opt_state.rule)):
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                              np.asarray(b).reshape(-1).view(np.uint8))

    good = jax.device_get(good)
    low = good.opt_state.guard._replace(loss_sum=jnp.float32(0.01 * (1 - 0.99 ** 100)), losses_seen=jnp.int32(100))
    assert_skipped(jax.device_put(good.replace(opt_state=good.opt_state._replace(guard=low)),
                                  layout.state_shardings(mesh)), "skipped_spikes")
    poisoned = jax.tree.map(np.array, good)
    leaf = jax.tree.leaves(poisoned.params)[0]
    leaf.reshape(-1)[0] = np.nan
    assert_skipped(jax.device_put(poisoned, layout.state_shardings(mesh)), "skipped_nonfinite")


def test_label_smoothing_is_conservative_dpo():
    """dpo_label_smoothing eps: -(1 - eps) log sigmoid(m) - eps log sigmoid(-m) of the reward margin m."""
    policy = jnp.array([[0.0, -3.0, -5.0, -2.0, -7.0]])
    reference = jnp.array([[0.0, -4.0, -4.0, -2.5, -6.0]])
    segments = jnp.array([[1, 2, 3, 4]])
    sums = dpo.pair_sums(policy, reference, segments, beta=0.5, smoothing=0.2)
    margins = 0.5 * np.array([(-3 + 4) - (-5 + 4), (-2 + 2.5) - (-7 + 6)])
    expected = -(0.8 * np.log(1 / (1 + np.exp(-margins))) + 0.2 * np.log(1 / (1 + np.exp(margins))))
    np.testing.assert_allclose(float(sums["loss_sum"]), expected.sum(), rtol=1e-6)
    assert float(sums["tokens"]) == 2 and float(sums["dpo_accuracy_sum"]) == 2


def save_llama(directory: Path, seed: int, vocab: int) -> Path:
    """A tiny random Llama of transformers', weights far from init so every tensor matters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.2 * torch.randn_like(param) if name.endswith("norm.weight")
                        else 0.15 * torch.randn_like(param))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def imported(material) -> dict[str, Path]:
    """Two tiny Llamas (policy, reference) saved by transformers with the tokenizer, and their maxpar imports."""
    root = material["root"]
    out = {}
    for name, seed in (("policy", 1), ("reference", 2)):
        hf = save_llama(root / f"hf_{name}", seed, 512)
        for file in material["tokenizer"].parent.iterdir():
            (hf / file.name).write_bytes(file.read_bytes())
        out[name], out[f"{name}_maxpar"] = hf, root / f"maxpar_{name}"
        assert convert(["from_hf", "--hf_path", str(hf), "--out", str(out[f"{name}_maxpar"])]) == 0
    return out


def trl_dpo(policy: Path, reference: Path, records: list[dict], beta: float) -> dict[str, float]:
    """TRL's DPO loss and metrics on every pair at once (float32, the reference model given)."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    model = load(policy)
    args = DPOConfig(output_dir=str(policy / "trl"), per_device_train_batch_size=len(records), beta=beta,
                     report_to=[], use_cpu=True, bf16=False, max_length=None, precompute_ref_log_probs=False)
    trainer = DPOTrainer(model=model, ref_model=load(reference), args=args,
                         train_dataset=datasets.Dataset.from_list(records),
                         processing_class=AutoTokenizer.from_pretrained(policy))
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        loss = float(trainer.compute_loss(model, batch))
    metrics = {name: values[-1] for name, values in trainer._metrics["eval"].items()}
    return {"loss": loss, **metrics}


@pytest.mark.parametrize("form", ["conversational", "text"])
def test_dpo_loss_and_metrics_equal_trl(form, imported, material, fmt):
    """The same pairs, policy and reference: maxpar's DPO loss and reward metrics are TRL's DPOTrainer's."""
    records = pairs(6)
    if form == "conversational":  # TRL wants the responses as message lists; maxpar takes either
        trl_records = [{**r, "chosen": [{"role": "assistant", "content": r["chosen"]}],
                        "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in records]
    else:
        records = trl_records = [{"prompt": r["prompt"][0]["content"] + "\n", "chosen": r["chosen"],
                                  "rejected": r["rejected"]} for r in records]
    theirs = trl_dpo(imported["policy"], imported["reference"], trl_records, beta=0.1)
    rows = [pack_row([fitted(fmt.pair(Record(r, f"pair {i}")), 2 * LENGTH, "")], 2 * LENGTH, fmt.tokenizer.pad_id)
            for i, r in enumerate(records)]
    batch = {key: jnp.asarray(np.stack([row[key] for row in rows])) for key in rows[0]}
    overrides = (imported["policy_maxpar"] / "overrides.txt").read_text().split()
    config = load_config([BASE, *overrides, "use_dpo=true", "dataset_type=grain", "dataset_path=unused",
                          "dtype=float32", f"max_target_length={2 * LENGTH}"])
    layout, mesh = layout_on(config, jax.devices()[:1])
    target = checkpoint.Target(config, layout.state.abstract, layout.state_shardings(mesh), 0)
    policy, reference = (checkpoint.load_parameters(str(imported[f"{name}_maxpar"]), target)
                         for name in ("policy", "reference"))
    model = Transformer(model_config(config), layout.model)
    _, sums = jax.jit(lambda p, r, b: dpo.objective(p, r, {}, b, model=model, config=config))(policy, reference, batch)
    count = float(sums["tokens"])
    ours = {"loss": float(sums["loss_sum"]) / count, **{k: float(v) for k, v in dpo.metrics(sums, count).items()}}
    assert count == len(records) and 0 < ours["dpo_reward_accuracy"] < 1  # neither side wins every pair
    names = {"rewards/chosen": "dpo_chosen_reward", "rewards/rejected": "dpo_rejected_reward",
             "rewards/accuracies": "dpo_reward_accuracy", "rewards/margins": "dpo_reward_margin",
             "logps/chosen": "dpo_chosen_logps", "logps/rejected": "dpo_rejected_logps"}
    np.testing.assert_allclose(ours["loss"], theirs["loss"], rtol=1e-5)
    for trl_name, name in names.items():
        np.testing.assert_allclose(ours[name], theirs[trl_name], rtol=1e-5, atol=1e-5, err_msg=trl_name)


# ---------------------------------------------------------------- LoRA: training, checkpoints, exports

def test_lora_adapters_start_as_the_base_and_merge_exactly(sft_batch):
    """B starts at zero: the adapted model is its base. With random B, the adapted model's logits are those of the
    base with W + alpha / rank A B in place of W (the converter's and load_parameters' merge)."""
    config = micro_config(*SFT, *LORA)
    layout, mesh = layout_on(config, jax.devices()[:1])
    model = Transformer(model_config(config), layout.model)
    state = create_state(model, make_optimizer(config), layout, mesh)
    inputs = (sft_batch["inputs"], sft_batch["positions"], sft_batch["segment_ids"])
    apply = jax.jit(lambda params: model.apply({"params": params}, *inputs))

    def logits(params):
        return np.asarray(apply(params))
    adapted = policy(state.params, state.frozen, config)
    np.testing.assert_array_equal(logits(adapted), logits(state.frozen))
    keys = iter(jax.random.split(jax.random.key(1), 64))
    random_params = jax.tree.map(lambda a: 0.3 * jax.random.normal(next(keys), a.shape, a.dtype), state.params)
    adapted = policy(random_params, state.frozen, config)
    merged = merge_adapters(adapted, config.lora_alpha / config.lora_rank)
    assert np.abs(logits(adapted) - logits(state.frozen)).max() > 0.1
    np.testing.assert_allclose(logits(merged), logits(adapted), rtol=1e-4, atol=5e-5)  # float32 rounding


@pytest.fixture(scope="module")
def lora_run(imported, material) -> dict:
    """SFT with LoRA from the imported policy: 3 steps, checkpoints at 2 and 3; then its step 3 removed and rerun
    from step 2."""
    root = material["root"] / "lora_run"
    overrides = (imported["policy_maxpar"] / "overrides.txt").read_text().split()
    config = load_config([BASE, *overrides, "use_sft=true", "dataset_type=grain", f"dataset_path={material['sft']}",
                          f"tokenizer_path={material['tokenizer']}", "dtype=float32", f"max_target_length={LENGTH}",
                          "per_device_batch_size=1", "steps=3", "checkpoint_period=2", "log_period=1",
                          "eval_interval=3", "eval_steps=1", "learning_rate=3e-2", "warmup_steps=0",
                          "async_checkpointing=false", "lora_rank=4", "lora_alpha=8",
                          "lora_target_roles=[query,key,value,attention_out,mlp_up]",
                          "lora_base_weight_dtype=bfloat16"])
    train(config, devices=jax.devices()[:2], run_dir=root)
    first = read_metrics(root)
    shutil.rmtree(root / "checkpoints" / "3")
    train(config, devices=jax.devices()[:2], run_dir=root)
    return {"dir": root, "config": config, "first": first, "resumed": read_metrics(root)}


def test_lora_run_trains_and_checkpoints_only_adapters(lora_run):
    first, config = lora_run["first"], lora_run["config"]
    assert [row["step"] for row in first] == [1, 2, 3] and first[-1]["eval_loss"] is not None
    _, saved, metadata = checkpoint.parameters_metadata("test", str(lora_run["dir"]))
    names = {"/".join(path) for path in _leaf_names(metadata.tree)}
    assert names and all("_lora_" in name for name in names)  # the base is not in the checkpoint
    assert {name.rsplit("/", 1)[-1] for name in names} >= {"query_lora_a", "wi_up_lora_b"}
    assert saved["lora_rank"] == config.lora_rank


def _leaf_names(tree, prefix=()):
    for key, value in tree.items():
        if hasattr(value, "items"):
            yield from _leaf_names(value, (*prefix, key))
        else:
            yield (*prefix, key)


def test_lora_resume_is_exact(lora_run):
    """The adapters and moments from checkpoint 2, the frozen base read again, the data position restored: step 3
    again is the same step 3."""
    resumed = [row for row in lora_run["resumed"] if row["step"] == 3]
    assert resumed and resumed[-1]["loss"] == lora_run["first"][-1]["loss"]


def test_lora_exports_merged_and_as_peft_adapter_with_equal_logits(lora_run, imported, tmp_path):
    """to_hf merges the adapters into the base; --peft writes them as a PEFT adapter that peft applies to the base
    model: both give transformers logits equal to maxpar's for the trained model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    assert convert(["to_hf", "--checkpoint", str(lora_run["dir"]), "--out", str(merged_dir),
                    "--hf_template", str(imported["policy"])]) == 0
    assert convert(["to_hf", "--checkpoint", str(lora_run["dir"]), "--out", str(adapter_dir), "--peft",
                    "--hf_template", str(imported["policy"])]) == 0
    tokens = np.random.default_rng(0).integers(0, 500, (2, 24))
    config = load_config([BASE, *(imported["policy_maxpar"] / "overrides.txt").read_text().split(),
                          "dtype=float32", "max_target_length=24", f"load_parameters_path={lora_run['dir']}"])
    layout, mesh = layout_on(config, jax.devices()[:1])
    target = checkpoint.Target(config, layout.state.abstract, layout.state_shardings(mesh), 0)
    params = checkpoint.load_parameters(config.load_parameters_path, target)  # merged as it loads
    model = Transformer(model_config(config), layout.model)
    ours = np.asarray(jax.jit(model.apply)({"params": params}, tokens, np.broadcast_to(np.arange(24), tokens.shape),
                                           np.ones_like(tokens)))

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        merged = load(merged_dir)(torch.tensor(tokens)).logits.numpy()
        peft_model = PeftModel.from_pretrained(load(imported["policy"]), adapter_dir)
        adapted = peft_model(torch.tensor(tokens)).logits.numpy()
        with peft_model.disable_adapter():
            base = peft_model(torch.tensor(tokens)).logits.numpy()
    # the base was kept in bfloat16 (lora_base_weight_dtype): the exports hold it so too
    np.testing.assert_allclose(merged, ours, rtol=1e-4, atol=1e-4)
    assert np.abs(adapted - base).max() > 1e-3  # the adapter changes the model ...
    np.testing.assert_allclose(adapted, merged, rtol=1e-4, atol=1e-4)  # ... as the merge does
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


# ---------------------------------------------------------------- bad input

def run_main(capsys, *overrides: str) -> tuple[int, str]:
    code = train_main([BASE, *overrides])
    return code, capsys.readouterr().err.strip()


def test_lora_on_a_role_the_model_lacks_exits_2_naming_it(capsys):
    code, err = run_main(capsys, "model_name=tiny", "steps=1", "lora_rank=4", "lora_target_roles=[query,expert_up]")
    assert code == 2 and err.count("\n") == 0
    assert "lora_target_roles: this model has no 'expert_up' weights" in err


def test_conversation_without_assistant_turn_exits_2_naming_the_record(capsys, material, tmp_path):
    bad = write_jsonl([{"messages": [{"role": "user", "content": "hello?"}]}], tmp_path / "bad.jsonl")
    code, err = run_main(capsys, "model_name=tiny", "steps=1", "use_sft=true", "dataset_type=grain",
                         f"dataset_path={bad}", f"tokenizer_path={material['tokenizer']}", "vocab_size=512",
                         "eval_fraction=0")
    assert code == 2 and err.count("\n") == 0
    assert f"{bad}, record 1: the conversation has no assistant turn" in err


@pytest.mark.parametrize("overrides, message", [
    (["lora_rank=4", "ici_stage_parallelism=2", "pipeline_schedule=1f1b"],
     "lora_rank=4 with pipeline_schedule=1f1b: .* LoRA runs pipeline_schedule=gpipe or circular"),
    (["use_dpo=true", "dataset_type=grain", "pipeline_schedule=zero_bubble"],
     "use_dpo=true with pipeline_schedule=zero_bubble"),
    (["use_sft=true", "dataset_type=text"], "use_sft=true with dataset_type=text"),
    (["use_dpo=true", "dataset_type=grain", "z_loss_weight=1e-4"], "use_dpo=true with z_loss_weight=0.0001"),
    (["lora_rank=4", "lora_target_roles=[router]"], "'router' is not a projection role LoRA adapts"),
])
def test_bad_post_training_keys_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        trace_state(load_config([BASE, *overrides]))
    assert "\n" not in str(error.value)
