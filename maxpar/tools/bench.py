"""`python -m maxpar.tools.bench`: compile time, step time, tokens/s and peak memory per strategy.

Default (CPU) mode: one fixed small model and one global batch (8 rows x 256
tokens) for every parallelism strategy on simulated CPU devices, so that the
rows compare layouts and nothing else. `--gpu` mode: the ~1B Llama of
`maxpar.tools.bench_gpu` on one GPU, one row per lever setting (remat, batch,
attention implementation, XLA flags), with MFU.

Each row runs in a fresh subprocess (`--worker NAME`) because XLA_FLAGS (the
simulated device count, the XLA flag levers) are read once when JAX starts,
and so that every row starts with empty device memory; the worker prints one
JSON line and the parent prints the table and writes bench.md, bench.json and
bench.png into --out (and, with --record DIR, a `maxpar.tools.records` record).
The worker uses the real trainer pieces (config, mesh, sharded state, jitted
step, the data pipeline and global-batch assembly of `maxpar.train`), never a
copy of them. Numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from maxpar.host.devices import with_device_count
from maxpar.tools import bench_gpu, records
from maxpar.tools.bench_report import CPU_COLUMNS, GPU_COLUMNS, markdown_table, not_measured, write_chart

REPO = Path(__file__).resolve().parents[2]
BASE_CONFIG = REPO / "configs" / "base.yml"
RESULT_PREFIX = "BENCH_RESULT "
DEFAULT_STRATEGIES = ("one", "fsdp8", "dp2_fsdp2_tp2")
GLOBAL_ROWS = 8

# The benchmark model: small enough for a 2-core CPU, big enough that matmuls dominate.
MODEL = dict(model_name="", num_decoder_layers=4, emb_dim=256, num_query_heads=4, num_kv_heads=4, head_dim=64,
             mlp_dim=1024, vocab_size=4096, max_target_length=256)
# No checkpoints, synthetic data, and no mesh default (-1) left for the strategy to fight with.
RUN = dict(dataset_type="synthetic", enable_checkpointing=False, eval_interval=-1, ici_fsdp_parallelism=1)

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


def cpu_env(devices: int) -> dict[str, str]:
    """The parent's environment with exactly `devices` simulated CPU devices (other XLA flags kept)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), devices)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env



@dataclasses.dataclass(frozen=True)
class Case:
    """One row: its name, the complete config overrides, the devices it runs on, its process environment."""

    name: str
    overrides: tuple[str, ...]
    devices: int
    env: dict[str, str]


def strategy_case(name: str, extra: Sequence[str]) -> Case:
    """A CPU row: the benchmark model under one parallelism strategy on simulated devices."""
    devices = strategy_devices(name)
    return Case(name, tuple(config_overrides(name, extra)), devices, cpu_env(devices))


def setting_case(setting: str, extra: Sequence[str], smoke: bool) -> Case:
    """A GPU row: the 1B model (or the smoke shape) with one lever setting, on one device."""
    env = bench_gpu.setting_env(setting, dict(os.environ))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return Case(setting, tuple(bench_gpu.setting_overrides(setting, smoke) + list(extra)), 1, env)


# ---------------------------------------------------------------- worker (one row, one process)

def collective_counts(hlo_text: str) -> dict[str, int]:
    """Collective ops in compiled HLO: the communication the partitioner actually inserted."""
    counts = {op: len(re.findall(rf"^\s*(?:ROOT )?%\S+ = .* {op}(?:-start)?\(", hlo_text, re.M)) for op in COLLECTIVES}
    return {op: n for op, n in counts.items() if n}


def peak_rss_mib() -> float:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_device_gib(device: Any) -> float | None:
    """Peak bytes the allocator handed out on `device` (GPU/TPU), in GiB; None where not reported (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    peak = (stats or {}).get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def is_out_of_memory(error: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(error) or "out of memory" in str(error).lower()


def time_steps(compiled: Any, state: Any, run: Any, count: int) -> tuple[list[float], list[float], list[float]]:
    """Wall seconds, CPU seconds (all threads) and loss of `count` steps of a compiled train step.

    Batches are assembled before the clock starts: the step, not the data pipeline, is under test.
    """
    import jax

    from maxpar.train import global_batch

    iterator = iter(run.train_data)
    times, cpu_times, losses = [], [], []
    for _ in range(count):
        batch = global_batch(next(iterator), run.in_sharding)
        jax.block_until_ready(batch)
        start, cpu_start = time.perf_counter(), time.process_time()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        losses.append(float(metrics["loss"]))
    return times, cpu_times, losses


def device_program_mib(compiled) -> float | None:
    """MiB one device's compiled step asks for: its arguments plus temporaries (None where XLA does not say)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return (analysis.argument_size_in_bytes + analysis.temp_size_in_bytes) / 2**20


