"""`python -m maxpar.bench`: compile time, step time, tokens/s and peak memory per strategy.

One fixed tiny model and one global batch (8 rows x 256 tokens) for every
strategy, so that the rows compare parallelism layouts and nothing else. Each
strategy runs in a fresh subprocess (`--worker NAME`) because the simulated
CPU device count lives in XLA_FLAGS, which JAX reads once when it starts; the
worker prints one JSON line and the parent prints the table. The worker uses
the real trainer pieces (config, mesh, sharded state, jitted step, the data
pipeline and global-batch assembly of `maxpar.train`), never a copy of them.
Numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BASE_CONFIG = REPO / "configs" / "base.yml"
RESULT_PREFIX = "BENCH_RESULT "
DEFAULT_STRATEGIES = ("one", "fsdp8", "dp2_fsdp2_tp2")
GLOBAL_ROWS = 8

# The benchmark model: small enough for a 2-core CPU, big enough that matmuls dominate.
MODEL = dict(model_name="", num_decoder_layers=4, emb_dim=256, num_query_heads=4, num_kv_heads=4, head_dim=64,
             mlp_dim=1024, vocab_size=4096, max_target_length=256)
# No checkpoints, synthetic data, and no mesh default (-1) left for the strategy to fight with.
RUN = dict(dataset_type="synthetic", enable_checkpointing=False, eval_interval=-1, ici_fsdp_parallelism=1)

# MaxText on a comparable 2-core CPU, same model and 2,048 tokens/step (seconds per step).
MAXTEXT_REFERENCE_S = {"one": 0.80, "fsdp8": 0.32}

# Strategy names are `one` or `_`-joined degrees such as dp2_fsdp2_tp2.
AXIS_KEYS = {"dp": "ici_data_parallelism", "fsdp": "ici_fsdp_parallelism", "tp": "ici_tensor_parallelism",
             "ep": "ici_expert_parallelism"}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
REMAT_WARNING = "Involuntary full rematerialization"


# ---------------------------------------------------------------- strategies and overrides

def strategy_degrees(name: str) -> dict[str, int]:
    """`dp2_fsdp2_tp2` -> {ici_data_parallelism: 2, ...}; `one` -> {} (a single device)."""
    if name == "one":
        return {}
    degrees: dict[str, int] = {}
    for part in name.split("_"):
        match = re.fullmatch(r"(dp|fsdp|tp|ep)(\d+)", part)
        if not match or int(match[2]) < 1:
            raise ValueError(f"strategy {name!r}: {part!r} is not one of dp<N>, fsdp<N>, tp<N>, ep<N> (or use 'one')")
        degrees[AXIS_KEYS[match[1]]] = int(match[2])
    return degrees


def strategy_devices(name: str) -> int:
    """Simulated devices a strategy needs: the product of its degrees."""
    return math.prod(strategy_degrees(name).values())


def config_overrides(name: str, extra: Sequence[str]) -> list[str]:
    """key=value list: benchmark model, run settings, the strategy's degrees, then the user's --set."""
    devices = strategy_devices(name)
    values: dict[str, Any] = {**MODEL, **RUN, **strategy_degrees(name),
                              "per_device_batch_size": GLOBAL_ROWS / devices}
    return [f"{key}={json.dumps(value)}" for key, value in values.items()] + list(extra)


def worker_env(devices: int) -> dict[str, str]:
    """The parent's environment with exactly `devices` simulated CPU devices (other XLA flags kept)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


# ---------------------------------------------------------------- worker (one strategy, one process)

def collective_counts(hlo_text: str) -> dict[str, int]:
    """Collective ops in compiled HLO: the communication the partitioner actually inserted."""
    counts = {op: len(re.findall(rf"^\s*(?:ROOT )?%\S+ = .* {op}(?:-start)?\(", hlo_text, re.M)) for op in COLLECTIVES}
    return {op: n for op, n in counts.items() if n}


def peak_rss_mib() -> float:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_worker(name: str, steps: int, warmup: int, extra: Sequence[str]) -> dict[str, Any]:
    """Build the real trainer pieces for one strategy, compile, and time `steps` steps after `warmup`."""
    import jax

    from maxpar.config import load_config
    from maxpar.mesh import mesh_shape_of
    from maxpar.metrics import parameter_counts, training_flops_per_token
    from maxpar.train import global_batch, setup_run
    from maxpar.train_step import create_state

    overrides = config_overrides(name, extra) + [f"steps={warmup + steps}"]
    config = load_config([str(BASE_CONFIG), *overrides])
    devices = jax.devices()
    if len(devices) != strategy_devices(name):
        raise RuntimeError(f"{name}: expected {strategy_devices(name)} devices, JAX sees {len(devices)}")

    run = setup_run(config, devices)
    mesh, shape, abstract = run.mesh, run.shape, run.abstract_state
    state = create_state(run.model, run.tx, config, mesh, run.state_shardings)
    start = time.perf_counter()
    compiled = run.compile_train_step()
    compile_s = time.perf_counter() - start

    # Batches are assembled before timing: the step, not the synthetic data, is under test.
    iterator = iter(run.train_data)
    times, cpu_times, losses = [], [], []
    for _ in range(warmup + steps):
        batch = global_batch(next(iterator), run.in_sharding)
        jax.block_until_ready(batch)
        start, cpu_start = time.perf_counter(), time.process_time()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        losses.append(float(metrics["loss"]))

    step_s = statistics.median(times[warmup:])
    return {
        "strategy": name,
        "mesh": mesh_shape_of(mesh, config).describe(),
        "devices": len(devices),
        "parameters": parameter_counts(abstract.params)["total"],
        "tokens_per_step": shape.tokens_per_step,
        "compile_s": compile_s,
        "step_s": step_s,
        "step_s_min": min(times[warmup:]),
        "step_s_max": max(times[warmup:]),
        # CPU seconds per step (all threads): less sensitive than wall time to other load on a shared machine.
        "cpu_s": statistics.median(cpu_times[warmup:]),
        "load_avg_1m": os.getloadavg()[0],
        "tokens_per_s": shape.tokens_per_step / step_s,
        "gflops_per_s": shape.tokens_per_step * training_flops_per_token(config) / step_s / 1e9,
        "peak_rss_mib": peak_rss_mib(),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "collectives": collective_counts(compiled.as_text()),
    }


