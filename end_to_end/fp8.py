"""Regression: quantization=fp8 trains the default model to the held-out loss of the same run in bfloat16.

    python end_to_end/fp8.py [--steps 300] [--tolerance 0.02] [--recipes current,delayed] [--record DIR] [key=value ...]
    python end_to_end/fp8.py --gemm-check     # on a GPU: do the fp8 matmuls compile to cuBLASLt fp8 GEMMs?

The first form runs `python -m maxpar.train configs/base.yml` once in dtype=bfloat16, then once per fp8 scaling
recipe (--recipes: fp8_scaling=current, delayed; same seed, data and steps), prints the final held-out losses,
each recipe's ratio to bfloat16's and the load average, and PASSes when every ratio is within --tolerance of 1;
`--record DIR` also writes them as an `fp8_300` record (`maxpar.tools.records`; named for the default step count).

`--gemm-check` compiles the fp8 forward and backward of each projection shape of the benchmark model on the
first device and counts the compiled program's cuBLASLt fp8 GEMM calls (`__cublas$lt$matmul$f8`): 3 per
projection (y, dx, dw) is a PASS. XLA rewrites fp8 GEMMs before its Triton GEMM fusion, which would otherwise
take the fp8 operands and multiply in bfloat16; so fewer means that matmul runs at the bfloat16 rate. Without a
GPU it prints SKIP.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
import time
from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]
from verdict import exit_with  # end_to_end/verdict.py: this script's folder is sys.path[0]

REPO = prepare(devices=None)

from maxpar.tools import records  # noqa: E402

FP8_GEMM = "__cublas$lt$matmul$f8"


def final_eval_loss(out: Path, name: str, overrides: list[str]) -> float:
    """Train one run of the default config with `overrides` and return its last held-out loss."""
    command = [sys.executable, "-m", "maxpar.train", "configs/base.yml", f"base_output_directory={out}",
               f"run_name={name}", "enable_checkpointing=false", *overrides]
    subprocess.run(command, cwd=REPO, check=True)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return next(r["eval_loss"] for r in reversed(rows) if r["eval_loss"] is not None)


def compare_training(args: argparse.Namespace) -> int:
    load_start, started = records.load_average(), time.perf_counter()
    common = [f"steps={args.steps}", "dtype=bfloat16", *args.overrides]
    with tempfile.TemporaryDirectory() as out:
        bf16 = final_eval_loss(Path(out), "bf16", common)
        ratios = {recipe: final_eval_loss(Path(out), f"fp8_{recipe}",
                                          [*common, "quantization=fp8", f"fp8_scaling={recipe}"]) / bf16
                  for recipe in args.recipes}
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    losses = ", ".join(f"fp8 {recipe} {ratio * bf16:.4f} (ratio {ratio:.4f})" for recipe, ratio in ratios.items())
    print(f"held-out loss after {args.steps} steps: bfloat16 {bf16:.4f}, {losses} (load average {load})")
    failed = [f"{recipe} {ratio:.4f}" for recipe, ratio in ratios.items() if abs(ratio - 1) > args.tolerance]
    if args.record:
        figures = {"steps": args.steps, "bf16_eval_loss": round(bf16, 4),
                   **{f"fp8_{recipe}_eval_loss": round(ratio * bf16, 4) for recipe, ratio in ratios.items()},
                   **{f"fp8_{recipe}_ratio": round(ratio, 4) for recipe, ratio in ratios.items()},
                   "tolerance": args.tolerance, "pass": not failed, "wall_s": round(time.perf_counter() - started)}
        command = ["python", "end_to_end/fp8.py", f"--steps={args.steps}", f"--recipes={','.join(args.recipes)}",
                   *args.overrides]
        print(f"record: {records.write_record(args.record, 'fp8_300', command, figures, load_start)}")
    if failed:
        print(f"FAIL: fp8/bf16 held-out loss ratios not within {args.tolerance:.0%} of 1: {', '.join(failed)}")
        return 1
    print(f"PASS: fp8 held-out losses within {args.tolerance:.0%} of bfloat16's "
          f"({', '.join(f'{recipe} {ratio:.4f}' for recipe, ratio in ratios.items())})")
    return 0


# The model's four projection shapes at the benchmark model's sizes (4 rows x 2048 tokens, emb 2048, 16 heads
# x 128, MLP 5632): spec, x's shape, w's shape.
PROJECTIONS = (("ble,ehd->blhd", (4, 2048, 2048), (2048, 16, 128)),   # q, k, v
               ("blhd,hde->ble", (4, 2048, 16, 128), (16, 128, 2048)),  # attention output
               ("ble,em->blm", (4, 2048, 2048), (2048, 5632)),         # MLP gate, up
               ("blm,me->ble", (4, 2048, 5632), (5632, 2048)))         # MLP down


def fp8_gemm_count(spec: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> int:
    """cuBLASLt fp8 GEMM calls in the compiled forward and backward of one fp8 projection (bf16 x, f32 w)."""
    import jax
    import jax.numpy as jnp

    from maxpar.model.matmul import matmul

    def project(x, w):
        return matmul(spec, x, w, jnp.bfloat16, quantization="fp8")

    def forward_and_backward(x, w, g):  # the cotangent is an argument: a constant one could fold away
        y, pullback = jax.vjp(project, x, w)
        return y, *pullback(g)

    x, w = jax.ShapeDtypeStruct(x_shape, jnp.bfloat16), jax.ShapeDtypeStruct(w_shape, jnp.float32)
    compiled = jax.jit(forward_and_backward).lower(x, w, jax.eval_shape(project, x, w)).compile()
    return compiled.as_text().count(FP8_GEMM)


def gemm_check() -> int:
    import jax

    device = jax.devices()[0]
    if device.platform != "gpu":
        print(f"SKIP: --gemm-check needs a GPU (the first device is {device.platform})")
        return 0
    missing = 0
    for spec, x_shape, w_shape in PROJECTIONS:
        count = fp8_gemm_count(spec, x_shape, w_shape)
        print(f"{device.device_kind} {spec}: {count} of 3 matmuls (y, dx, dw) are fp8 GEMMs ({FP8_GEMM})")
        missing += max(3 - count, 0)
    if missing:
        print(f"FAIL: {missing} of {3 * len(PROJECTIONS)} matmuls were not rewritten to fp8 GEMMs (they run in bf16)")
        return 1
    print("PASS: every projection's forward and both gradient matmuls are fp8 GEMMs")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="training steps of each run")
    parser.add_argument("--tolerance", type=float, default=0.02, help="allowed |fp8/bf16 - 1| of the held-out loss")
    parser.add_argument("--recipes", type=lambda text: text.split(","), default=["current", "delayed"],
                        help="fp8_scaling recipes to compare with bfloat16, comma-separated")
    parser.add_argument("--gemm-check", action="store_true", help="only check the GPU's fp8 GEMM rewrite")
    records.add_record_option(parser)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for both runs")
    args = parser.parse_args()
    return gemm_check() if args.gemm_check else compare_training(args)


if __name__ == "__main__":
    exit_with(main)
