"""Regression: the default config trains on offline real text to a held-out loss below a threshold.

    python end_to_end/convergence.py [--threshold 2.3] [--out DIR] [key=value ...]

Runs `python -m maxpar.train configs/base.yml` (plus overrides) in a fresh run directory, prints the
loss curve and a PASS/FAIL line, and exits non-zero on FAIL. The loss curve (train and eval loss vs
step) is also drawn into DIR/loss_curve.png next to a copy of the run's metrics.jsonl; DIR defaults
to outputs/convergence/ (under the default base_output_directory) and is printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]
from verdict import exit_with  # end_to_end/verdict.py: this script's folder is sys.path[0]

REPO = prepare(devices=None)
from maxpar.tools import records  # noqa: E402
from maxpar.training.summary import plot_losses  # noqa: E402 - the trainer's loss-curve drawing


def convergence_figures(rows: list[dict], threshold: float, wall_s: float) -> dict:
    """What a record keeps of the run: the final losses, the eval curve and the wall time."""
    evals = [[r["step"], r["eval_loss"]] for r in rows if r["eval_loss"] is not None]
    return {"steps": rows[-1]["step"], "final_train_loss": rows[-1]["loss"],
            "final_eval_loss": evals[-1][1] if evals else None, "threshold": threshold, "wall_s": round(wall_s, 1),
            "eval_losses": evals}


def main() -> int:
    load_start = records.load_average()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threshold", type=float, default=2.3, help="final eval loss must be below this (nats)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "convergence",
                        help="where to write loss_curve.png and metrics.jsonl (default: outputs/convergence/)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    records.add_record_option(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "maxpar.train", "configs/base.yml", f"base_output_directory={out}",
                   "run_name=convergence", "enable_checkpointing=false", *args.overrides]
        start = time.perf_counter()
        if subprocess.run(command, cwd=REPO).returncode:
            print("FAIL: training exited with an error")
            return 1
        metrics = Path(out) / "convergence" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        args.out.mkdir(parents=True, exist_ok=True)
        shutil.copy(metrics, args.out / "metrics.jsonl")
    wall_s = time.perf_counter() - start
    print("step  train_loss  eval_loss")
    for row in rows:
        eval_loss = "" if row["eval_loss"] is None else f"{row['eval_loss']:.4f}"
        print(f"{row['step']:>4}  {row['loss']:.4f}      {eval_loss}")
    plot_losses(rows, args.out / "loss_curve.png", "maxpar convergence: configs/base.yml", args.threshold)
    print(f"loss curve: {args.out / 'loss_curve.png'} (metrics: {args.out / 'metrics.jsonl'})")
    final = next((r["eval_loss"] for r in reversed(rows) if r["eval_loss"] is not None), None)
    if args.record:
        print("record:", records.write_record(args.record, "convergence",
                                              ["python", "end_to_end/convergence.py", *sys.argv[1:]],
                                              convergence_figures(rows, args.threshold, wall_s), load_start))
    if final is None or final >= args.threshold:
        print(f"FAIL: final eval loss {final} is not below {args.threshold}")
        return 1
    print(f"PASS: final eval loss {final:.4f} < {args.threshold} (uniform bytes: 5.545)")
    return 0


if __name__ == "__main__":
    exit_with(main)