# ---------------------------------------------------------------- parent (spawn workers, print the table)

def spawn(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one strategy in a fresh Python with its device count; its JSON line, or an error row."""
    command = [sys.executable, "-m", "maxpar.bench", "--worker", name, "--steps", str(args.steps),
               "--warmup", str(args.warmup)] + [f"--set={item}" for item in args.set]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=worker_env(strategy_devices(name)), cwd=REPO, capture_output=True,
                              text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"strategy": name, "error": f"timed out after {args.timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode or not lines:
        tail = [line.strip() for line in (done.stderr or done.stdout).strip().splitlines()[-3:]]
        return {"strategy": name, "error": f"exit {done.returncode}: " + " / ".join(tail)}
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    result["remat_warnings"] = done.stderr.count(REMAT_WARNING)
    result["wall_s"] = time.perf_counter() - start
    return result


def reference_columns(result: dict[str, Any]) -> tuple[str, str]:
    """(MaxText s/step, ours/MaxText) where a reference exists; ratio < 1 means we are faster."""
    ref = MAXTEXT_REFERENCE_S.get(result["strategy"])
    if ref is None or "step_s" not in result:
        return "", ""
    return f"{ref:.2f}", f"{result['step_s'] / ref:.2f}"


def markdown_table(results: Sequence[dict[str, Any]], header: str) -> str:
    """The results as a Markdown table (also what the terminal shows)."""
    columns = ["strategy", "mesh", "compile s", "step s (median)", "CPU s/step", "tokens/s", "peak RSS MiB",
               "MaxText s/step", "ours/MaxText", "final loss", "collectives"]
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in results:
        if "error" in r:
            error = r["error"].replace("|", "\\|")
            lines.append(f"| {r['strategy']} | error: {error} |" + " |" * (len(columns) - 2))
            continue
        collectives = ", ".join(f"{op} {n}" for op, n in r["collectives"].items()) or "none"
        if r.get("remat_warnings"):
            collectives += f"; {r['remat_warnings']} involuntary remat warning(s)"
        cells = [r["strategy"], r["mesh"], f"{r['compile_s']:.1f}", f"{r['step_s']:.3f}",
                 f"{r['cpu_s']:.2f}", f"{r['tokens_per_s']:,.0f}", f"{r['peak_rss_mib']:,.0f}", *reference_columns(r),
                 f"{r['final_loss']:.4f}", collectives]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def describe_run(args: argparse.Namespace) -> str:
    """One line naming what was measured, so a saved table stands on its own."""
    model = ", ".join(f"{k}={v}" for k, v in MODEL.items() if k != "model_name")
    extra = f"; overrides {' '.join(args.set)}" if args.set else ""
    flags = os.environ.get("XLA_FLAGS", "").strip()
    return (f"maxpar bench: {model}; {GLOBAL_ROWS} rows x {MODEL['max_target_length']} tokens/step; "
            f"median of {args.steps} steps after {args.warmup} warm-up; {os.cpu_count()} CPU cores, "
            f"load average {os.getloadavg()[0]:.1f} at start{extra}{'; XLA_FLAGS ' + flags if flags else ''}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maxpar.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                        help="comma-separated: one, or _-joined degrees such as fsdp8, dp2_fsdp2_tp2, dp8, fsdp4_tp2")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per strategy")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every strategy (repeatable)")
    parser.add_argument("--out", type=Path, help="write bench.md and bench.json here")
    parser.add_argument("--timeout", type=int, default=300, help="seconds allowed per strategy")
    parser.add_argument("--worker", metavar="STRATEGY", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")

    if args.worker:
        result = run_worker(args.worker, args.steps, args.warmup, args.set)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 0

    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    try:
        for name in names:
            strategy_devices(name)
    except ValueError as e:
        parser.error(str(e))
    if os.getloadavg()[0] > (os.cpu_count() or 1):
        print(f"maxpar bench: warning: load average {os.getloadavg()[0]:.1f} exceeds {os.cpu_count()} cores; "
              f"other processes will inflate the step times", file=sys.stderr)
    run = describe_run(args)
    results = []
    for name in names:
        print(f"maxpar bench: {name} on {strategy_devices(name)} simulated device(s) ...", file=sys.stderr, flush=True)
        results.append(spawn(name, args))
    table = markdown_table(results, run)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench.md").write_text(table, encoding="utf-8")
        (args.out / "bench.json").write_text(json.dumps({"run": run, "results": results}, indent=2),
                                             encoding="utf-8")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
