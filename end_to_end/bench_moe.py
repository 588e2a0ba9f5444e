"""Benchmark: the tiny MoE at expert parallelism 1, 2, 4, 8 on 8 simulated CPU devices.

    python end_to_end/bench_moe.py [--ep 1 2 4 8] [--modes dropless capacity] [--steps 5] [key=value ...]

For each EP degree (the rest of the 8 devices is FSDP) and dispatch mode, builds the trainer's own run
(`maxpar.train.setup_run`, `compile_train_step`), times the step on one fixed global batch
(8 rows x 256 tokens, synthetic data, float32) and reads the all-to-all bytes per device per step from
the compiled HLO (`maxpar.plan.verify.measure`), next to the planner's prediction (`maxpar.plan`).
Prints one row per run, then PASS if every EP > 1 step moves tokens with all-to-all over the expert axis
(and EP = 1 with none), the measured bytes are within 10% of the prediction, and every EP degree trains
to the same losses as EP = 1 (rtol 1e-4); FAIL (non-zero exit) otherwise. Timings on a shared 2-core
machine are indicative only.
"""

from __future__ import annotations

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=8)

import argparse
import os
import statistics
import sys
import time


import jax
import numpy as np

from maxpar.core.config import load_config
from maxpar.model.arithmetic import parameter_counts
from maxpar.plan import verify
from maxpar.plan.hardware import load_hardware
from maxpar.plan.predict import Target, make_plan
from maxpar.tools import records
from maxpar.train import global_batch, setup_run
from maxpar.training.train_step import create_state

RUN = ["model_name=tiny-moe", "dataset_type=synthetic", "max_target_length=256", "per_device_batch_size=1",
       "dtype=float32", "enable_checkpointing=false", "eval_interval=-1"]
MODES = {"dropless": "capacity_factor=0", "capacity": "capacity_factor=1.25"}


def bench(ep: int, mode: str, steps: int, warmup: int, extra: list[str]) -> dict:
    config = load_config([str(REPO / "configs" / "base.yml"), *RUN, f"ici_expert_parallelism={ep}",
                          "ici_fsdp_parallelism=-1", MODES[mode], f"steps={steps + warmup}", *extra])
    run = setup_run(config, jax.devices())
    state = create_state(run.model, run.tx, run.layout, run.mesh)
    start = time.perf_counter()
    compiled = run.compile_train_step()
    compile_s = time.perf_counter() - start
    measured = [r for r in verify.measure(compiled.as_text(), dict(run.mesh.shape)) if r["collective"] == "all-to-all"]
    plan = make_plan(config, Target(load_hardware("tpu-v5p"), len(jax.devices()), 1))
    predicted = sum(verify.on_backend(c, "cpu")[1] for c in plan.collectives if c.collective == "all-to-all")

    iterator = iter(run.train_data)
    times, losses = [], []
    for _ in range(warmup + steps):
        batch = global_batch(next(iterator), run.in_sharding)
        jax.block_until_ready(batch)
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
        losses.append(float(metrics["loss"]))
    step_s = statistics.median(times[warmup:])
    return {"ep": ep, "mode": mode, "mesh": run.layout.mesh.describe(), "compile_s": compile_s,
            "step_s": step_s, "tokens_per_s": run.shape.tokens_per_step / step_s,
            "a2a_axes": sorted({r["axis"] for r in measured}), "a2a_bytes": sum(r["bytes"] for r in measured),
            "a2a_predicted": predicted, "losses": losses,
            "params": parameter_counts(run.abstract_state.params, config.num_experts_per_tok)}


def main() -> int:
    load_start = records.load_average()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    records.add_record_option(parser)
    args = parser.parse_args()
    rows = [bench(ep, mode, args.steps, args.warmup, args.overrides) for mode in args.modes for ep in args.ep]
    p = rows[0]["params"]
    print(f"tiny MoE: {p['total']:,} parameters, {p['active']:,} active per token; 8 rows x 256 tokens per step; "
          f"{len(jax.devices())} simulated {jax.devices()[0].platform} devices; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'mode':<9} {'EP':>2}  {'mesh':<18} {'compile':>8} {'step':>8} {'tokens/s':>9}  "
          f"{'all-to-all B/device/step':>24} {'predicted':>11}  final loss")
    failures = []
    for r in rows:
        print(f"{r['mode']:<9} {r['ep']:>2}  {r['mesh']:<18} {r['compile_s']:>7.1f}s {r['step_s'] * 1e3:>6.0f}ms "
              f"{r['tokens_per_s']:>9,.0f}  {r['a2a_bytes']:>24,.0f} {r['a2a_predicted']:>11,.0f}  "
              f"{r['losses'][-1]:.6f}")
        expected_axes = ["expert"] if r["ep"] > 1 else []
        if r["a2a_axes"] != expected_axes:
            failures.append(f"{r['mode']} EP={r['ep']}: all-to-all over {r['a2a_axes']}, expected {expected_axes}")
        if abs(r["a2a_bytes"] - r["a2a_predicted"]) > 0.1 * max(r["a2a_predicted"], 1.0):
            failures.append(f"{r['mode']} EP={r['ep']}: all-to-all {r['a2a_bytes']:,.0f} B, "
                            f"predicted {r['a2a_predicted']:,.0f} B")
        base = next(b for b in rows if b["mode"] == r["mode"] and b["ep"] == min(args.ep))
        if not np.allclose(r["losses"], base["losses"], rtol=1e-4):
            failures.append(f"{r['mode']} EP={r['ep']}: losses {r['losses']} differ from EP={base['ep']}'s")
    for failure in failures:
        print(f"  FAIL: {failure}")
    if args.record:
        print("record:", records.write_record(args.record, "bench_moe", ["python", "end_to_end/bench_moe.py",
                                                                         *sys.argv[1:]], {"rows": rows}, load_start))
    print("FAIL" if failures else "PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
