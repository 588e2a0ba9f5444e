"""Side-by-side benchmark: maxpar against MaxText on the same model, mesh, batch, remat policy and data.

    python end_to_end/bench_maxtext.py --maxtext_python /path/to/maxtext-venv/bin/python \
        [--meshes one,fsdp8,dp2_fsdp2_tp2] [--remat full,minimal] [--rounds 3] [--steps 10] [--warmup 2]

Both systems run through their own training entry points, each in a fresh process on simulated CPU
devices: `python -m maxpar.train configs/base.yml ...` and MaxText's
`python -m maxtext.trainers.pre_train.train <its base.yml> ...` (in the Python given by
--maxtext_python, typically its own Python 3.12 venv). The model is maxpar's benchmark model
(`maxpar.tools.bench.MODEL`: 4 layers, emb 256, 4 x 64 heads, MLP 1024, vocab 4096, sequence 256),
8 rows per step (2,048 tokens), synthetic data, bfloat16 compute with float32 weights, dot-product
attention, scanned layers, AdamW. The runs are interleaved round by round (which system goes first
alternates), and every MaxText run gets a fresh persistent-compilation-cache directory so that no run
reuses another's compiled program.

Figures per (mesh, remat policy), medians over rounds of each run's median steady-state step (the
first --warmup steps dropped): seconds per step as each trainer logs it (maxpar: metrics.jsonl with
log_period=1; MaxText: its "completed step: N, seconds: S" line; both read a step's metrics back after
the next step is dispatched), compile time (maxpar: its "compiled the train step in" line; MaxText: from
its log's timestamps, from "not restoring checkpoint" to the compiled program's memory report), peak RSS
of the process (os.wait4) and the 1-minute load average when the run started. The ratio is maxpar's step
time over MaxText's; the project's target is <= 0.83 (>= 1.2x MaxText's tokens/s).

Verdict: PASS when every run of both systems produced step times, FAIL otherwise. Whether the speed
target is met is reported on its own line: the figures decide, not the exit status. Without
--maxtext_python (or when MaxText is not importable there) it says how to get MaxText and prints SKIP.
The machine this runs on may be shared: read the load average next to every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]
from verdict import exit_with  # end_to_end/verdict.py

REPO = prepare(devices=None)  # each run is a child process with its own device count

from maxpar.tools import records  # noqa: E402
from maxpar.tools.bench import (BASE_CONFIG, GLOBAL_ROWS, MODEL, config_overrides, cpu_env,  # noqa: E402
                                strategy_degrees, strategy_devices)

TARGET_RATIO = 0.83  # maxpar step time / MaxText step time: >= 1.2x MaxText's tokens/s
HOW_TO_GET_MAXTEXT = """\
MaxText is not available. To run this benchmark, give it MaxText in its own Python >= 3.12 venv, made with
the Python behind this one (the same version as maxpar's):
    {base_python} -m venv ~/maxtext-venv
    ~/maxtext-venv/bin/pip install jax jaxlib flax optax orbax-checkpoint grain absl-py omegaconf pydantic \\
        ml-collections tensorboardx chex jaxtyping aqtp qwix pathwaysutils sentencepiece tiktoken numpy jinja2 \\
        tokamax huggingface_hub transformers drjax pillow sympy
    ~/maxtext-venv/bin/pip install --no-deps maxtext
(its own requirement files pull TPU/GPU/cloud stacks that a CPU run does not need; install the same JAX
version as maxpar's venv for a fair comparison), then
    python end_to_end/bench_maxtext.py --maxtext_python ~/maxtext-venv/bin/python"""

# MaxText's names for the benchmark model and run (maxpar's come from maxpar.tools.bench).
MAXTEXT_MODEL = dict(base_emb_dim=MODEL["emb_dim"], base_num_query_heads=MODEL["num_query_heads"],
                     base_num_kv_heads=MODEL["num_kv_heads"], head_dim=MODEL["head_dim"],
                     base_mlp_dim=MODEL["mlp_dim"], base_num_decoder_layers=MODEL["num_decoder_layers"],
                     vocab_size=MODEL["vocab_size"], max_target_length=MODEL["max_target_length"])
MAXTEXT_RUN = dict(hardware="cpu", skip_jax_distributed_system="true", dataset_type="synthetic",
                   enable_checkpointing="false", enable_tensorboard="false", dtype="bfloat16",
                   weight_dtype="float32", attention="dot_product", scan_layers="true", dcn_data_parallelism=1,
                   ici_fsdp_parallelism=1)
MAXTEXT_AXES = {"ici_data_parallelism": "ici_data_parallelism", "ici_fsdp_parallelism": "ici_fsdp_parallelism",
                "ici_tensor_parallelism": "ici_tensor_parallelism"}
# Also maxpar's: the same dtypes and attention core, named explicitly so a base.yml change shows up here.
MAXPAR_RUN = ["dtype=bfloat16", "weight_dtype=float32", "attention=dot_product", "scan_layers=true",
              "log_period=1", "enable_checkpointing=false"]

MAXTEXT_STEP = re.compile(r"completed step: (\d+), seconds: ([0-9.]+)")
MAXTEXT_TIME = re.compile(r"^[IWE]\d{4} (\d\d:\d\d:\d\d\.\d+)")
MAXPAR_COMPILE = re.compile(r"compiled the train step in ([0-9.]+) s")


def maxtext_config(maxtext_python: str) -> Path | None:
    """MaxText's base.yml in that Python's install, or None if MaxText does not import there."""
    probe = "import maxtext, os; print(os.path.dirname(maxtext.__file__))"
    try:
        done = subprocess.run([maxtext_python, "-c", probe], capture_output=True, text=True, timeout=120,
                              cwd=tempfile.gettempdir())
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode:
        return None
    config = Path(done.stdout.strip().splitlines()[-1]) / "configs" / "base.yml"
    return config if config.exists() else None


def run_measured(command: list[str], env: dict[str, str], cwd: Path, timeout: int) -> tuple[int, str, float]:
    """(exit status, combined output, peak RSS MiB) of one process; os.wait4 gives that child's own peak."""
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                process.kill()
                pid, status, usage = os.wait4(process.pid, 0)
                status = 124 << 8
                break
            time.sleep(0.2)
        process.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        return process.returncode, log.read(), usage.ru_maxrss / 1024


def steady(times: list[float], warmup: int) -> float | None:
    kept = times[warmup:]
    return statistics.median(kept) if kept else None


def run_maxpar(mesh: str, remat: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    run_name = f"maxpar_{mesh}_{remat}"
    overrides = config_overrides(mesh, [*MAXPAR_RUN, f"remat_policy={remat}", f"steps={args.steps + args.warmup}",
                                        f"base_output_directory={scratch}", f"run_name={run_name}"])
    command = [sys.executable, "-m", "maxpar.train", str(BASE_CONFIG), *overrides]
    load = os.getloadavg()[0]
    code, output, rss = run_measured(command, cpu_env(strategy_devices(mesh)), REPO, args.timeout)
    metrics = scratch / run_name / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    compile_s = MAXPAR_COMPILE.search(output)
    result = {"system": "maxpar", "exit": code, "load_1m": load, "peak_rss_mib": rss,
              "step_s": steady([row["step_time_s"] for row in rows], args.warmup),
              "compile_s": float(compile_s[1]) if compile_s else None,
              "final_loss": rows[-1]["loss"] if rows else None}
    if code or result["step_s"] is None:
        result["error"] = output.strip().splitlines()[-3:]
    return result


def maxtext_compile_seconds(output: str) -> float | None:
    """Seconds from MaxText's 'not restoring checkpoint' line to its compiled program's memory report."""
    start = end = None
    for line in output.splitlines():
        stamp = MAXTEXT_TIME.match(line)
        if not stamp:
            continue
        if start is None and "restoring checkpoint" in line:
            start = stamp[1]
        elif start is not None and "[train] Total estimated memory size" in line:
            end = stamp[1]
            break
    if start is None or end is None:
        return None
    delta = datetime.strptime(end, "%H:%M:%S.%f") - datetime.strptime(start, "%H:%M:%S.%f")
    return delta.total_seconds() % 86400


def run_maxtext(mesh: str, remat: str, args: argparse.Namespace, config: Path, scratch: Path) -> dict[str, Any]:
    devices = strategy_devices(mesh)
    keys = {**MAXTEXT_MODEL, **MAXTEXT_RUN, **{MAXTEXT_AXES[k]: v for k, v in strategy_degrees(mesh).items()},
            "per_device_batch_size": GLOBAL_ROWS / devices, "remat_policy": remat,
            "steps": args.steps + args.warmup, "run_name": f"maxtext_{mesh}_{remat}",
            "base_output_directory": scratch / "maxtext_out",
            # A fresh persistent compilation cache: no run may reuse another's compiled program.
            "jax_cache_dir": tempfile.mkdtemp(prefix="jax_cache_", dir=scratch)}
    command = [args.maxtext_python, "-m", "maxtext.trainers.pre_train.train", str(config),
               *[f"{key}={value}" for key, value in keys.items()]]
    env = cpu_env(devices)
    env.pop("PYTHONPATH", None)  # MaxText's own install, not this repository
    load = os.getloadavg()[0]
    code, output, rss = run_measured(command, env, scratch, args.timeout)
    steps = {int(m[1]): float(m[2]) for m in MAXTEXT_STEP.finditer(output)}
    result = {"system": "maxtext", "exit": code, "load_1m": load, "peak_rss_mib": rss,
              "step_s": steady([steps[k] for k in sorted(steps)], args.warmup),
              "compile_s": maxtext_compile_seconds(output)}
    if code or result["step_s"] is None:
        result["error"] = output.strip().splitlines()[-3:]
    return result


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def summarize(results: dict[tuple[str, str], dict[str, list[dict[str, Any]]]]) -> tuple[str, list[dict[str, Any]]]:
    """The markdown table (one row per mesh and remat policy) and its rows as data."""
    lines = ["| mesh | remat | maxpar s/step | MaxText s/step | maxpar/MaxText | each round | tokens/s ratio | "
             "compile s (maxpar / MaxText) | peak RSS MiB (maxpar / MaxText) | load avg (1 min) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for (mesh, remat), by_system in results.items():
        ours, theirs = by_system["maxpar"], by_system["maxtext"]
        step_ours, step_theirs = median_of(ours, "step_s"), median_of(theirs, "step_s")
        ratio = step_ours / step_theirs if step_ours and step_theirs else None
        # The same ratio round by round: its spread is this machine's noise, next to the median it qualifies.
        each_round = [a["step_s"] / b["step_s"] if a["step_s"] and b["step_s"] else None for a, b in zip(ours, theirs)]
        load = median_of(ours + theirs, "load_1m")
        row = {"mesh": mesh, "remat": remat, "maxpar_step_s": step_ours, "maxtext_step_s": step_theirs,
               "ratio": ratio, "round_ratios": each_round, "maxpar_compile_s": median_of(ours, "compile_s"),
               "maxtext_compile_s": median_of(theirs, "compile_s"),
               "maxpar_peak_rss_mib": median_of(ours, "peak_rss_mib"),
               "maxtext_peak_rss_mib": median_of(theirs, "peak_rss_mib"), "load_1m": load,
               "maxpar_steps_s": [r["step_s"] for r in ours], "maxtext_steps_s": [r["step_s"] for r in theirs]}
        rows.append(row)
        rounds, tokens = " / ".join(fmt(r, 2) for r in each_round), f"{1 / ratio:.2f}x" if ratio else "n/a"
        lines.append(f"| {mesh} | {remat} | {fmt(step_ours)} | {fmt(step_theirs)} | {fmt(ratio, 2)} | {rounds} | "
                     f"{tokens} | {fmt(row['maxpar_compile_s'], 1)} / "
                     f"{fmt(row['maxtext_compile_s'], 1)} | {fmt(row['maxpar_peak_rss_mib'], 0)} / "
                     f"{fmt(row['maxtext_peak_rss_mib'], 0)} | {fmt(load, 2)} |")
    return "\n".join(lines), rows


def main() -> int:
    load_start = records.load_average()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maxtext_python", help="the Python (of a venv) where MaxText is installed")
    parser.add_argument("--meshes", default="one,fsdp8,dp2_fsdp2_tp2",
                        help="comma-separated: one, fsdp8, dp2_fsdp2_tp2 (or other dp/fsdp/tp degrees)")
    parser.add_argument("--remat", default="full,minimal", help="comma-separated remat policies (full, minimal)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (every case, both systems)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of each run")
    parser.add_argument("--timeout", type=int, default=900, help="seconds allowed per run")
    parser.add_argument("--out", type=Path, help="write bench_maxtext.md and bench_maxtext.json here")
    records.add_record_option(parser)
    args = parser.parse_args()
    config = maxtext_config(args.maxtext_python) if args.maxtext_python else None
    if config is None:
        where = f" ({args.maxtext_python} cannot import maxtext)" if args.maxtext_python else ""
        print(HOW_TO_GET_MAXTEXT.format(base_python=Path(sys.base_prefix) / "bin" / "python3"))
        print(f"SKIP: MaxText not available{where}; nothing was measured")
        return 0
    meshes = [m.strip() for m in args.meshes.split(",") if m.strip()]
    remats = [r.strip() for r in args.remat.split(",") if r.strip()]
    for mesh in meshes:
        strategy_degrees(mesh)  # a bad name fails here, before anything runs
        if set(strategy_degrees(mesh)) - set(MAXTEXT_AXES):
            parser.error(f"--meshes {mesh}: only dp/fsdp/tp degrees are compared")
    bad = [r for r in remats if r not in ("none", "minimal", "full")]
    if bad:
        parser.error(f"--remat {','.join(bad)}: valid policies are none, minimal, full")

    started = datetime.now().strftime("%Y-%m-%d %H:%M")
    print(f"bench_maxtext: {started}, {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f}; "
          f"MaxText from {config.parent.parent}; {args.rounds} rounds x {len(meshes) * len(remats)} cases x 2 systems",
          flush=True)
    results: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {
        (mesh, remat): {"maxpar": [], "maxtext": []} for mesh in meshes for remat in remats}
    with tempfile.TemporaryDirectory(prefix="bench_maxtext_") as tmp:
        for round_index in range(args.rounds):
            for case_index, (mesh, remat) in enumerate(results):
                order = ["maxpar", "maxtext"]
                if (round_index + case_index) % 2:
                    order.reverse()  # neither system always runs first (after the other's cache/memory state)
                for system in order:
                    scratch = Path(tempfile.mkdtemp(prefix=f"r{round_index}_{system}_", dir=tmp))
                    result = (run_maxpar(mesh, remat, args, scratch) if system == "maxpar"
                              else run_maxtext(mesh, remat, args, config, scratch))
                    results[(mesh, remat)][system].append(result)
                    print(f"  round {round_index + 1} {mesh:>14} remat={remat:<7} {system:<7} "
                          f"step {fmt(result['step_s'])} s  compile {fmt(result['compile_s'], 1)} s  "
                          f"RSS {fmt(result['peak_rss_mib'], 0)} MiB  load {result['load_1m']:.2f}"
                          + (f"  ERROR exit {result['exit']}: {' / '.join(result['error'])}"
                             if "error" in result else ""), flush=True)

    table, rows = summarize(results)
    described = (f"maxpar vs MaxText, {datetime.now():%Y-%m-%d}, {os.cpu_count()} CPU cores; model "
                 + ", ".join(f"{k}={v}" for k, v in MODEL.items() if k != "model_name")
                 + f"; {GLOBAL_ROWS} rows x {MODEL['max_target_length']} tokens/step, synthetic data, bfloat16 compute, "
                 f"float32 weights; medians of {args.rounds} interleaved rounds of each run's median of {args.steps} "
                 f"steps after {args.warmup}")
    print()
    print(described)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_maxtext.md").write_text(described + "\n\n" + table + "\n", encoding="utf-8")
        (args.out / "bench_maxtext.json").write_text(json.dumps({"run": described, "rows": rows, "runs": {
            f"{mesh}/{remat}": value for (mesh, remat), value in results.items()}}, indent=2, default=str))
    if args.record:
        figures = {"run": described, "target_ratio": TARGET_RATIO, "rounds": args.rounds, "steps": args.steps,
                   "warmup": args.warmup, "rows": rows}
        print("record:", records.write_record(args.record, "bench_maxtext",
                                              ["python", "end_to_end/bench_maxtext.py", *sys.argv[1:]], figures,
                                              load_start))

    met = [r for r in rows if r["ratio"] is not None and r["ratio"] <= TARGET_RATIO]
    missed = [f"{r['mesh']}/{r['remat']} {fmt(r['ratio'], 2)}" for r in rows if r not in met]
    print(f"target (maxpar step <= {TARGET_RATIO} x MaxText's, >= 1.2x tokens/s): met in {len(met)} of {len(rows)} "
          f"cases" + (f"; not met: {', '.join(missed)}" if missed else ""))
    failed = [f"{m}/{r} {s}" for (m, r), by_system in results.items() for s, runs in by_system.items()
              for run in runs if run["step_s"] is None]
    if failed:
        print(f"FAIL: runs without step times: {', '.join(failed)}")
        return 1
    print(f"PASS: both systems ran every case in {args.rounds} interleaved rounds (see the target line for speed)")
    return 0


if __name__ == "__main__":
    exit_with(main)
