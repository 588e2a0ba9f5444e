"""fp8 against bfloat16 and maxpar against MaxText on one GPU, in one script (issue 46).

    python end_to_end/bench_gpu_fp8.py [--bundle .gpu_bundle] [--models llama-1b,llama3.2-3b] [--systems maxpar,maxtext]
        [--precisions bf16,fp8] [--steps 6] [--warmup 2] [--budget 420] [--out DIR] [--record DIR] [--dry-run | --smoke]

For each model, the ~1B (configs/models/llama-1b.yml) and the ~3B (llama3.2-3b.yml), at sequence 2048, bfloat16
compute with float32 weights, synthetic data, cuDNN flash attention (causal), remat_policy=minimal and the rows
per step of ROWS, on the first GPU, with XLA_FLAGS --xla_gpu_enable_triton_gemm=false (the `cublas` lever of
`maxpar.tools.bench_gpu`) for both systems, interleaved (the system that goes first alternates by model):
maxpar bf16, MaxText bf16, maxpar fp8 (quantization=fp8, fp8_scaling=delayed: MaxText's recipe is delayed too),
MaxText fp8 (its quantization=fp8). A maxpar row is `python -m maxpar.tools.bench --worker` (the trainer's own
pieces, the step compiled ahead of time; median step after --warmup); it also counts, in its fp8 step, the dots on
fp8 operands of the lowered program, the cuBLASLt fp8 GEMMs (`__cublas$lt$matmul$f8`) of the compiled one and
the dots still on fp8 operands there (`maxpar.tools.bench_gpu.fp8_counts`). A MaxText row is MaxText's own
trainer (`python -m maxtext.trainers.pre_train.train`) from the bundle, with the same model written in MaxText's
keys, a fresh compilation cache, and its per-step "completed step" times. Every maxpar row is also planned
(`maxpar.plan`, the hardware profile of the device kind) and the predicted step set beside the measured one.

The machine reaches no package registry: `--bundle` is the folder end_to_end/gpu_bundle.sh makes (the wheels the
image lacks and MaxText); the script installs it (pip --no-index --target DIR/site) before it imports maxpar.
`--budget` bounds the whole run's seconds: a row that would start past it is skipped, and said so.

Without a GPU it plans every row, prints the commands it would run and says "no GPU" in one line (exit 2);
`--dry-run` also lowers each model's fp8 step on the CPU (attention=dot_product there) and counts its fp8 dots,
and checks the bundle (exit 0); `--smoke` runs every row end to end with a tiny model on whatever device there is
(the harness, not a measurement: no record). Figures are printed and recorded (`bench_gpu_fp8`), never asserted:
the verdict is PASS when every row ran, and the issue's targets (fp8 >= 1.3x bf16, bf16 MFU >= 50% on the ~3B,
maxpar >= MaxText in both precisions, the planner within 15%, a cuBLASLt fp8 GEMM for every quantized dot) are
reported on their own lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]
from verdict import exit_with  # end_to_end/verdict.py

REPO = prepare(devices=None)
CHILD_ENV = dict(os.environ)        # the rows' environment: the device as the machine has it
os.environ["JAX_PLATFORMS"] = "cpu"  # this process plans and lowers only: the GPU's memory stays the rows'

SEQUENCE = 2048
ROWS = {"llama-1b": 16, "llama3.2-3b": 8}   # per_device_batch_size: the H100 sweep's best rows/step, doubled for
                                            # the 1B on the H200's 141 GB (docs/performance.md, GPU levers)
REMAT = "minimal"                           # saves the projections' outputs (maxpar and MaxText alike)
XLA_FLAGS = "--xla_gpu_enable_triton_gemm=false"
QUANTIZED_PER_LAYER = 7                     # q, k, v, attention output, gate, up, down: a dense Llama layer
PRECISIONS = ("bf16", "fp8")
SYSTEMS = ("maxpar", "maxtext")
MAXPAR_PRECISION = {"bf16": [], "fp8": ["quantization=fp8", "fp8_scaling=delayed"]}
MAXTEXT_PRECISION = {"bf16": {}, "fp8": {"quantization": "fp8"}}
SMOKE = dict(num_decoder_layers=2, emb_dim=128, num_query_heads=4, num_kv_heads=4, head_dim=32, mlp_dim=352,
             vocab_size=512, max_target_length=128, per_device_batch_size=2)
TARGETS = {"fp8_speedup": 1.3, "bf16_mfu_3b": 0.50, "maxpar_over_maxtext": 1.0, "plan_error": 0.15}


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    precision: str
    system: str

    @property
    def name(self) -> str:
        return f"{self.system} {self.model} {self.precision}"


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the rows run on: the first device as a child process sees it, and the planner's profile for it."""

    platform: str
    device_kind: str
    hardware: str

    @property
    def gpu(self) -> bool:
        return self.platform == "gpu"


