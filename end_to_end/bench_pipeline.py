"""Benchmark (printed, not asserted as a test): gPipe vs circular pipelines on 8 simulated CPU devices.

    python end_to_end/bench_pipeline.py [--stages S] [--microbatches M] [--repeats 1,2] [--steps N] [key=value ...]

The tiny model (configs/models/tiny.yml, float32) on S pipeline stages x 8/S data-parallel
replicas, the same weights and batches for every schedule. Per schedule it prints the bubble
formula (S-1)/(R*M+S-1), the step time (wall and CPU seconds, all threads: the CPU time is less
sensitive to other load on a shared machine), and the compiled step's collective-permutes over `stage`
(HLO instructions, executions per step, bytes per device per step) next to what `maxpar.plan`
predicts for them.

How to read the step times: simulated devices share the host's cores, and maxpar's SPMD loop
runs every stage at every iteration (placeholder blocks in the bubble), so a CPU step time
measures total work, which the formula predicts grows like the iterations x layers per block,
(R*M + S - 1) x L/(S*R), i.e. like 1 / (1 - bubble) for the same useful work. On accelerators
the bubble is idle time instead, with the same proportion.

PASS when every schedule's permute bytes match the plan within 10% and all schedules give the
first step's loss of the first one (rtol 1e-5).

    python end_to_end/bench_pipeline.py --fsdp_modes [--repeats R] ...

compares instead the three ways a circular pipeline on S stages x 8/S FSDP shards gathers its
FSDP-sharded stage weights: every iteration (default), once per repeat
(pipeline_fsdp_ag_per_repeat) and once per step (pipeline_fsdp_ag_once): the FSDP all-gather bytes
(measured in the compiled step and planned), the planned gathered-weight memory, XLA's temporaries,
and the step time. PASS when the gathered bytes match the plan within 10% and the losses agree.
"""

from __future__ import annotations

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=8)

import argparse
import os
import statistics
import sys
import time

from maxpar.tools import records

LOAD_START = records.load_average()  # before any compile: the load this run found


