"""Side by side with MaxText on the same compiler: both systems' train steps compiled by XLA:TPU (libtpu) for the
same TPU topology, model, batch, remat policy and attention, on this CPU machine; per-chip memory and the
compiler's estimated step in one record.

    MAXTEXT_SRC=/path/to/maxtext-src MAXTEXT_PYTHON=/path/to/maxtext-venv/bin/python \\
        python end_to_end/tpu_vs_maxtext.py [--cases llama3_8b_fsdp,mixtral_ep] [--record docs/results]

maxpar runs `python -m maxpar.train configs/base.yml ... compile_topology=NAME` (reading RUN/compile_report.json);
MaxText runs its own `python -m maxtext.trainers.pre_train.train_compile <its base.yml> ... compile_topology=NAME`
in MAXTEXT_PYTHON (Python >= 3.12 with MaxText's packages and libtpu; see docs/tpu.md) with MAXTEXT_SRC, the
folder holding its `maxtext` package (a source checkout's `src/` or the unpacked `maxtext` wheel), on its path,
and prints its `Cost analysis: {...}` and `Memory analysis: CompiledMemoryStats(...)` lines, which are read here.

Figures per case and system: arguments, temporaries, output, aliased and peak bytes per chip (XLA's buffer
assignment), FLOPs, bytes accessed and the cost model's estimated step ('optimal_seconds'), compile wall time.
Both compile scanned layers by default, whose cost analysis counts the layer loop's body once for both alike;
--unscanned compiles every layer (the whole step's estimate; much slower). The target: maxpar's estimated step and
peak memory at most MaxText's. Verdict PASS when both systems compiled every case; whether maxpar meets the target
is printed on its own line. Without MaxText it says how to get it and prints SKIP.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]
from verdict import exit_with  # end_to_end/verdict.py

REPO = prepare(devices=None)

from maxpar.tools import records  # noqa: E402

GIB = 2 ** 30
# Each case: the topology, then the same run in each system's keys.
CASES: dict[str, dict[str, Any]] = {
    "llama3_8b_fsdp": {
        "topology": "v5p-256",
        "what": "llama3-8b, FSDP over 128 v5p chips, 2 x 8192 tokens per chip, remat full, dot-product attention",
        "maxpar": ["model_name=llama3-8b", "per_device_batch_size=2", "max_target_length=8192", "remat_policy=full",
                   "attention=dot_product", "ici_fsdp_parallelism=-1", "dtype=bfloat16", "weight_dtype=float32"],
        "maxtext": ["model_name=llama3-8b", "per_device_batch_size=2", "max_target_length=8192", "remat_policy=full",
                    "attention=dot_product", "ici_fsdp_parallelism=-1", "dtype=bfloat16", "weight_dtype=float32"],
    },
    "mixtral_ep": {
        "topology": "v5p-64",
        "what": "Mixtral-8x7B-style MoE with 4 layers, EP(8) x FSDP(4) on 32 v5p chips, top-2 of 8 experts, "
                "dropless, 1 x 4096 tokens per chip, remat full, dot-product attention",
        "maxpar": ["model_name=mixtral-8x7b", "num_decoder_layers=4", "per_device_batch_size=1",
                   "max_target_length=4096", "remat_policy=full", "attention=dot_product", "ici_expert_parallelism=8",
                   "ici_fsdp_parallelism=4", "capacity_factor=0", "dtype=bfloat16", "weight_dtype=float32"],
        "maxtext": ["model_name=mixtral-8x7b", "override_model_config=true", "base_num_decoder_layers=4",
                    "per_device_batch_size=1", "max_target_length=4096", "remat_policy=full",
                    "attention=dot_product", "ici_expert_parallelism=8", "ici_fsdp_parallelism=4",
                    "capacity_factor=-1", "dtype=bfloat16", "weight_dtype=float32"],
    },
}
MAXTEXT_RUN = ["dataset_type=synthetic", "enable_checkpointing=false", "skip_jax_distributed_system=true",
               "compile_topology_num_slices=1"]
HOW_TO_GET_MAXTEXT = """\
MaxText is not available: set MAXTEXT_PYTHON to a Python >= 3.12 with MaxText's packages and libtpu, and
MAXTEXT_SRC to the folder holding its `maxtext` package (docs/tpu.md, "Side by side with MaxText")."""


def maxtext_base_yml(src: Path) -> Path | None:
    for candidate in (src / "maxtext" / "configs" / "base.yml", src / "src" / "maxtext" / "configs" / "base.yml"):
        if candidate.is_file():
            return candidate
    return None


def compile_maxpar(case: dict[str, Any], workdir: Path, scanned: bool) -> dict[str, Any]:
    run_name = f"maxpar-{case['topology']}"
    command = [sys.executable, "-m", "maxpar.train", str(REPO / "configs" / "base.yml"), *case["maxpar"],
               f"scan_layers={str(scanned).lower()}", "dataset_type=synthetic", f"compile_topology={case['topology']}",
               f"base_output_directory={workdir}", f"run_name={run_name}"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - start
    report_file = workdir / run_name / "compile_report.json"
    if not report_file.is_file():
        return {"error": (done.stdout + done.stderr)[-1500:], "command": command}
    report = json.loads(report_file.read_text())
    memory, cost = report["memory"], report["cost"] or {}
    return {"arguments": memory["arguments"], "temporaries": memory["temporaries"], "output": memory["output"],
            "aliased": memory["aliased"], "peak": report["peak_bytes"], "flops": cost.get("flops"),
            "bytes_accessed": cost.get("bytes_accessed"), "optimal_seconds": cost.get("seconds"),
            "compile_wall_s": wall, "exit_status": done.returncode, "mesh": report["mesh"]}


_MEMORY_FIELD = re.compile(r"(\w+)_in_bytes=(\d+)")


def parse_maxtext(output: str) -> dict[str, Any] | None:
    """MaxText's printed `Cost analysis: {...}` and `Memory analysis: CompiledMemoryStats(...)`."""
    cost_line = re.search(r"^Cost analysis: (\{.*\})$", output, re.M)
    memory_line = re.search(r"^Memory analysis: CompiledMemoryStats\((.*)\)$", output, re.M)
    if not (cost_line and memory_line):
        return None
    cost = ast.literal_eval(cost_line.group(1))
    if isinstance(cost, list):
        cost = cost[0]
    memory = {k: int(v) for k, v in _MEMORY_FIELD.findall(memory_line.group(1))}
    peak = memory["argument_size"] + memory["temp_size"] + memory["output_size"] - memory["alias_size"] \
        + memory["generated_code_size"]
    return {"arguments": memory["argument_size"], "temporaries": memory["temp_size"], "output": memory["output_size"],
            "aliased": memory["alias_size"], "peak": peak, "flops": cost.get("flops"),
            "bytes_accessed": cost.get("bytes accessed"), "optimal_seconds": cost.get("optimal_seconds")}


