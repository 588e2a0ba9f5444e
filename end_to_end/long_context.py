"""Long context (printed figures, not a timed test): dot_product vs blockwise attention, and context parallelism.

    python end_to_end/long_context.py [--lengths 4096,8192,16384,32768] [--memory-gib 12] [--timeout 600] [--warmup 1]

A tiny model (emb 64, 4 query / 2 kv heads of 16, 2 layers, float32, one row of synthetic
tokens) trained one warm-up step and one timed step per row, each row in its own Python
whose address space is capped at --memory-gib (resource.setrlimit): a row that does not fit
is a table row ("out of memory under the cap"), not a crash. Rows per sequence length:

- dot_product, 1 device: materializes [1, heads, seq, seq] float32 scores per layer (and keeps
  them for the backward pass): the seq^2 term;
- blockwise, 1 device (attention_block_size=512): O(seq x block) per head;
- blockwise CP=8 all_gather and CP=8 ring on 8 simulated CPU devices (per device: 1/8 of the
  sequence, per_device_batch_size=0.125 = the same one row), and CP=8 ring with unrolled layers
  (scan_layers=false) beside blockwise with unrolled layers, its 1-device reference.

Peak RSS is the whole process (all 8 simulated devices of a CP row share it, with the runtime's
baseline of every row); one device's program is XLA's buffer assignment for one device's
compiled step (its arguments and temporaries), the per-device figure of a CP row; step time is wall time on a possibly shared machine (the 1-minute load
average is printed with every row). Simulated CPU devices share the host's cores, so CP rows
show memory per device, not speed-up.

PASS when every blockwise and CP row ran, every CP row's first loss equals the 1-device blockwise
loss of its length and layer layout (rtol 1e-4), and blockwise's peak memory at the longest length that dot_product
fit is below dot_product's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]
from verdict import exit_with  # end_to_end/verdict.py

REPO = prepare(devices=None)  # each row is a child process that simulates its own device count
from maxpar.tools import records  # noqa: E402

PREFIX = "LONGCTX "
MODEL = ["model_name=", "emb_dim=64", "num_query_heads=4", "num_kv_heads=2", "head_dim=16", "mlp_dim=128",
         "num_decoder_layers=2", "vocab_size=264", "dtype=float32", "weight_dtype=float32", "dataset_type=synthetic",
         "enable_checkpointing=false", "eval_interval=-1", "log_period=1", "attention_block_size=512"]
ROWS = {
    "dot_product": (1, ["attention=dot_product", "per_device_batch_size=1"]),
    "blockwise": (1, ["attention=blockwise", "per_device_batch_size=1"]),
    "cp8_all_gather": (8, ["attention=blockwise", "per_device_batch_size=0.125", "ici_context_parallelism=8",
                           "ici_fsdp_parallelism=1", "context_parallel_strategy=all_gather"]),
    "cp8_ring": (8, ["attention=blockwise", "per_device_batch_size=0.125", "ici_context_parallelism=8",
                     "ici_fsdp_parallelism=1", "context_parallel_strategy=ring"]),
    # XLA:CPU assigns ring attention far more temporaries inside the scanned layer stack (README). Unrolled layers
    # draw their initial parameters per layer (other random values), so this row has its own 1-device reference.
    "blockwise_unscanned": (1, ["attention=blockwise", "per_device_batch_size=1", "scan_layers=false"]),
    "cp8_ring_unscanned": (8, ["attention=blockwise", "per_device_batch_size=0.125", "ici_context_parallelism=8",
                               "ici_fsdp_parallelism=1", "context_parallel_strategy=ring", "scan_layers=false"]),
}


def worker(name: str, length: int, memory_gib: float, warmup: int) -> None:
    """One row in this process: cap the address space, then build, compile and time the trainer's step."""
    cap = int(memory_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    devices, overrides = ROWS[name]
    from maxpar.host.devices import simulate_cpu_devices
    simulate_cpu_devices(devices)
    from maxpar.tools.bench import run_worker

    result = run_worker(name, [*MODEL, f"max_target_length={length}", *overrides], devices, steps=1, warmup=warmup)
    print(PREFIX + json.dumps({**result, "length": length}), flush=True)


def spawn(name: str, length: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--worker", name, "--length", str(length), "--memory-gib",
               str(args.memory_gib), "--warmup", str(args.warmup)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"name": name, "length": length, "error": f"timed out after {args.timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    if lines:
        return {**json.loads(lines[-1][len(PREFIX):]), "wall_s": time.perf_counter() - start}
    text = done.stderr + done.stdout
    memory = any(word in text for word in ("RESOURCE_EXHAUSTED", "MemoryError", "bad_alloc", "Out of memory",
                                           "out of memory", "Cannot allocate memory"))
    if memory or done.returncode in (-9, -6, 134, 137):
        return {"name": name, "length": length, "out_of_memory": f"exit {done.returncode} under the "
                                                                 f"{args.memory_gib:g} GiB cap"}
    tail = " / ".join(line.strip() for line in text.strip().splitlines()[-3:])
    return {"name": name, "length": length, "error": f"exit {done.returncode}: {tail}"}


def row_text(row: dict) -> str:
    name, length = row["name"], row["length"]
    devices = ROWS[name][0]
    if "step_s" not in row:
        why = row.get("out_of_memory") or row.get("refused") or row.get("error")
        what = "out of memory" if "out_of_memory" in row else "not run"
        return f"| {length:,} | {name} | {devices} | {what}: {why} | | | | |"
    program = row.get("device_program_mib")
    return (f"| {length:,} | {name} | {devices} | {row['peak_rss_mib']:,.0f} | "
            f"{'' if program is None else f'{program:,.0f}'} | {row['step_s']:.2f} | {row['first_loss']:.6f} | "
            f"{row['load_avg_1m']:.1f} |")


def main() -> int:
    load_start = records.load_average()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384,32768")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--memory-gib", type=float, default=12.0)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed one (0: the timed "
                        "step is the first run of the compiled step)")
    parser.add_argument("--worker")
    parser.add_argument("--length", type=int)
    records.add_record_option(parser)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.length, args.memory_gib, args.warmup)
        return 0
    print(f"# long context: tiny model, one row, float32, block 512, cap {args.memory_gib:g} GiB per row; "
          f"load average at start {os.getloadavg()[0]:.1f} (shared, noisy machine)")
    print("| seq | attention | devices | peak RSS MiB (whole process) | one device's program MiB (XLA: arguments + "
          "temporaries) | step s | loss step 1 | load 1m |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        for name in args.rows.split(","):
            row = spawn(name, length, args)
            rows.append(row)
            print(row_text(row), flush=True)
    if args.record:
        print("record:", records.write_record(args.record, "long_context", ["python", "end_to_end/long_context.py",
                                                                            *sys.argv[1:]], {"rows": rows}, load_start))
    problems = []
    by = {(r["name"], r["length"]): r for r in rows}
    for row in rows:
        if row["name"] != "dot_product" and "step_s" not in row:
            problems.append(f"{row['name']} at {row['length']} did not run")
        base = by.get(("blockwise_unscanned" if row["name"].endswith("_unscanned") else "blockwise", row["length"]))
        if row["name"].startswith("cp8") and "step_s" in row and base and "step_s" in base:
            if abs(row["first_loss"] - base["first_loss"]) > 1e-4 * abs(base["first_loss"]):
                problems.append(f"{row['name']} at {row['length']}: loss {row['first_loss']} != {base['first_loss']}")
    fitted = [r["length"] for r in rows if r["name"] == "dot_product" and "step_s" in r]
    if fitted and ("blockwise", max(fitted)) in by and "step_s" in by[("blockwise", max(fitted))]:
        if by[("blockwise", max(fitted))]["peak_rss_mib"] >= by[("dot_product", max(fitted))]["peak_rss_mib"]:
            problems.append(f"blockwise is not smaller than dot_product at {max(fitted)}")
    if problems:
        print("FAIL: " + "; ".join(problems))
        return 1
    print(f"PASS: blockwise and CP rows ran at every length; CP losses equal 1-device blockwise; "
          f"dot_product fitted up to {max(fitted) if fitted else 'no length'}")
    return 0


if __name__ == "__main__":
    exit_with(main)
