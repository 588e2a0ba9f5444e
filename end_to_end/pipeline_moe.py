"""MoE layers in 1F1B and zero-bubble stages: what the balance loss's forward-only pass costs, and that the
schedules train like gPipe.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by end_to_end/preamble.py)
    python end_to_end/pipeline_moe.py [--microbatches 4] [--repeats 5] [--record DIR]

2 stages x 4 data replicas on 8 simulated CPU devices, a tiny float32 Mixtral-style model (8 experts, top-2,
dropless; a dense first layer, then 1 MoE layer per stage), 2 rows x 64 tokens per microbatch and replica. Runs:
gPipe, 1F1B and zero-bubble with load_balance_loss_weight=0.01 (the explicit-backward schedules then run their
op table's F ops once alone first, for the step's routed counts), and 1F1B with weight 0 (no such pass). Each
step is compiled once, then the timed steps run interleaved (one of each in turn, --repeats rounds after a
warm-up round); the table gives the median wall and CPU time per step. The simulated devices share the host's
cores, so the wall time is the work of all stages together (pipeline_bubble.py says why). PASS: the first
step's loss and balance loss equal gPipe's (rtol 1e-5) under each schedule with the same weight.
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
MODEL = ("model_name=tiny-moe", "emb_dim=64", "num_query_heads=4", "num_kv_heads=2", "head_dim=16", "mlp_dim=128",
         "vocab_size=264", "max_target_length=64", "dtype=float32", "weight_dtype=float32", "dataset_type=synthetic",
         "enable_checkpointing=false", "num_decoder_layers=3", "first_num_dense_layers=1", "ici_stage_parallelism=2",
         "ici_data_parallelism=4", "ici_fsdp_parallelism=1")
RUNS = {"gpipe": ("pipeline_schedule=gpipe", "load_balance_loss_weight=0.01"),
        "1f1b": ("pipeline_schedule=1f1b", "load_balance_loss_weight=0.01"),
        "zero_bubble": ("pipeline_schedule=zero_bubble", "load_balance_loss_weight=0.01"),
        "1f1b, weight 0": ("pipeline_schedule=1f1b", "load_balance_loss_weight=0")}


def compiled_step(overrides: list[str]):
    """(compiled train step, state, batch) of the model + `overrides` on the 8 devices."""
    import jax

    from maxpar.tools.testbed import micro_config
    from maxpar.train import global_batch, setup_run
    from maxpar.training.train_step import create_state

    run = setup_run(micro_config(*MODEL, *overrides), jax.devices())
    state = create_state(run.model, run.tx, run.layout, run.mesh)
    return run.compile_train_step(), state, global_batch(next(iter(run.train_data)), run.in_sharding)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up round)")
    records.add_record_option(parser)
    args = parser.parse_args()
    import jax

    m = args.microbatches
    print(f"pipeline_moe: S=2 stages x 4 data replicas on 8 simulated CPU devices, tiny float32 MoE, M={m}, "
          f"2 rows x 64 tokens per microbatch and replica; load average {LOAD_START}")
    steps = {name: compiled_step([*o, f"num_pipeline_microbatches={m}", f"per_device_batch_size={m}"])
             for name, o in RUNS.items()}
    states, first, wall, cpu = {}, {}, {name: [] for name in RUNS}, {name: [] for name in RUNS}
    for round_ in range(args.repeats + 1):
        for name, (compiled, state, batch) in steps.items():
            start, used = time.perf_counter(), time.process_time()
            states[name], metrics = jax.block_until_ready(compiled(states.get(name, state), batch))
            if round_ == 0:
                first[name] = (float(metrics["loss"]), float(metrics["moe_load_balance_loss"]))
            else:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - used)
    header = ("schedule", "step s (median)", "vs 1f1b weight 0", "CPU s/step", "loss step 1", "balance loss step 1")
    base = statistics.median(wall["1f1b, weight 0"])
    rows = [(name, f"{statistics.median(wall[name]):.4f}", f"{statistics.median(wall[name]) / base:.2f}",
             f"{statistics.median(cpu[name]):.3f}", f"{first[name][0]:.6f}", f"{first[name][1]:.6f}")
            for name in RUNS]
    records.print_table(header, rows)
    print(f"load average at the end: {records.load_average()}")
    if args.record:
        print("record:", records.write_record(args.record, "pipeline_moe",
                                              ["python", "end_to_end/pipeline_moe.py", *sys.argv[1:]],
                                              {"rows": records.table_rows(header, rows)}, LOAD_START))
    same = all(abs(a - b) <= 1e-5 * abs(b) for name in ("1f1b", "zero_bubble")
               for a, b in zip(first[name], first["gpipe"]))
    print("PASS: 1F1B's and zero-bubble's first loss and balance loss equal gPipe's" if same
          else "FAIL: the schedules' first losses differ from gPipe's")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