def compile_maxtext(case: dict[str, Any], python: str, src: Path, base_yml: Path, workdir: Path,
                    scanned: bool) -> dict[str, Any]:
    command = [python, "-m", "maxtext.trainers.pre_train.train_compile", str(base_yml), *case["maxtext"],
               *MAXTEXT_RUN, f"scan_layers={str(scanned).lower()}", f"compile_topology={case['topology']}",
               f"base_output_directory={workdir}", "run_name=maxtext", f"jax_cache_dir={workdir / 'jax_cache'}"]
    dump = workdir / "maxtext_hlo"  # its optimized train step, to read beside maxpar's RUN/train_step.hlo.txt
    env = {**os.environ, "PYTHONPATH": str(src), "DECOUPLE_GCLOUD": "TRUE", "JAX_PLATFORMS": "cpu",
           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_STDERR_LOG_LEVEL": "3", "TPU_MIN_LOG_LEVEL": "3",
           "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*"}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    (workdir / "maxtext_stdout.txt").write_text(done.stdout + done.stderr, encoding="utf-8")
    figures = parse_maxtext(done.stdout)
    if figures is None:
        return {"error": (done.stdout + done.stderr)[-1500:], "command": command}
    return {**figures, "compile_wall_s": wall, "exit_status": done.returncode}