# ---------------------------------------------------------------- the bundle (wheels and MaxText)

@dataclasses.dataclass(frozen=True)
class Bundle:
    """The installed bundle: `site` for PYTHONPATH (None: no bundle), MaxText's base.yml (None: no MaxText)."""

    site: Path | None
    maxtext_config: Path | None
    note: str


def install_bundle(folder: Path) -> Bundle:
    """pip-install the bundle's wheels into folder/site (once) and find MaxText's base.yml in it (the wheel's, or a
    packed source tree's under folder/maxtext)."""
    wheels = sorted(glob.glob(str(folder / "wheels" / "*.whl")))
    if not wheels:
        return Bundle(None, None, f"no bundle at {folder} (end_to_end/gpu_bundle.sh {folder} makes it)")
    site, names = folder / "site", "\n".join(Path(w).name for w in wheels) + "\n"
    marker = site / ".installed"  # the wheels installed there: another list is installed afresh
    if not marker.exists() or marker.read_text() != names:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(site), *wheels], check=True, env=CHILD_ENV)
        marker.write_text(names)
    source = folder / "maxtext"
    config = next((p for p in (source / "maxtext" / "configs" / "base.yml", site / "maxtext" / "configs" / "base.yml")
                   if p.exists()), None)
    where = "none" if config is None else str(config.parent.parent.parent)
    return Bundle(site, config, f"{len(wheels)} wheels installed in {site}; MaxText from {where}")


def use_bundle(bundle: Bundle) -> bool:
    """Put the bundle on this process's path where the image lacks maxpar's own needs; whether it did."""
    if bundle.site is None or importlib.util.find_spec("omegaconf") is not None:
        return False
    sys.path.insert(0, str(bundle.site))
    return True


def child_env(paths: list[Path], smoke: bool) -> dict[str, str]:
    """A row's environment: the machine's own, these paths first on PYTHONPATH, the XLA flags (not with --smoke,
    which may run on a CPU) and a large GPU memory fraction (maxpar.tools.bench_gpu's)."""
    from maxpar.tools import bench_gpu

    env = dict(CHILD_ENV)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [env.get("PYTHONPATH", "")])])
    if not smoke:
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS", ""), XLA_FLAGS]))
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", bench_gpu.MEMORY_FRACTION)
    return env


# ---------------------------------------------------------------- what each row runs

def maxpar_overrides(model: str, precision: str, smoke: bool, gpu: bool = True) -> list[str]:
    """key=value list of a maxpar row (the same model as its MaxText row: `maxtext_keys`)."""
    values: dict[str, Any] = dict(model_name=model, max_target_length=SEQUENCE, per_device_batch_size=ROWS[model],
                                  dtype="bfloat16", weight_dtype="float32", remat_policy=REMAT, scan_layers=True,
                                  attention="cudnn_flash_causal" if gpu and not smoke else "dot_product",
                                  dataset_type="synthetic", enable_checkpointing=False, eval_interval=-1,
                                  ici_fsdp_parallelism=1, rope_scaling_type="")  # MaxText's llama2 block: plain RoPE
    values.update(SMOKE if smoke else {})
    return [f"{key}={json.dumps(value)}" for key, value in values.items()] + MAXPAR_PRECISION[precision]


def maxpar_config(model: str, precision: str, smoke: bool, gpu: bool = True) -> Any:
    from maxpar.core.config import load_config
    return load_config([str(REPO / "configs" / "base.yml"), *maxpar_overrides(model, precision, smoke, gpu)])


