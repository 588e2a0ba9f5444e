"""Regression: two identical short runs give bitwise-identical per-step losses.

    python end_to_end/determinism.py [--steps 8] [key=value ...]

Trains the micro model (maxpar/tools/testbed.py) twice in this process, on the same small text corpus, with
8 simulated CPU devices under FSDP(4)xTP(2) (so sharded collectives are covered too), compares the
logged losses bit for bit (float32 bit patterns), prints both and a PASS/FAIL line; exits non-zero on FAIL.
"""

from __future__ import annotations

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=8)

import argparse
import os
import tempfile
import time
from pathlib import Path
from verdict import exit_with  # end_to_end/verdict.py: this script's folder is sys.path[0]


import jax
import numpy as np
from maxpar.tools.testbed import read_metrics, micro_config, write_corpus

from maxpar.train import train


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for both runs")
    args = parser.parse_args()
    os.chdir(REPO)  # micro_config reads configs/base.yml relative to the repository
    start = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(Path(tmp) / "corpus")
        for i in range(2):
            config = micro_config(f"steps={args.steps}", "dataset_type=text", f"dataset_path={corpus}",
                                 "eval_fraction=0", "per_device_batch_size=1", "ici_fsdp_parallelism=4",
                                 "ici_tensor_parallelism=2", *args.overrides)
            run_dir = Path(tmp) / f"run{i}"
            train(config, devices=jax.devices()[:8], run_dir=run_dir)
            runs.append(np.array([r["loss"] for r in read_metrics(run_dir)], dtype=np.float32))
    first, second = runs
    print("\nstep  run 1 loss (bits)             run 2 loss (bits)")
    for step, (a, b) in enumerate(zip(first, second), start=1):
        mark = "" if a.view(np.uint32) == b.view(np.uint32) else "  DIFFERS"
        print(f"{step:>4}  {a:.8f} (0x{a.view(np.uint32):08x})  {b:.8f} (0x{b.view(np.uint32):08x}){mark}")
    elapsed = time.perf_counter() - start
    if len(first) != args.steps or first.shape != second.shape:
        print(f"FAIL: logged {len(first)} and {len(second)} steps, expected {args.steps}")
        return 1
    if not np.array_equal(first.view(np.uint32), second.view(np.uint32)):
        print(f"FAIL: the two runs' losses are not bitwise identical ({elapsed:.0f} s)")
        return 1
    print(f"PASS: {args.steps} per-step losses bitwise identical across two runs ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    exit_with(main)