def run_worker(name: str, overrides: Sequence[str], num_devices: int, steps: int, warmup: int) -> dict[str, Any]:
    """Build the real trainer pieces for one row, compile, and time `steps` steps after `warmup`.

    A config this machine refuses (ConfigError, e.g. cuDNN attention without a GPU) or a row that
    does not fit in device memory is a result too (`refused` / `out_of_memory`), not a crash.
    """
    import jax

    from maxpar.core.config import ConfigError, load_config
    from maxpar.io.metrics import peak_flops, throughput
    from maxpar.model.arithmetic import parameter_counts
    from maxpar.host import malloc
    from maxpar.train import setup_run
    from maxpar.training.train_step import create_state, lower_train_step

    devices = jax.devices()[:num_devices]
    if len(devices) != num_devices:
        raise RuntimeError(f"{name}: needs {num_devices} devices, JAX sees {len(jax.devices())}")
    try:
        config = load_config([str(BASE_CONFIG), *overrides, f"steps={warmup + steps}"])
        malloc.tune(config.cpu_malloc_tuning, jax.default_backend())  # as the trainer's process does
        run = setup_run(config, devices)
        state = create_state(run.model, run.tx, run.layout, run.mesh)
        start = time.perf_counter()
        lowered = lower_train_step(run.model, run.tx, run.layout, run.mesh)
        compiled = lowered.compile()
        compile_s = time.perf_counter() - start

        times, cpu_times, losses = time_steps(compiled, state, run, warmup + steps)
    except ConfigError as e:
        return {"name": name, "refused": str(e)}
    except jax.errors.JaxRuntimeError as e:
        if not is_out_of_memory(e):
            raise
        return {"name": name, "out_of_memory": str(e).splitlines()[0][:300]}

    step_s = statistics.median(times[warmup:])
    rates = throughput(config, tokens_per_step=run.shape.tokens_per_step, step_time_s=step_s,
                       num_devices=len(devices), peak=peak_flops(devices[0].device_kind, config.peak_flops_per_device))
    return {
        "name": name,
        "device_kind": devices[0].device_kind,
        "mesh": run.layout.mesh.describe(),
        "devices": len(devices),
        "parameters": parameter_counts(run.abstract_state.params)["total"],
        "tokens_per_step": run.shape.tokens_per_step,
        "compile_s": compile_s,
        "step_s": step_s,
        "step_s_min": min(times[warmup:]),
        "step_s_max": max(times[warmup:]),
        # CPU seconds per step (all threads): less sensitive than wall time to other load on a shared machine.
        "cpu_s": statistics.median(cpu_times[warmup:]),
        "load_avg_1m": os.getloadavg()[0],
        "tokens_per_s": rates["tokens_per_s"],
        "tflops_per_device": rates["tflops_per_device"],
        "gflops_per_s": rates["tflops_per_device"] * len(devices) * 1e3,
        "mfu": rates["mfu"],
        "peak_rss_mib": peak_rss_mib(),
        "peak_device_gib": peak_device_gib(devices[0]),
        # XLA's buffer assignment of one device's program (arguments + temporaries): per device even when all the
        # simulated devices share one process's RSS.
        "device_program_mib": device_program_mib(compiled),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "collectives": collective_counts(compiled.as_text()),
        # quantization=fp8: whether its dots became cuBLASLt fp8 GEMMs (maxpar.tools.bench_gpu.fp8_counts)
        **(bench_gpu.fp8_counts(lowered.as_text(), compiled.as_text()) if config.quantization else {}),
    }


# ---------------------------------------------------------------- parent (spawn workers, print the table)

