"""Post-training end to end, offline: a tiny Hugging Face model imported, SFT'd with LoRA on conversations, then
DPO'd with LoRA on preference pairs; and what LoRA saves.

    python end_to_end/post_training.py [--work DIR] [--pretrain-steps 300] [--sft-steps 200] [--dpo-steps 80]
                                       [--record docs/results]

1. `maxpar.tools.post_training_data` builds a random Llama with transformers from a small config (no download), a
   byte-level BPE tokenizer trained on the standard library's docstrings with a ChatML template, conversations
   ("What does json.dumps() do?" answered by the docstring's first paragraph), preference pairs (chosen: that
   answer; rejected: its words garbled) and plain text; `maxpar.convert from_hf`
   imports the model, and a short pretraining on the text (all weights) gives it the language a fine-tuning starts
   from (a random model's frozen output layer leaves adapters nothing to work with).
2. SFT with LoRA (rank 16 on every projection) on the conversations, the loss on the assistant tokens, 10% of the
   conversations held out: the held-out loss before (the imported model) and after.
3. DPO with LoRA from the SFT run (load_parameters_path= merges its adapters; the result is also the reference),
   10% of the pairs held out: the held-out DPO loss (log 2 at the start) and reward accuracy before and after.
4. What LoRA saves against full fine-tuning of the same SFT run: trained parameters, optimizer state, the
   checkpoint on disk (a 1-step full fine-tuning run written for the comparison), and the planner's per-device
   memory for LLaMA-3 8B on 8 devices of a TPU v5p (LoRA rank 16 on every projection, base in bfloat16).

PASS when the SFT held-out loss falls, the DPO held-out loss falls below log 2 with a held-out reward accuracy above
one half, and LoRA's optimizer state and checkpoint are smaller than full fine-tuning's.
"""

from __future__ import annotations

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=None)

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from verdict import exit_with  # noqa: E402  end_to_end/verdict.py

from maxpar.tools import records  # noqa: E402

LOAD_START = records.load_average()
ROLES = "[query,key,value,attention_out,mlp_gate,mlp_up,mlp_down]"


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def tree_bytes(tree) -> int:
    import jax
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def tree_size(tree) -> int:
    import jax
    return sum(leaf.size for leaf in jax.tree.leaves(tree))


