"""Regression: `python -m maxpar.plan --verify` for every parallelism strategy on simulated CPU devices.

    python end_to_end/plan_verify.py [--extended] [key=value ...]

Compiles the real train step of a tiny model for DP(8), FSDP(8), FSDP(4)xTP(2), TP(8),
DP(2)xFSDP(2)xTP(2), TP-sequence FSDP(4)xTP(2) and the pipelines PP(2)xDP(2)xTP(2) circular and
PP(4)xFSDP(2) gPipe (with --extended also bf16, remat, gradient-accumulation, unscanned, tied-embedding
and more pipeline variants),
compares the predicted collectives and memory with the compiled program, prints one PASS/FAIL
line per strategy and exits non-zero if any fails. Extra key=value overrides apply to all.
"""

from __future__ import annotations

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=8)

import argparse
from verdict import exit_with  # end_to_end/verdict.py: this script's folder is sys.path[0]

from maxpar.tools.testbed import MICRO_MODEL

MODEL = ["model_name=micro", *MICRO_MODEL, "max_target_length=32", "per_device_batch_size=4", "dtype=float32",
         "weight_dtype=float32", "hardware=tpu-v5p"]
STRATEGIES = {
    "DP(8)": ["ici_data_parallelism=-1", "ici_fsdp_parallelism=1"],
    "FSDP(8)": ["ici_fsdp_parallelism=-1"],
    "FSDP(4)xTP(2)": ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"],
    "TP(8)": ["ici_fsdp_parallelism=1", "ici_tensor_parallelism=-1", "num_query_heads=8", "num_kv_heads=8",
              "per_device_batch_size=1"],
    "DP(2)xFSDP(2)xTP(2)": ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"],
    "PP(2)xDP(2)xTP(2) circular": ["ici_stage_parallelism=2", "ici_data_parallelism=2", "ici_fsdp_parallelism=1",
                                   "ici_tensor_parallelism=2", "num_decoder_layers=4", "num_pipeline_repeats=2",
                                   "num_pipeline_microbatches=4"],
    "PP(4)xFSDP(2) gPipe": ["ici_stage_parallelism=4", "ici_fsdp_parallelism=2", "num_decoder_layers=4",
                            "num_pipeline_microbatches=8"],
    "TP-sequence FSDP(4)xTP(2)": ["tp_sequence.yml", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"],
}
EXTENDED = {
    "FSDP(4)xTP(2) bf16": [*STRATEGIES["FSDP(4)xTP(2)"], "dtype=bfloat16"],
    "FSDP(4)xTP(2) remat=full x2 microbatches": [*STRATEGIES["FSDP(4)xTP(2)"], "remat_policy=full",
                                                 "gradient_accumulation_steps=2"],
    "DP(2)xFSDP(2)xTP(2) remat=minimal unscanned": [*STRATEGIES["DP(2)xFSDP(2)xTP(2)"], "remat_policy=minimal",
                                                    "scan_layers=false"],
    "FSDP(4)xTP(2) unscanned": [*STRATEGIES["FSDP(4)xTP(2)"], "scan_layers=false"],
    "TP-sequence FSDP(4)xTP(2) unscanned": [*STRATEGIES["TP-sequence FSDP(4)xTP(2)"], "scan_layers=false"],
    "TP-sequence FSDP(4)xTP(2) remat=minimal": [*STRATEGIES["TP-sequence FSDP(4)xTP(2)"], "remat_policy=minimal"],
    "FSDP(8) tied embeddings": [*STRATEGIES["FSDP(8)"], "logits_via_embedding=true"],
    "DP(2)xFSDP(2)xTP(2) tied embeddings": [*STRATEGIES["DP(2)xFSDP(2)xTP(2)"], "logits_via_embedding=true"],
    "PP(2)xFSDP(2)xTP(2) circular bf16": ["ici_stage_parallelism=2", "ici_fsdp_parallelism=2",
                                          "ici_tensor_parallelism=2", "num_decoder_layers=4",
                                          "num_pipeline_repeats=2", "num_pipeline_microbatches=4", "dtype=bfloat16"],
    "PP(2)xFSDP(2)xTP(2) circular ag_once x2 microbatches": [
        "ici_stage_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "num_decoder_layers=4",
        "num_pipeline_repeats=2", "pipeline_fsdp_ag_once=true", "gradient_accumulation_steps=2"],
    "PP(2)xDP(2)xFSDP(2) gPipe remat=full": ["ici_stage_parallelism=2", "ici_data_parallelism=2",
                                             "ici_fsdp_parallelism=2", "num_pipeline_microbatches=2",
                                             "remat_policy=full"],
    "PP(2)xDP(2)xFSDP(2) 1f1b": ["ici_stage_parallelism=2", "ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                                 "num_decoder_layers=4", "num_pipeline_microbatches=4", "pipeline_schedule=1f1b"],
    "PP(2)xDP(2)xFSDP(2) zero_bubble": ["ici_stage_parallelism=2", "ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                                        "num_decoder_layers=4", "num_pipeline_microbatches=4",
                                        "pipeline_schedule=zero_bubble"],
    "PP(2)xDP(4) interleaved_1f1b": ["ici_stage_parallelism=2", "ici_data_parallelism=4", "ici_fsdp_parallelism=1",
                                     "num_pipeline_repeats=2", "num_pipeline_microbatches=4", "per_device_batch_size=2",
                                     "pipeline_schedule=interleaved_1f1b"],
}


def config_and_overrides(case: list[str]) -> tuple[str, list[str]]:
    """A case may name a strategy preset in configs/ first (e.g. tp_sequence.yml); base.yml otherwise."""
    if case and case[0].endswith(".yml"):
        return case[0], case[1:]
    return "base.yml", case


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extended", action="store_true", help="also bf16, remat and accumulation variants")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for every strategy")
    args = parser.parse_args()
    from maxpar.core.config import ConfigError
    from maxpar.plan.__main__ import run

    cases = {**STRATEGIES, **(EXTENDED if args.extended else {})}
    failed = []
    for name, case in cases.items():
        config_file, overrides = config_and_overrides(case)
        try:
            result, _, status = run([str(REPO / "configs" / config_file), *MODEL, *overrides, *args.overrides,
                                     "--verify"])
        except ConfigError as e:
            print(f"FAIL  {name}: config error: {e}")
            failed.append(name)
            continue
        v = result["verify"]
        worst = max((abs(b["error"]) for b in v["buckets"] if b["error"] is not None and b["status"] != "negligible"),
                    default=0.0)
        summary = ", ".join(f"{b['axis']} {b['collective']} {b['error']:+.1%}" for b in v["buckets"]
                            if b["error"] is not None and b["status"] != "negligible")
        state = v["memory"][0]["error"]
        print(f"{'PASS' if v['passed'] else 'FAIL'}  {name}: worst collective diff {worst:.2%} ({summary}); "
              f"train state {state:+.1%}")
        for failure in v["failures"]:
            print(f"        {failure}")
        if status:
            failed.append(name)
    print(f"{'PASS' if not failed else 'FAIL'}: {len(cases) - len(failed)}/{len(cases)} strategies verified")
    return 1 if failed else 0


if __name__ == "__main__":
    exit_with(main)