def record(args: argparse.Namespace, name: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """With --record DIR, the printed table as a record (one dict per row, keyed by the header)."""
    if args.record:
        print("record:", records.write_record(args.record, name, ["python", "end_to_end/bench_pipeline.py",
                                                                  *sys.argv[1:]],
                                              {"rows": records.table_rows(header, rows)}, LOAD_START))


def measure(overrides: list[str], steps: int) -> dict:
    """Compile and time one schedule with the trainer's own pieces; count its permutes."""
    import jax

    from maxpar.tools.bench import collective_counts, time_steps
    from maxpar.core.config import load_config
    from maxpar.plan import hlo
    from maxpar.plan.hardware import load_hardware
    from maxpar.plan.predict import Target, make_plan
    from maxpar.train import setup_run
    from maxpar.training.train_step import create_state

    config = load_config([str(REPO / "configs" / "base.yml"), *overrides])
    run = setup_run(config, jax.devices())
    state = create_state(run.model, run.tx, run.layout, run.mesh)
    start = time.perf_counter()
    compiled = run.compile_train_step()
    compile_s = time.perf_counter() - start
    text = compiled.as_text()
    axes = dict(run.mesh.shape)
    collectives = hlo.collectives(text, len(jax.devices()))
    permutes = [c for c in collectives if c.kind == "collective-permute" and hlo.label_groups(c, axes) == "stage"]
    gathers = [c for c in collectives if c.kind == "all-gather" and hlo.label_groups(c, axes) == "fsdp"]
    plan = make_plan(config, Target(load_hardware("tpu-v5p"), len(jax.devices()), 1))
    predicted = sum(c["bytes_per_device"] for c in plan["comms"] if c["collective"] == "collective-permute")
    predicted_gathers = sum(c["bytes_per_device"] for c in plan["comms"]
                            if c["collective"] == "all-gather" and c["axis"] == "fsdp")
    times, cpu_times, losses = time_steps(compiled, state, run, steps + 1)  # the first step is warm-up
    schedule = run.schedule
    return {"schedule": schedule, "compile_s": compile_s, "step_s": statistics.median(times[1:]),
            "cpu_s": statistics.median(cpu_times[1:]),
            "first_loss": losses[0], "permute_instructions": collective_counts(text).get("collective-permute", 0),
            "permute_executions": sum(c.count for c in permutes),
            "permute_bytes": sum(hlo.collective_wire_bytes(c) * c.count for c in permutes),
            "predicted_permute_bytes": predicted, "tokens_per_step": run.shape.tokens_per_step,
            "gather_bytes": sum(hlo.collective_wire_bytes(c) * c.count for c in gathers),
            "predicted_gather_bytes": predicted_gathers,
            "planned_gathered_weights": plan["memory_per_device_bytes"]["gathered_weights"],
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}


def compare_fsdp_modes(args: argparse.Namespace) -> int:
    """The three FSDP gather modes of one circular pipeline: measured and planned gathers, memory, time."""
    s, m, repeats = args.stages, args.microbatches, int(args.repeats.split(",")[-1])
    common = ["dataset_type=synthetic", "dtype=float32", "enable_checkpointing=false", f"ici_stage_parallelism={s}",
              "ici_fsdp_parallelism=-1", f"per_device_batch_size={2 * m / s:g}",
              f"num_pipeline_microbatches={m}", f"num_pipeline_repeats={repeats}", f"num_decoder_layers={s * repeats * 2}"]
    print(f"bench_pipeline --fsdp_modes: tiny model ({s * repeats * 2} layers), {s} stages x {8 // s} FSDP shards on 8 "
          f"simulated CPU devices, M={m}, R={repeats}, float32; {os.cpu_count()} CPU cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    modes = {"per iteration (default)": [], "per repeat": ["pipeline_fsdp_ag_per_repeat=true"],
             "once per step": ["pipeline_fsdp_ag_once=true"]}
    results = {name: measure([*common, *extra, *args.overrides], args.steps) for name, extra in modes.items()}
    first = next(iter(results.values()))
    rows = [(name, f"{r['gather_bytes']:,.0f}", f"{r['predicted_gather_bytes']:,.0f}",
             f"{r['planned_gathered_weights']:,.0f}", f"{r['temp_bytes']:,.0f}", f"{r['step_s']:.3f}",
             f"{r['cpu_s']:.2f}", f"{r['first_loss']:.6f}") for name, r in results.items()]
    header = ("FSDP gathers", "all-gather bytes/device", "plan predicts", "planned gathered weights",
              "XLA temporaries", "step s", "CPU s/step", "loss step 1")
    records.print_table(header, rows)
    record(args, "bench_pipeline_fsdp_modes", header, rows)
    failures = []
    for name, r in results.items():
        if abs(r["gather_bytes"] - r["predicted_gather_bytes"]) > 0.10 * max(r["gather_bytes"], 1):
            failures.append(f"{name}: all-gather bytes {r['gather_bytes']:,.0f} vs plan {r['predicted_gather_bytes']:,.0f}")
        if abs(r["first_loss"] - first["first_loss"]) > 1e-5 * abs(first["first_loss"]):
            failures.append(f"{name}: first loss {r['first_loss']} vs {first['first_loss']}")
    for failure in failures:
        print(f"  - {failure}")
    print("PASS" if not failures else "FAIL")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeats", default="1,2", help="comma-separated; 1 = gPipe, > 1 = circular")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per schedule (after one warm-up step)")
    parser.add_argument("--fsdp_modes", action="store_true",
                        help="compare the three FSDP gather modes of one circular pipeline (R = last of --repeats)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for every schedule")
    records.add_record_option(parser)
    args = parser.parse_args()
    if args.fsdp_modes:
        return compare_fsdp_modes(args)

    s, m = args.stages, args.microbatches
    rows_per_device = 2 * m / s  # 2 rows per pipeline microbatch on each of the 8/S data-parallel replicas
    common = ["dataset_type=synthetic", "dtype=float32", "enable_checkpointing=false", f"ici_stage_parallelism={s}",
              "ici_data_parallelism=-1", "ici_fsdp_parallelism=1", f"per_device_batch_size={rows_per_device:g}",
              f"num_pipeline_microbatches={m}"]
    print(f"bench_pipeline: tiny model, {s} stages x {8 // s} data-parallel replicas on 8 simulated CPU devices, "
          f"M={m}, float32; {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}")
    results = []
    for repeats in [int(r) for r in args.repeats.split(",")]:
        results.append(measure([*common, f"num_pipeline_repeats={repeats}", *args.overrides], args.steps))
    base = results[0]
    header = ("schedule", "R", "bubble", "iterations", "work vs first (formula)", "step s", "step vs first",
              "CPU s/step", "CPU vs first",
              "permutes in HLO", "permutes run/step", "permute bytes/device", "plan predicts", "loss step 1")
    rows = []
    for r in results:
        sc = r["schedule"]
        work = sc.num_iterations * sc.layers_per_block
        base_work = base["schedule"].num_iterations * base["schedule"].layers_per_block
        rows.append((sc.kind, str(sc.num_repeats), f"{sc.bubble:.1%}", str(sc.num_iterations),
                     f"{work / base_work:.2f}", f"{r['step_s']:.3f}", f"{r['step_s'] / base['step_s']:.2f}",
                     f"{r['cpu_s']:.2f}", f"{r['cpu_s'] / base['cpu_s']:.2f}",
                     str(r["permute_instructions"]), str(r["permute_executions"]), f"{r['permute_bytes']:,.0f}",
                     f"{r['predicted_permute_bytes']:,.0f}", f"{r['first_loss']:.6f}"))
    records.print_table(header, rows)
    record(args, "bench_pipeline", header, rows)
    failures = []
    for r in results:
        sc = r["schedule"]
        error = abs(r["permute_bytes"] - r["predicted_permute_bytes"]) / max(r["permute_bytes"], 1)
        if error > 0.10:
            failures.append(f"{sc.kind} R={sc.num_repeats}: permute bytes {r['permute_bytes']:,.0f} vs plan "
                            f"{r['predicted_permute_bytes']:,.0f}")
        if abs(r["first_loss"] - base["first_loss"]) > 1e-5 * abs(base["first_loss"]):
            failures.append(f"{sc.kind} R={sc.num_repeats}: first loss {r['first_loss']} vs {base['first_loss']}")
    for failure in failures:
        print(f"  - {failure}")
    print("PASS" if not failures else "FAIL")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