def planned_memory(lora: bool) -> dict[str, float]:
    """The planner's per-device bytes of LLaMA-3 8B fine-tuned on 8 TPU v5p devices (FSDP), fully or with LoRA."""
    from maxpar.core.config import load_config
    from maxpar.core.mesh import resolve_mesh_shape
    from maxpar.plan.fit import memory_estimate

    keys = ["model_name=llama3-8b", "max_target_length=2048", "per_device_batch_size=1", "remat_policy=full",
            "use_sft=true", "dataset_type=hf", "hf_path=unused", "weight_dtype=bfloat16",
            "optimizer_state_dtype=float32"]
    if lora:
        keys += ["lora_rank=16", f"lora_target_roles={ROLES}", "lora_base_weight_dtype=bfloat16"]
    config = load_config([str(REPO / "configs" / "base.yml"), *keys])
    return memory_estimate(config, resolve_mesh_shape(config, 8))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, help="working directory (default: a temporary one)")
    parser.add_argument("--pretrain-steps", dest="pretrain_steps", type=int, default=300)
    parser.add_argument("--sft-steps", dest="sft_steps", type=int, default=200)
    parser.add_argument("--dpo-steps", dest="dpo_steps", type=int, default=80)
    parser.add_argument("--rows", type=int, default=8, help="rows per step")
    parser.add_argument("--length", type=int, default=256, help="tokens per row")
    records.add_record_option(parser)
    args = parser.parse_args()
    os.chdir(REPO)
    work = args.work or Path(tempfile.mkdtemp(prefix="maxpar-post-training-"))

    import jax

    from maxpar.convert.__main__ import main as convert
    from maxpar.core.config import load_config
    from maxpar.tools.post_training_data import build, conversations, pairs, texts, write_jsonl
    from maxpar.train import held_out_losses, train
    from maxpar.training.train_step import trace_state

    hf, imported = work / "hf_model", work / "imported"
    build(hf)
    write_jsonl(conversations(800), work / "sft.jsonl")
    write_jsonl(pairs(600), work / "dpo.jsonl")
    write_jsonl(texts(), work / "text.jsonl")
    assert convert(["from_hf", "--hf_path", str(hf), "--out", str(imported)]) == 0
    common = [str(REPO / "configs" / "base.yml"), *(imported / "overrides.txt").read_text().split(),
              "dtype=float32", f"tokenizer_path={hf / 'tokenizer.json'}", "dataset_type=grain",
              f"max_target_length={args.length}", f"per_device_batch_size={args.rows}", "eval_steps=4",
              "warmup_steps=10", "log_period=20", "async_checkpointing=false", "skip_memory_check=true"]
    devices = jax.devices()[:1]

    pretrain = load_config([*common, f"dataset_path={work / 'text.jsonl'}", f"steps={args.pretrain_steps}",
                            "eval_interval=-1", "learning_rate=3e-3", f"load_parameters_path={imported}"])
    train(pretrain, devices, work / "pretrained")
    sft_keys = [*common, "use_sft=true", f"dataset_path={work / 'sft.jsonl'}", f"steps={args.sft_steps}",
                f"eval_interval={args.sft_steps}", "learning_rate=1e-2", "lora_rank=16", "lora_alpha=32",
                f"lora_target_roles={ROLES}", f"load_parameters_path={work / 'pretrained'}"]
    sft = load_config(sft_keys)
    sft_before = held_out_losses(sft, devices)["eval_loss"]
    train(sft, devices, work / "sft")
    sft_rows = records_of(work / "sft")
    sft_after = sft_rows[-1]["eval_loss"]

    dpo = load_config([*common, "use_dpo=true", f"dataset_path={work / 'dpo.jsonl'}", f"steps={args.dpo_steps}",
                       f"eval_interval={args.dpo_steps}", "learning_rate=2e-3", "lora_rank=16", "lora_alpha=32",
                       f"lora_target_roles={ROLES}", f"load_parameters_path={work / 'sft'}"])
    dpo_before = held_out_losses(dpo, devices)
    train(dpo, devices, work / "dpo")
    dpo_rows = records_of(work / "dpo")
    dpo_after = dpo_rows[-1]

    full = load_config([*sft_keys, "lora_rank=0", "steps=1", "eval_interval=-1", "checkpoint_period=1"])
    train(full, devices, work / "sft_full")
    lora_state, full_state = trace_state(sft).abstract, trace_state(full).abstract
    saving = {
        "trained_parameters": {"lora": tree_size(lora_state.params), "full": tree_size(full_state.params)},
        "optimizer_state_bytes": {"lora": tree_bytes(lora_state.opt_state), "full": tree_bytes(full_state.opt_state)},
        "checkpoint_bytes": {"lora": directory_bytes(work / "sft" / "checkpoints" / str(args.sft_steps)),
                             "full": directory_bytes(work / "sft_full" / "checkpoints" / "1")},
        "llama3_8b_v5p_8_planned_bytes_per_device": {name: {key: round(value) for key, value in
                                                             planned_memory(name == "lora").items()}
                                                      for name in ("lora", "full")},
    }

    header = ("stage", "held-out loss before", "after", "held-out reward accuracy after")
    rows = [("SFT (LoRA)", f"{sft_before:.4f}", f"{sft_after:.4f}", "-"),
            ("DPO (LoRA)", f"{dpo_before['eval_loss']:.4f}", f"{dpo_after['eval_loss']:.4f}",
             f"{dpo_after.get('eval_dpo_reward_accuracy', float('nan')):.3f}")]
    records.print_table(header, rows)
    saving_rows = [(what, f"{figures['lora']:,}", f"{figures['full']:,}")
                   for what, figures in saving.items() if what != "llama3_8b_v5p_8_planned_bytes_per_device"]
    planned = saving["llama3_8b_v5p_8_planned_bytes_per_device"]
    saving_rows.append(("LLaMA-3 8B per device, planned (8 x v5p)", f"{planned['lora']['total'] / 1e9:.1f} GB",
                        f"{planned['full']['total'] / 1e9:.1f} GB"))
    records.print_table(("LoRA saves", "LoRA", "full fine-tuning"), saving_rows)
    figures = {"sft": {"held_out_loss_before": sft_before, "held_out_loss_after": sft_after,
                       "steps": args.sft_steps, "train_loss_last": sft_rows[-1]["loss"]},
               "dpo": {"held_out_loss_before": dpo_before["eval_loss"], "held_out_loss_after": dpo_after["eval_loss"],
                       "held_out_reward_accuracy_before": dpo_before.get("eval_dpo_reward_accuracy"),
                       "held_out_reward_accuracy_after": dpo_after.get("eval_dpo_reward_accuracy"),
                       "held_out_reward_margin_after": dpo_after.get("eval_dpo_reward_margin"),
                       "train_reward_accuracy_last": dpo_after.get("dpo_reward_accuracy"),
                       "steps": args.dpo_steps},
               "lora_saving": saving, "rows_per_step": args.rows, "tokens_per_row": args.length,
               "rows": records.table_rows(header, rows)}
    if args.record:
        path = records.write_record(args.record, "post_training", sys.argv, figures, LOAD_START)
        print(f"record: {path}")
    problems = []
    if not sft_after < sft_before:
        problems.append(f"the SFT held-out loss did not fall ({sft_before:.4f} -> {sft_after:.4f})")
    if not dpo_after["eval_loss"] < math.log(2):
        problems.append(f"the DPO held-out loss is not below log 2 ({dpo_after['eval_loss']:.4f})")
    if not dpo_after.get("eval_dpo_reward_accuracy", 0) > 0.5:
        problems.append(f"the DPO held-out reward accuracy is {dpo_after.get('eval_dpo_reward_accuracy')}")
    for what in ("optimizer_state_bytes", "checkpoint_bytes"):
        if not saving[what]["lora"] < saving[what]["full"]:
            problems.append(f"LoRA's {what} is not below full fine-tuning's: {saving[what]}")
    print(f"FAIL: {'; '.join(problems)}" if problems else
          "PASS: SFT with LoRA lowers the held-out loss, DPO with LoRA ranks the held-out pairs, LoRA saves memory")
    return 1 if problems else 0


def records_of(run_dir: Path) -> list[dict]:
    import json
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


if __name__ == "__main__":
    exit_with(main)