def row(system: str, f: dict[str, Any]) -> list[str]:
    if "error" in f:
        return [system, "error", "", "", "", "", "", ""]
    return [system, f"{f['arguments'] / GIB:.2f}", f"{f['temporaries'] / GIB:.2f}", f"{f['peak'] / GIB:.2f}",
            f"{f['flops']:.3e}", f"{f['bytes_accessed']:.3e}", f"{f['optimal_seconds'] * 1e3:.1f}",
            f"{f['compile_wall_s']:.0f}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--unscanned", action="store_true", help="scan_layers=false in both (the whole step)")
    parser.add_argument("--workdir", help="keep both systems' outputs (reports, compiled HLO) here instead of a "
                                          "temporary directory")
    records.add_record_option(parser)
    args = parser.parse_args()
    src, python = os.environ.get("MAXTEXT_SRC"), os.environ.get("MAXTEXT_PYTHON")
    base_yml = maxtext_base_yml(Path(src)) if src else None
    if not (python and base_yml):
        print(HOW_TO_GET_MAXTEXT)
        print("SKIP: MaxText not available")
        return 0
    load_start = records.load_average()
    names = [n for n in args.cases.split(",") if n]
    figures: dict[str, Any] = {"scan_layers": not args.unscanned, "cases": {}}
    header = ["system", "args GiB", "temps GiB", "peak GiB", "FLOPs", "bytes", "est. step ms", "compile s"]
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="tpu-vs-maxtext-") as scratch:
        tmp = args.workdir or scratch
        for name in names:
            case = CASES[name]
            load = records.load_average()
            ours = compile_maxpar(case, Path(tmp) / name, not args.unscanned)
            theirs = compile_maxtext(case, python, Path(src), base_yml, Path(tmp) / name, not args.unscanned)
            figures["cases"][name] = {"what": case["what"], "topology": case["topology"], "maxpar": ours,
                                      "maxtext": theirs, "load_average_at_start": load}
            print(f"\n{name}: {case['what']} ({case['topology']}; load {load})")
            records.print_table(header, [row("maxpar", ours), row("MaxText", theirs)])
            if "error" in ours or "error" in theirs:
                for system, f in (("maxpar", ours), ("MaxText", theirs)):
                    if "error" in f:
                        print(f"  {system} did not compile: {f['error'][-600:]}")
                verdicts.append(None)
                continue
            faster = ours["optimal_seconds"] <= theirs["optimal_seconds"]
            smaller = ours["peak"] <= theirs["peak"]
            verdicts.append(faster and smaller)
            print(f"  maxpar / MaxText: estimated step {ours['optimal_seconds'] / theirs['optimal_seconds']:.3f}x, "
                  f"peak memory {ours['peak'] / theirs['peak']:.3f}x")
    if args.record:
        print("record:", records.write_record(args.record, "tpu_vs_maxtext", ["python", "end_to_end/tpu_vs_maxtext.py",
                                                                              *sys.argv[1:]], figures, load_start))
    compiled = all(v is not None for v in verdicts)
    print(f"target (maxpar's estimated step and peak memory at most MaxText's): "
          f"{'met' if compiled and all(verdicts) else 'not met'} in {sum(bool(v) for v in verdicts)} of {len(names)}")
    print("PASS: both systems compiled every case" if compiled else "FAIL: a case did not compile")
    return 0 if compiled else 1


if __name__ == "__main__":
    exit_with(main)
