"""Regression: one tiny model trained 5 steps under every sharding strategy on 8 simulated CPU devices
gives the single-device run's per-step losses.

    python end_to_end/sharding_matrix.py [--steps 5] [--rtol 1e-5] [key=value ...]

Strategies: DP(8), FSDP(8), FSDP-transpose (configs/fsdp_transpose.yml, FSDP(4)xTP(2)), FSDP(4)xTP(2),
TP(8), TP-sequence (configs/tp_sequence.yml, FSDP(4)xTP(2)), TP-transpose (configs/tp_transpose.yml,
FSDP(4)xTP(2)), DP(2)xFSDP(2)xTP(2), ZeRO-1 (shard_optimizer_over_data) on DP(8) and DP(2)xFSDP(2)xTP(2),
and gPipe pipelines PP(2)xDP(2)xTP(2) and PP(2)xFSDP(4) with pipeline_fsdp_ag_once; FSDP(8) with bfloat16
weights and float32 AdamW moments; the circular PP(2)xFSDP(4) pipeline with pipeline_fsdp_ag_per_repeat (4
layers: 2 repeats of 2 stages); then the same model with 8 dropless experts (top-2) under EP(8),
EP(4)xFSDP(2), EP(2)xPP(2)xDP(2) (MoE layers inside pipeline stages) and DP(2)xEP(2)xTP(2); and context
parallelism (attention=blockwise) CP 2/4/8 x all_gather/ring x load balance on/off, and CP mixed with FSDP,
TP and DP. Each row's reference is 1 device with the same global batch (8 rows) and the row's own model
settings (its family: dense, MoE, bf16 weights with fp32 moments, 4 layers). The tiny dims are chosen so
that 8 divides heads, kv heads, mlp and vocab (TP(8) needs that). Prints the strategy x step loss matrix and each row's max relative
difference from the reference, then a PASS/FAIL line; exits non-zero on FAIL.
"""

from __future__ import annotations

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=8)

import argparse
import json
import tempfile
import time
from pathlib import Path
from verdict import exit_with  # end_to_end/verdict.py: this script's folder is sys.path[0]


import jax
import numpy as np
from maxpar.core.config import load_config
from maxpar.tools.testbed import MICRO_MODEL, write_corpus
from maxpar.train import train

# The micro model with 8 heads = kv heads of 8 (mlp 128, vocab 264 = 8 x 33): every TP degree up to 8 divides them.
EIGHT_HEADS = ["model_name=micro", *MICRO_MODEL, "num_query_heads=8", "num_kv_heads=8", "head_dim=8",
               "max_target_length=32", "dtype=float32", "weight_dtype=float32", "warmup_steps=2", "learning_rate=1e-2",
               "log_period=1", "eval_interval=-1", "enable_checkpointing=false", "dataset_type=text", "eval_fraction=0"]
MOE = ["num_experts=8", "num_experts_per_tok=2", "capacity_factor=0"]  # dropless: EP must not change the math
# Model settings a row shares with its 1-device reference; a row's family is named by its prefix.
FAMILIES = {"": [], "MoE": MOE, "bf16/fp32": ["weight_dtype=bfloat16", "optimizer_state_dtype=float32"],
            "4 layers": ["num_decoder_layers=4"]}