def maxtext_keys(config: Any, precision: str, smoke: bool, gpu: bool, steps: int) -> dict[str, Any]:
    """MaxText's key=value for the model and run of a maxpar config (its llama2 decoder block: RMSNorm, SwiGLU,
    RoPE, GQA; the output projection tied when the config ties it)."""
    return {"model_name": "default", "decoder_block": "llama2", "base_emb_dim": config.emb_dim,
            "base_num_query_heads": config.num_query_heads, "base_num_kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim, "base_mlp_dim": config.mlp_dim,
            "base_num_decoder_layers": config.num_decoder_layers, "vocab_size": config.vocab_size,
            "rope_max_timescale": int(config.rope_theta), "normalization_layer_epsilon": config.normalization_layer_epsilon,
            "logits_via_embedding": str(config.logits_via_embedding).lower(), "enable_dropout": "false",
            "max_target_length": config.max_target_length, "per_device_batch_size": config.per_device_batch_size,
            "dtype": "bfloat16", "weight_dtype": "float32", "remat_policy": config.remat_policy,
            "scan_layers": "true", "attention": "cudnn_flash_jax" if gpu and not smoke else "dot_product",
            "hardware": "gpu" if gpu else "cpu", "skip_jax_distributed_system": "true",
            "dataset_type": "synthetic", "enable_checkpointing": "false", "enable_tensorboard": "false",
            "steps": steps, **MAXTEXT_PRECISION[precision]}


def plan_step(config: Any, hardware: str) -> dict[str, Any]:
    """The planner's step time and MFU for the config on one device of the `hardware` profile."""
    from maxpar.plan.hardware import load_hardware
    from maxpar.plan.predict import Target, make_plan

    plan = make_plan(config, Target(load_hardware(hardware), 1, 1))
    return {"predicted_step_s": plan["step_time_s"], "predicted_mfu": plan["mfu"], "predicted_bound": plan["bound"]}


