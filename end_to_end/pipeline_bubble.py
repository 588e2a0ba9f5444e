"""Bubble of gPipe, 1F1B, zero-bubble (ZB-H1) and interleaved 1F1B, measured next to the planner's and the op
table's (printed).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by end_to_end/preamble.py)
    python end_to_end/pipeline_bubble.py [--stages 4] [--microbatches 4,8,16] [--virtual 2] [--repeats 5] [--record DIR]

S stages x 8/S data-parallel replicas on 8 simulated CPU devices, a tiny float32 model of S x R layers (R =
--virtual: one block of R layers per stage, or R blocks of one layer under interleaved_1f1b), the same 2 rows
per microbatch and replica for every schedule. Each (M, schedule) train step is compiled once; the
timed steps then run interleaved (one step of each schedule in turn, --repeats rounds after a warm-up round) so a
change of load hits them alike; the table gives the median. Per row: the op table's ticks and its counted bubble
(idle ticks / total; gPipe's table is the order autodiff runs it in; interleaved_1f1b's ticks are one block's
op, 1/R of the others'), the planner's predicted bubble, the median
step time and the CPU time of the step.

What the CPU figures can show: the simulated devices share the host's cores, so one step's wall time is the work
of all stages together, not the longest stage: a stage idling in the bubble frees a core for another stage rather
than wasting one. The bubble is therefore not visible in the wall time, which measures the total work each
executor does: gPipe differentiates the scanned forward (one forward, one backward per block and microbatch),
1F1B re-runs a block's forward in its backward, zero-bubble in both its B and its W, interleaved 1F1B as 1F1B
but R times as many ticks of 1/R the work, each with its permutes. On devices that run in
parallel the step would last ticks x the longest op; the counted bubble is the fraction of that spent idle.
"""

from __future__ import annotations

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=8)

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from maxpar.tools import records  # noqa: E402

LOAD_START = records.load_average()
SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "interleaved_1f1b")
MODEL = ("emb_dim=64", "num_query_heads=4", "num_kv_heads=2", "head_dim=16", "mlp_dim=128", "vocab_size=264",
         "max_target_length=64", "dtype=float32", "weight_dtype=float32", "dataset_type=synthetic",
         "enable_checkpointing=false", "remat_policy=full")


def compiled_step(overrides: list[str]):
    """(compiled train step, state, batch, config) of the model + `overrides` on the 8 devices."""
    import jax

    from maxpar.tools.testbed import micro_config
    from maxpar.train import global_batch, setup_run
    from maxpar.training.train_step import create_state

    config = micro_config(*MODEL, *overrides)
    run = setup_run(config, jax.devices())
    state = create_state(run.model, run.tx, run.layout, run.mesh)
    batch = global_batch(next(iter(run.train_data)), run.in_sharding)
    return run.compile_train_step(), state, batch, config


def timed(compiled, state, batch) -> tuple[object, float, float, float]:
    """(next state (the step donates its input), wall seconds, CPU seconds, loss) of one step on `batch`."""
    import jax

    start, cpu = time.perf_counter(), time.process_time()
    state, metrics = jax.block_until_ready(compiled(state, batch))
    return state, time.perf_counter() - start, time.process_time() - cpu, float(metrics["loss"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", default="4,8,16")
    parser.add_argument("--virtual", type=int, default=2, help="R: layers per stage, interleaved_1f1b's blocks")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up round)")
    records.add_record_option(parser)
    args = parser.parse_args()

    from maxpar.core.op_schedule import OpSchedule
    from maxpar.plan.hardware import load_hardware
    from maxpar.plan.predict import Target, make_plan

    s, replicas, r = args.stages, 8 // args.stages, args.virtual
    print(f"pipeline_bubble: S={s} stages x {replicas} data replicas on 8 simulated CPU devices "
          f"(XLA_FLAGS=--xla_force_host_platform_device_count=8), tiny float32 model, {r} layers per stage, "
          f"2 rows x 64 tokens per microbatch and replica; load average {LOAD_START}")
    header = ("M", "schedule", "ticks", "bubble (table)", "bubble (plan)", "step s (median)", "step vs gpipe",
              "CPU s/step", "loss step 1")
    rows = []
    for m in [int(x) for x in args.microbatches.split(",")]:
        common = [f"num_decoder_layers={s * r}", f"ici_stage_parallelism={s}", f"ici_data_parallelism={replicas}",
                  "ici_fsdp_parallelism=1", f"num_pipeline_microbatches={m}", f"per_device_batch_size={2 * m / s:g}"]
        repeats = {kind: r if kind == "interleaved_1f1b" else 1 for kind in SCHEDULES}
        steps = {kind: compiled_step([*common, f"pipeline_schedule={kind}", f"num_pipeline_repeats={repeats[kind]}"])
                 for kind in SCHEDULES}
        wall: dict[str, list[float]] = {kind: [] for kind in SCHEDULES}
        cpu: dict[str, list[float]] = {kind: [] for kind in SCHEDULES}
        states, losses = {}, {}
        for kind in SCHEDULES:  # the warm-up round
            compiled, state, batch, _ = steps[kind]
            states[kind], _, _, losses[kind] = timed(compiled, state, batch)
        for _ in range(args.repeats):
            for kind in SCHEDULES:
                states[kind], w, c, _ = timed(steps[kind][0], states[kind], steps[kind][2])
                wall[kind].append(w)
                cpu[kind].append(c)
        base = statistics.median(wall["gpipe"])
        for kind in SCHEDULES:
            table = OpSchedule(kind, s, m, repeats[kind])
            planned = make_plan(steps[kind][3], Target(load_hardware("tpu-v5p"), 8, 1))["pipeline_bubble"]
            median = statistics.median(wall[kind])
            rows.append((str(m), kind, str(table.num_ticks), f"{table.bubble:.1%}", f"{planned:.1%}",
                         f"{median:.4f}", f"{median / base:.2f}", f"{statistics.median(cpu[kind]):.3f}",
                         f"{losses[kind]:.6f}"))
            print("  " + "  ".join(rows[-1]), flush=True)
    records.print_table(header, rows)
    print(f"load average at the end: {records.load_average()}")
    if args.record:
        print("record:", records.write_record(args.record, "pipeline_bubble",
                                              ["python", "end_to_end/pipeline_bubble.py", *sys.argv[1:]],
                                              {"rows": records.table_rows(header, rows)}, LOAD_START))
    n = len(SCHEDULES)
    same = all(abs(float(row[-1]) - float(rows[i - i % n][-1])) <= 1e-5 * abs(float(row[-1]))
               for i, row in enumerate(rows))
    print("PASS: every schedule's first loss equals gPipe's" if same else "FAIL: the schedules' first losses differ")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