# bfloat16 parameters round every update to 8 mantissa bits: a last-bit difference in a float32 gradient sum (8
# shards' partial sums vs one device's) flips a rounding now and then, and the flips add up over steps (above
# 1e-5 after 5 steps here; tests/test_equivalence.py's smaller model stays within 1e-5).
FAMILY_RTOL = {"bf16/fp32": 1e-4}
STRATEGIES = {  # name: (config file, overrides); all with per_device_batch_size=1 on 8 devices
    "DP(8)": ("base.yml", ["ici_data_parallelism=8", "ici_fsdp_parallelism=1"]),
    "FSDP(8)": ("base.yml", ["ici_fsdp_parallelism=8"]),
    "FSDP-transpose(4x2)": ("fsdp_transpose.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    "FSDP(4)xTP(2)": ("base.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    "TP(8)": ("base.yml", ["ici_fsdp_parallelism=1", "ici_tensor_parallelism=8"]),
    "TP-sequence(4x2)": ("tp_sequence.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    "TP-transpose(4x2)": ("tp_transpose.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    "DP(2)xFSDP(2)xTP(2)": ("base.yml", ["ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                                         "ici_tensor_parallelism=2"]),
    "PP(2)xDP(2)xTP(2)": ("base.yml", ["ici_stage_parallelism=2", "ici_data_parallelism=2", "ici_fsdp_parallelism=1",
                                       "ici_tensor_parallelism=2", "num_pipeline_microbatches=4"]),
    "PP(2)xFSDP(4) ag_once": ("base.yml", ["ici_stage_parallelism=2", "ici_fsdp_parallelism=4",
                                           "num_pipeline_microbatches=2", "pipeline_fsdp_ag_once=true"]),
    "DP(8) ZeRO-1": ("base.yml", ["ici_data_parallelism=8", "ici_fsdp_parallelism=1", "shard_optimizer_over_data=true"]),
    "DP(2)xFSDP(2)xTP(2) ZeRO-1": ("base.yml", ["ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                                                "ici_tensor_parallelism=2", "shard_optimizer_over_data=true"]),
    "bf16/fp32 FSDP(8)": ("base.yml", [*FAMILIES["bf16/fp32"], "ici_fsdp_parallelism=8"]),
    "4 layers PP(2)xFSDP(4) circular ag_per_repeat": ("base.yml", [
        *FAMILIES["4 layers"], "ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_repeats=2",
        "num_pipeline_microbatches=2", "pipeline_fsdp_ag_per_repeat=true"]),
    "MoE EP(8)": ("base.yml", [*MOE, "ici_expert_parallelism=8", "ici_fsdp_parallelism=1"]),
    "MoE EP(4)xFSDP(2)": ("base.yml", [*MOE, "ici_expert_parallelism=4", "ici_fsdp_parallelism=2"]),
    "MoE EP(2)xPP(2)xDP(2)": ("base.yml", [*MOE, "ici_expert_parallelism=2", "ici_stage_parallelism=2",
                                           "ici_data_parallelism=2", "ici_fsdp_parallelism=1",
                                           "num_pipeline_microbatches=2"]),
    "MoE DP(2)xEP(2)xTP(2)": ("base.yml", [*MOE, "ici_data_parallelism=2", "ici_expert_parallelism=2",
                                           "ici_fsdp_parallelism=1", "ici_tensor_parallelism=2"]),
}
# Context parallelism (attention=blockwise; the dense reference runs dot_product): CP 2/4/8 alone (the rest
# of the 8 devices data-parallel) x all_gather/ring x load balance on/off, then mixed with FSDP, TP and DP.
BLOCKWISE = ["attention=blockwise", "attention_block_size=4"]
for _cp in (2, 4, 8):
    for _strategy in ("all_gather", "ring"):
        for _balance in ("true", "false"):
            STRATEGIES[f"CP({_cp}, {_strategy}, balance={_balance})"] = ("base.yml", [
                *BLOCKWISE, f"ici_context_parallelism={_cp}", "ici_fsdp_parallelism=1", "ici_data_parallelism=-1",
                f"context_parallel_strategy={_strategy}", f"context_parallel_load_balance={_balance}"])
for _strategy in ("all_gather", "ring"):
    STRATEGIES[f"CP(2, {_strategy})xFSDP(4)"] = ("base.yml", [*BLOCKWISE, "ici_context_parallelism=2",
                                                                "ici_fsdp_parallelism=4",
                                                                f"context_parallel_strategy={_strategy}"])
    STRATEGIES[f"CP(4, {_strategy})xTP(2)"] = ("base.yml", [*BLOCKWISE, "ici_context_parallelism=4",
                                                              "ici_fsdp_parallelism=1", "ici_tensor_parallelism=2",
                                                              f"context_parallel_strategy={_strategy}"])
    STRATEGIES[f"CP(2, {_strategy})xDP(2)xTP(2)"] = ("base.yml", [*BLOCKWISE, "ici_context_parallelism=2",
                                                                    "ici_data_parallelism=2", "ici_fsdp_parallelism=1",
                                                                    "ici_tensor_parallelism=2",
                                                                    f"context_parallel_strategy={_strategy}"])


def family(name: str) -> str:
    return max((f for f in FAMILIES if name.startswith(f)), key=len)


def run_losses(config_file: str, overrides: list[str], devices, workdir: Path) -> list[float]:
    config = load_config([str(REPO / "configs" / config_file), *EIGHT_HEADS, *overrides])
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    train(config, devices=devices, run_dir=run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    args = parser.parse_args()
    devices = jax.devices()
    if len(devices) < 8:
        print(f"FAIL: needs 8 devices, found {len(devices)}")
        return 1
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        corpus = write_corpus(workdir / "corpus")
        common = [f"steps={args.steps}", f"dataset_path={corpus}"]
        references = {f: run_losses("base.yml", [*common, "per_device_batch_size=8", *settings, *args.overrides],
                                    devices[:1], workdir) for f, settings in FAMILIES.items()}
        results: dict[str, list[float] | str] = {}
        for name, (config_file, overrides) in STRATEGIES.items():
            try:
                results[name] = run_losses(config_file, [*common, "per_device_batch_size=1", *overrides,
                                                         *args.overrides], devices[:8], workdir)
            except Exception as e:  # noqa: BLE001 - one broken strategy must not hide the others
                results[name] = f"error: {type(e).__name__}: {e}"

    width = max(len(n) for n in [*STRATEGIES, *(f"{f} 1 device (reference)" for f in FAMILIES)])
    print()
    print(f"{'strategy':<{width}}  " + "  ".join(f"{'step ' + str(s):>10}" for s in range(1, args.steps + 1))
          + "  max rel diff")
    failed = []
    for name, losses in references.items():
        label = f"{name + ' ' if name else ''}1 device (reference)"
        print(f"{label:<{width}}  " + "  ".join(f"{v:>10.6f}" for v in losses))
        if len(losses) != args.steps or not losses[-1] < losses[0]:
            failed.append(label)
            print(f"{label} logged {len(losses)} steps / did not lower the loss")
    for name, losses in results.items():
        ref = np.array(references[family(name)])
        if isinstance(losses, str):
            print(f"{name:<{width}}  {losses}")
            failed.append(name)
            continue
        got = np.array(losses)
        if got.shape != ref.shape:
            print(f"{name:<{width}}  logged {len(got)} steps, expected {len(ref)}")
            failed.append(name)
            continue
        rel = float(np.max(np.abs(got - ref) / np.abs(ref)))
        ok = rel <= max(args.rtol, FAMILY_RTOL.get(family(name), 0.0))
        print(f"{name:<{width}}  " + "  ".join(f"{v:>10.6f}" for v in got) + f"  {rel:.2e}{'' if ok else '  FAIL'}")
        if not ok:
            failed.append(name)
    elapsed = time.perf_counter() - start
    if failed:
        print(f"FAIL: {', '.join(failed)} differ from the 1-device losses by more than rtol {args.rtol} "
              f"({elapsed:.0f} s)")
        return 1
    print(f"PASS: {len(results)} strategies match the 1-device losses within rtol {args.rtol} (bf16 weights: "
          f"{FAMILY_RTOL['bf16/fp32']:g}) ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    exit_with(main)
