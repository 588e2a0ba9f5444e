"""Regression: a trained checkpoint continues a prompt of Python source through `maxpar.generate`.

    python end_to_end/generate.py [--run RUN_DIR | --steps 100] [key=value ...]

With --run, samples from that run's checkpoint (e.g. outputs/<the default run>); without it, first trains
`configs/base.yml steps=N` into a temporary run. Prints each sample, prefill and decode tokens/s (compilation
excluded) and the load average (the machine is shared: the figures are noisy), then PASS when generation ran
and every continuation decodes to text (non-empty; whitespace counts), else FAIL.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from verdict import exit_with  # end_to_end/verdict.py: this script's folder is sys.path[0]

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["import os\n\n\ndef ", "class Parser:\n    def __init__(self", "for i in range("]


def main() -> int:
    sys.path.insert(0, str(REPO))
    from maxpar.tools import records

    load_start = records.load_average()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help="run directory to sample from (default: train one first)")
    parser.add_argument("--steps", type=int, default=100, help="steps of the run trained when --run is not given")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="for training and sampling alike")
    records.add_record_option(parser)
    args = parser.parse_args()
    from maxpar.generate import generate
    from maxpar.io.run_config import load_run_config

    with tempfile.TemporaryDirectory() as tmp:
        run = args.run
        if run is None:
            run = Path(tmp) / "run"
            command = [sys.executable, "-m", "maxpar.train", "configs/base.yml", f"base_output_directory={tmp}",
                       "run_name=run", f"steps={args.steps}", *args.overrides]
            print("training:", " ".join(command), flush=True)
            if subprocess.run(command, cwd=REPO).returncode != 0:
                print("FAIL: the training run failed")
                return 1
        config = load_run_config([str(REPO / "configs/base.yml"), f"load_parameters_path={run}", "max_new_tokens=64",
                                  *args.overrides]).config  # the run's model comes with its checkpoint
        texts, result = generate(config, PROMPTS)
    for prompt, text in zip(PROMPTS, texts):
        print(f"--- {prompt!r} ->\n{prompt}{text}\n")
    load = os.getloadavg()
    print(f"prefill {result.prefill_tokens_per_s:,.0f} tokens/s, decode {result.decode_tokens_per_s:,.1f} tokens/s "
          f"({len(PROMPTS)} rows, 1 process; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})")
    if args.record:
        figures = {"prefill_tokens_per_s": result.prefill_tokens_per_s,
                   "decode_tokens_per_s": result.decode_tokens_per_s, "rows": len(PROMPTS),
                   "new_tokens": sum(map(len, result.tokens))}
        print("record:", records.write_record(args.record, "generate", ["python", "end_to_end/generate.py",
                                                                        *sys.argv[1:]], figures, load_start))
    if all(texts):  # whitespace counts: an undertrained byte model writes plenty of it
        print(f"PASS: {len(texts)} prompts continued ({sum(map(len, result.tokens))} new tokens)")
        return 0
    print("FAIL: a continuation decoded to no text")
    return 1


if __name__ == "__main__":
    exit_with(main)