def probe_device() -> tuple[str, str]:
    """(platform, device kind) of the first device the rows will see, asked in a child process (this one stays off
    the GPU)."""
    code = "import jax; d = jax.devices()[0]; print(d.platform, '|', d.device_kind)"
    env = {**CHILD_ENV, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode:
        return "none", (done.stderr.strip().splitlines() or ["JAX did not start"])[-1]
    platform, kind = done.stdout.strip().splitlines()[-1].split(" | ")
    return platform, kind


def lowered_fp8_dots(model: str, smoke: bool) -> int:
    """The fp8 dots of the model's fp8 train step lowered on this process's CPU (attention=dot_product: the cuDNN
    core lowers on a GPU only; the projections are the same)."""
    import jax

    from maxpar.core.config import model_config
    from maxpar.core.mesh import build_mesh, local_mesh_shape
    from maxpar.model import Transformer
    from maxpar.tools.bench_gpu import f8_dots
    from maxpar.training.optimizer import make_optimizer
    from maxpar.training.train_step import lower_train_step, run_layout

    config = maxpar_config(model, "fp8", smoke, gpu=False)
    devices = jax.devices()[:1]
    layout = run_layout(config, local_mesh_shape(config, devices), check_batch=False)
    model_ = Transformer(model_config(config), layout.model)
    return f8_dots(lower_train_step(model_, make_optimizer(config), layout, build_mesh(layout.mesh, devices)).as_text())


# ---------------------------------------------------------------- running the rows

def run_maxpar(row: Row, args: argparse.Namespace, env: dict[str, str], timeout: float) -> dict[str, Any]:
    from maxpar.tools import bench

    case = bench.Case(row.name, tuple(maxpar_overrides(row.model, row.precision, args.smoke)), 1, env)
    options = argparse.Namespace(steps=args.steps, warmup=args.warmup, timeout=int(timeout))
    return bench.spawn(case, options)


def run_maxtext(row: Row, args: argparse.Namespace, env: dict[str, str], timeout: float, bundle: Bundle,
                scratch: Path, machine: Machine, log: list[str]) -> dict[str, Any]:
    from bench_maxtext import MAXTEXT_STEP, maxtext_compile_seconds, run_measured

    from maxpar.io.metrics import peak_flops, throughput

    config = maxpar_config(row.model, row.precision, args.smoke, machine.gpu)
    keys = {**maxtext_keys(config, row.precision, args.smoke, machine.gpu, args.warmup + args.steps),
            "run_name": row.name.replace(" ", "_"), "base_output_directory": scratch / "maxtext",
            # A fresh persistent compilation cache: no run may reuse another's compiled program.
            "jax_cache_dir": tempfile.mkdtemp(prefix="jax_cache_", dir=scratch)}
    command = [sys.executable, "-m", "maxtext.trainers.pre_train.train", str(bundle.maxtext_config),
               *[f"{key}={value}" for key, value in keys.items()]]
    code, output, _ = run_measured(command, {**env, "DECOUPLE_GCLOUD": "TRUE"}, scratch, int(timeout))
    log.append(f"==== {row.name} (exit {code})\n" + "\n".join(output.splitlines()[-60:]))
    steps = {int(m[1]): float(m[2]) for m in MAXTEXT_STEP.finditer(output)}
    times = [steps[k] for k in sorted(steps)][args.warmup:]
    if code or not times:
        return {"name": row.name, "error": f"exit {code}: " + " / ".join(output.strip().splitlines()[-3:])}
    step_s = statistics.median(times)
    tokens = config.per_device_batch_size * config.max_target_length
    # maxpar's FLOP count of the same model: the two systems' MFU compare like their tokens/s.
    rates = throughput(config, tokens_per_step=tokens, step_time_s=step_s, num_devices=1,
                       peak=peak_flops(machine.device_kind, config.peak_flops_per_device))
    return {"name": row.name, "tokens_per_step": tokens, "step_s": step_s, "step_s_min": min(times),
            "step_s_max": max(times), "compile_s": maxtext_compile_seconds(output), "load_avg_1m": os.getloadavg()[0],
            "tokens_per_s": rates["tokens_per_s"], "tflops_per_device": rates["tflops_per_device"], "mfu": rates["mfu"]}


def run_rows(rows: list[Row], args: argparse.Namespace, bundle: Bundle, bundled: bool, machine: Machine,
             plans: dict[str, dict[str, Any]], log: list[str]) -> list[dict[str, Any]]:
    """Every row in order, each within what is left of --budget (a row that would start past it is skipped).
    `bundled`: maxpar itself needs the bundle's site (the image lacks its imports)."""
    deadline = time.monotonic() + args.budget
    maxpar_env = child_env([REPO, *([bundle.site] if bundled else [])], args.smoke)
    maxtext_env = child_env([bundle.site] if bundle.site else [], args.smoke)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_gpu_fp8_") as tmp:
        for row in rows:
            left = deadline - time.monotonic()
            if left < args.min_row_s:
                results.append({"name": row.name, "skipped": f"{left:.0f} s of --budget left"})
                continue
            print(f"bench_gpu_fp8: {row.name} ({left:.0f} s of budget left) ...", file=sys.stderr, flush=True)
            start = time.monotonic()
            if row.system == "maxpar":
                result = run_maxpar(row, args, maxpar_env, min(args.timeout, left))
                result.update(plans.get(f"{row.model} {row.precision}", {}))
                if result.get("step_s") and result.get("predicted_step_s"):
                    result["measured_over_predicted"] = result["step_s"] / result["predicted_step_s"]
            elif bundle.maxtext_config is None:
                result = {"name": row.name, "error": f"no MaxText: {bundle.note}"}
            else:
                result = run_maxtext(row, args, maxtext_env, min(args.timeout, left), bundle, Path(tmp), machine, log)
            result.update(model=row.model, precision=row.precision, system=row.system,
                          row_wall_s=round(time.monotonic() - start, 1))
            results.append(result)
            print(f"bench_gpu_fp8: {row.name}: {summary_cell(result)}", file=sys.stderr, flush=True)
    return results


def interleaved(models: list[str], systems: list[str], precisions: list[str]) -> list[Row]:
    """Per model: bf16 then fp8, each system in turn; which system goes first alternates by model."""
    rows = []
    for i, model in enumerate(models):
        order = systems if i % 2 == 0 else systems[::-1]
        rows += [Row(model, precision, system) for precision in precisions for system in order]
    return rows


# ---------------------------------------------------------------- reading the results

def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def summary_cell(result: dict[str, Any]) -> str:
    for key in ("error", "skipped", "refused", "out_of_memory"):
        if key in result:
            return f"{key}: {result[key]}"
    return f"{fmt(result.get('tokens_per_s'), 0)} tokens/s, step {fmt(result.get('step_s'))} s"


def find(results: list[dict[str, Any]], model: str, precision: str, system: str) -> dict[str, Any]:
    return next((r for r in results if (r.get("model"), r.get("precision"), r.get("system")) == (model, precision,
                                                                                                system)), {})


def ratio(a: Any, b: Any) -> float | None:
    return a / b if a and b else None


def table(results: list[dict[str, Any]]) -> str:
    header = ["model", "precision", "system", "tokens/s", "step s", "MFU (bf16 peak)", "compile s", "peak GiB",
              "fp8 dots: lowered / cuBLASLt fp8 / left on f8", "planned step s", "measured / planned", "load 1m"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        fp8 = (f"{r['f8_dots_lowered']} / {r['fp8_gemms']} / {r['f8_dots_unrewritten']}"
               if "fp8_gemms" in r else "")
        measured = fmt(r.get("tokens_per_s"), 0) if r.get("tokens_per_s") else summary_cell(r)
        cells = [r.get("model"), r.get("precision"), r.get("system"), measured, fmt(r.get("step_s")),
                 f"{r['mfu']:.1%}" if r.get("mfu") else "", fmt(r.get("compile_s"), 1),
                 fmt(r.get("peak_device_gib"), 1), fp8, fmt(r.get("predicted_step_s")),
                 fmt(r.get("measured_over_predicted"), 2), fmt(r.get("load_avg_1m"), 2)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def targets(results: list[dict[str, Any]], models: list[str]) -> dict[str, Any]:
    """The issue's targets read off the rows: {figure: (value, target text or None)}."""
    out: dict[str, Any] = {}
    for model in models:
        for system in SYSTEMS:
            speedup = ratio(find(results, model, "fp8", system).get("tokens_per_s"),
                            find(results, model, "bf16", system).get("tokens_per_s"))
            out[f"{model} {system} fp8/bf16 tokens/s"] = (
                speedup, f">= {TARGETS['fp8_speedup']}" if system == "maxpar" else None)
        for precision in PRECISIONS:
            out[f"{model} {precision} maxpar/MaxText tokens/s"] = (ratio(
                find(results, model, precision, "maxpar").get("tokens_per_s"),
                find(results, model, precision, "maxtext").get("tokens_per_s")), f">= {TARGETS['maxpar_over_maxtext']}")
        mfu = find(results, model, "bf16", "maxpar").get("mfu")
        out[f"{model} maxpar bf16 MFU"] = (mfu, f">= {TARGETS['bf16_mfu_3b']:.0%}" if "3b" in model else None)
        fp8 = find(results, model, "fp8", "maxpar")
        if "fp8_gemms" in fp8:
            out[f"{model} cuBLASLt fp8 GEMMs, dots left on fp8"] = (
                (fp8["fp8_gemms"], fp8["f8_dots_unrewritten"]), f">= {3 * QUANTIZED_PER_LAYER}, 0")
    errors = [abs(r["measured_over_predicted"] - 1) for r in results if r.get("measured_over_predicted")]
    out["planner: worst |measured/planned step - 1|"] = (max(errors) if errors else None, f"<= {TARGETS['plan_error']}")
    return out


def print_targets(found: dict[str, Any]) -> None:
    print("targets:")
    for name, (value, target) in found.items():
        shown = f"{value:.1%}" if "MFU" in name and value else value if isinstance(value, tuple) else fmt(value, 2)
        print(f"  {name}: {shown}" + (f" (target {target})" if target else ""))


# ---------------------------------------------------------------- main

def dry_run(models: list[str], args: argparse.Namespace, bundle: Bundle) -> None:
    """What a CPU can do: the fp8 steps lowered and their fp8 dots counted, the bundle, each MaxText command."""
    for model in models:
        dots = lowered_fp8_dots(model, args.smoke)
        print(f"bench_gpu_fp8: {model} fp8 step lowered on the CPU: {dots} dots on fp8 operands "
              f"({dots / 3:g} quantized matmuls in the program, {QUANTIZED_PER_LAYER} per layer: 3 dots each)")
    print(f"bench_gpu_fp8: bundle: {bundle.note}")
    for model in models:
        config = maxpar_config(model, "fp8", args.smoke)
        keys = maxtext_keys(config, "fp8", args.smoke, True, args.warmup + args.steps)
        print(f"bench_gpu_fp8: MaxText {model} fp8: python -m maxtext.trainers.pre_train.train <MaxText base.yml> "
              + " ".join(f"{k}={v}" for k, v in keys.items()))


def main() -> int:
    from maxpar.tools import records

    load_start = records.load_average()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=REPO / ".gpu_bundle",
                        help="the folder end_to_end/gpu_bundle.sh made (wheels, MaxText)")
    parser.add_argument("--models", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of maxpar, maxtext")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated, of bf16, fp8")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of each row")
    parser.add_argument("--budget", type=float, default=420, help="seconds for all the rows together")
    parser.add_argument("--timeout", type=float, default=150, help="seconds for one row")
    parser.add_argument("--min-row-s", dest="min_row_s", type=float, default=45,
                        help="a row starts only with this many seconds of --budget left")
    parser.add_argument("--hardware", default="h200", help="the planner's profile where no GPU names its own")
    parser.add_argument("--out", type=Path, help="write bench_gpu_fp8.md, .json and the rows' logs here")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: plan, lower, check the bundle, exit 0")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, every row end to end on any device")
    records.add_record_option(parser)
    args = parser.parse_args()
    chosen = {}
    for option, known in (("models", tuple(ROWS)), ("systems", SYSTEMS), ("precisions", PRECISIONS)):
        chosen[option] = [v.strip() for v in getattr(args, option).split(",") if v.strip()]
        unknown = [v for v in chosen[option] if v not in known]
        if unknown or not chosen[option]:
            parser.error(f"--{option} {getattr(args, option)!r}: choose from {', '.join(known)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    models = chosen["models"]

    bundle = install_bundle(args.bundle)
    bundled = use_bundle(bundle)
    from maxpar.plan.hardware import hardware_for_device_kind

    platform, kind = probe_device()
    machine = Machine(platform, kind if platform == "gpu" else "",
                      (hardware_for_device_kind(kind) if platform == "gpu" else None) or args.hardware)
    plans = {f"{m} {p}": plan_step(maxpar_config(m, p, args.smoke, machine.gpu), machine.hardware)
             for m in models for p in chosen["precisions"]}
    for name, plan in plans.items():
        print(f"bench_gpu_fp8: planned {name} on one {machine.hardware}: step {plan['predicted_step_s']:.3f} s, "
              f"MFU {plan['predicted_mfu']:.1%} ({plan['predicted_bound']}-bound)")
    rows = interleaved(models, chosen["systems"], chosen["precisions"])
    if not machine.gpu and not args.smoke:
        if args.dry_run:
            dry_run(models, args, bundle)
            print(f"bench_gpu_fp8: {len(rows)} rows would run: " + ", ".join(r.name for r in rows))
            print("PASS: dry run (planned, lowered, bundle checked); the rows need a GPU")
            return 0
        print(f"no GPU: the first device is {platform} ({kind}); this benchmark runs on one GPU "
              f"(--dry-run: the CPU-possible parts, --smoke: a tiny model end to end)")
        return 2

    log: list[str] = []
    results = run_rows(rows, args, bundle, bundled, machine, plans, log)
    text = table(results)
    print(text)
    found = targets(results, models)
    print_targets(found)
    run = (f"bench_gpu_fp8: {kind}; sequence {SEQUENCE}, rows per step {ROWS}, remat {REMAT}, bf16 compute, "
           f"f32 weights, cuDNN flash attention, XLA_FLAGS {XLA_FLAGS}; median of {args.steps} steps after "
           f"{args.warmup}; {bundle.note}" + (" (smoke: tiny model, not a measurement)" if args.smoke else ""))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_gpu_fp8.md").write_text(run + "\n\n" + text + "\n", encoding="utf-8")
        (args.out / "bench_gpu_fp8.json").write_text(json.dumps({"run": run, "rows": results, "targets": found},
                                                                indent=1, default=str), encoding="utf-8")
        (args.out / "bench_gpu_fp8.log").write_text("\n".join(log) + "\n", encoding="utf-8")
    if args.record and not args.smoke:
        command = ["python", "end_to_end/bench_gpu_fp8.py", *sys.argv[1:]]
        path = records.write_record(args.record, "bench_gpu_fp8", command,
                                    {"run": run, "rows": results, "targets": found}, load_start,
                                    machine.device_kind or None)
        print(f"bench_gpu_fp8: record {path}")
    failed = [r["name"] for r in results if not r.get("tokens_per_s")]
    if failed:
        print(f"FAIL: {len(failed)} of {len(results)} rows measured nothing: {', '.join(failed)}")
        return 1
    print(f"PASS: all {len(results)} rows measured (the targets above are figures, not the verdict)")
    return 0


if __name__ == "__main__":
    exit_with(main)