def spawn(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """Run one row in a fresh Python; its JSON line, or an error row."""
    command = [sys.executable, "-m", "maxpar.tools.bench", "--worker", case.name, "--devices", str(case.devices),
               "--steps", str(args.steps), "--warmup", str(args.warmup)] + [f"--set={item}" for item in case.overrides]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=case.env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"name": case.name, "error": f"timed out after {args.timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode or not lines:
        tail = [line.strip() for line in (done.stderr or done.stdout).strip().splitlines()[-3:]]
        return {"name": case.name, "error": f"exit {done.returncode}: " + " / ".join(tail)}
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    result["remat_warnings"] = done.stderr.count(REMAT_WARNING)
    result["wall_s"] = time.perf_counter() - start
    return result


def describe_run(args: argparse.Namespace) -> str:
    """One line naming what was measured, so a saved table stands on its own."""
    extra = f"; overrides {' '.join(args.set)}" if args.set else ""
    flags = os.environ.get("XLA_FLAGS", "").strip()
    flags = f"; XLA_FLAGS {flags}" if flags else ""
    timing = f"median of {args.steps} steps after {args.warmup} warm-up"
    if args.gpu:
        return f"maxpar bench --gpu: {bench_gpu.describe_gpu_run(args.smoke)}; {timing}{extra}{flags}"
    model = ", ".join(f"{k}={v}" for k, v in MODEL.items() if k != "model_name")
    return (f"maxpar bench: {model}; {GLOBAL_ROWS} rows x {MODEL['max_target_length']} tokens/step; {timing}; "
            f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start{extra}{flags}")


def build_cases(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Case]:
    """The rows to run: strategies (CPU mode) or lever settings (--gpu); a bad name is a usage error."""
    try:
        if args.gpu:
            settings = args.setting or list(bench_gpu.DEFAULT_SETTINGS)
            return [setting_case(s.strip(), args.set, args.smoke) for s in settings]
        return [strategy_case(n.strip(), args.set) for n in args.strategies.split(",") if n.strip()]
    except ValueError as e:
        parser.error(str(e))


def write_outputs(out: Path, table: str, run: str, results: Sequence[dict[str, Any]]) -> list[str]:
    """bench.md, bench.json and bench.png; returns the names written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(table, encoding="utf-8")
    (out / "bench.json").write_text(json.dumps({"run": run, "results": results}, indent=2), encoding="utf-8")
    write_chart(results, out / "bench.png", run)
    return ["bench.md", "bench.json", "bench.png"]


def write_bench_record(directory: Path, argv: Sequence[str], run: str, results: Sequence[dict[str, Any]], gpu: bool,
                       load_start: Sequence[float]) -> Path:
    """The run as a record (`bench_gpu` or `bench_cpu`); a GPU record names the device its rows ran on."""
    accelerator = next((r["device_kind"] for r in results if "device_kind" in r), None) if gpu else None
    return records.write_record(directory, "bench_gpu" if gpu else "bench_cpu",
                                ["python", "-m", "maxpar.tools.bench", *argv], {"run": run, "rows": list(results)},
                                load_start, accelerator)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    load_start = records.load_average()
    parser = argparse.ArgumentParser(prog="python -m maxpar.tools.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                        help="CPU mode, comma-separated: one, or _-joined degrees such as fsdp8, dp2_fsdp2_tp2, dp8, "
                             "fsdp4_tp2")
    parser.add_argument("--gpu", action="store_true",
                        help="GPU mode: the ~1B Llama on one device, one row per lever setting, with MFU")
    parser.add_argument("--setting", action="append", default=[], metavar="LEVERS",
                        help="GPU mode row (repeatable; default: the built-in sweep): 'base' or comma-joined "
                             "key=value levers, e.g. attention=cudnn_flash_causal,remat_policy=full,xla=cublas")
    parser.add_argument("--smoke", action="store_true",
                        help="with --gpu: a tiny model, so the whole GPU path runs anywhere in seconds (no figures)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every row (repeatable)")
    parser.add_argument("--out", type=Path, help="write bench.md, bench.json and bench.png here "
                                                 "(default outputs/bench, or outputs/bench_gpu with --gpu)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per row")
    records.add_record_option(parser)
    parser.add_argument("--worker", metavar="NAME", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if (args.setting or args.smoke) and not args.gpu:
        parser.error("--setting and --smoke go with --gpu")
    if args.smoke and args.record:
        parser.error("--smoke measures nothing: it writes no --record")

    if args.worker:
        result = run_worker(args.worker, args.set, args.devices, args.steps, args.warmup)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 0

    cases = build_cases(args, parser)
    if os.getloadavg()[0] > (os.cpu_count() or 1):
        print(f"maxpar bench: warning: load average {os.getloadavg()[0]:.1f} exceeds {os.cpu_count()} cores; "
              f"other processes will inflate the step times", file=sys.stderr)
    run = describe_run(args)
    results = []
    for case in cases:
        print(f"maxpar bench: {case.name} on {case.devices} device(s) ...", file=sys.stderr, flush=True)
        results.append(spawn(case, args))
    table = markdown_table(results, run, GPU_COLUMNS if args.gpu else CPU_COLUMNS)
    print(table)
    out = args.out or REPO / "outputs" / ("bench_gpu" if args.gpu else "bench")
    written = write_outputs(out, table, run, results)
    print(f"maxpar bench: wrote {', '.join(str(out / name) for name in written)}")
    if args.record:
        print(f"maxpar bench: record {write_bench_record(args.record, argv, run, results, args.gpu, load_start)}")
    # Refused and out-of-memory rows are findings; a crash or a timeout is a failure.
    return 1 if any("error" in r for r in results) or all(not_measured(r) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
