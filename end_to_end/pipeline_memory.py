"""Compiled memory of gPipe vs 1F1B and zero-bubble (printed): XLA's temporaries per device of the whole train step.

    python end_to_end/pipeline_memory.py [--stages 4] [--microbatches 16] [--record docs/results] [key=value ...]

S stages x 8/S data-parallel replicas on 8 simulated CPU devices, float32, a model whose activations outweigh
its weights (emb 256, 256 tokens per row, 4 layers per stage by default). For gPipe (autodiff through the
scanned forward: every iteration's residuals live until the backward) under remat_policy none and full, and for
1F1B (pipeline_schedule=1f1b: a stage keeps at most S stage inputs and recomputes its block in the backward) and
zero-bubble (its stage inputs and cotangents wait for W too), it prints `compiled.memory_analysis()`'s temporaries
and arguments per device, the size of one microbatch's stage input [b, T, E] for scale (1F1B's activation memory
is about S of those where gPipe's grows with M), and maxpar.plan's estimate of the same temporaries.

PASS when 1F1B's and zero-bubble's temporaries are below gPipe's under both remat policies.
"""

from __future__ import annotations

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=8)

import argparse  # noqa: E402
import sys  # noqa: E402

from maxpar.tools import records  # noqa: E402
from verdict import exit_with  # noqa: E402

LOAD_START = records.load_average()

MODEL = ("emb_dim=256", "num_query_heads=4", "num_kv_heads=4", "head_dim=64", "mlp_dim=512", "vocab_size=264",
         "max_target_length=256", "dtype=float32", "weight_dtype=float32", "dataset_type=synthetic",
         "enable_checkpointing=false")


def compiled_memory(overrides: list[str]) -> tuple[int, int, float]:
    """(temporary bytes, argument bytes) per device of the compiled train step of the tiny config + `overrides`,
    and maxpar.plan's estimate of the temporaries (gradients + activations + gathered weights, as --verify's)."""
    import jax

    from maxpar.tools.testbed import micro_config
    from maxpar.plan.hardware import load_hardware
    from maxpar.plan.predict import Target, make_plan
    from maxpar.train import setup_run
    from maxpar.training.train_step import compile_train_step

    config = micro_config(*MODEL, *overrides)
    run = setup_run(config, jax.devices())
    stats = compile_train_step(run.model, run.tx, run.layout, run.mesh).memory_analysis()
    mem = make_plan(config, Target(load_hardware("tpu-v5p"), 8, 1))["memory_per_device_bytes"]
    planned = mem["gradients"] + mem["activations"] + mem["gathered_weights"]
    return stats.temp_size_in_bytes, stats.argument_size_in_bytes, planned


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--layers_per_stage", type=int, default=4)
    records.add_record_option(parser)
    args, extra = parser.parse_known_args()
    s, m = args.stages, args.microbatches
    replicas = 8 // s
    rows = m * replicas  # one row per microbatch and replica
    common = [f"num_decoder_layers={s * args.layers_per_stage}", f"ici_stage_parallelism={s}",
              f"ici_data_parallelism={replicas}", "ici_fsdp_parallelism=1", f"num_pipeline_microbatches={m}",
              f"per_device_batch_size={rows / 8:g}", *extra]
    one_input = 1 * 256 * 256 * 4  # [b=1, T, E] float32: one microbatch's stage input on one device
    cases = {"gpipe, remat none": ["pipeline_schedule=gpipe", "remat_policy=none"],
             "gpipe, remat full": ["pipeline_schedule=gpipe", "remat_policy=full"],
             "1f1b": ["pipeline_schedule=1f1b"], "zero_bubble": ["pipeline_schedule=zero_bubble"]}
    print(f"S={s} stages x {replicas} data replicas, M={m} microbatches of 1 row x 256 tokens, "
          f"{args.layers_per_stage} layers per stage; one stage input = {one_input / 2**20:.2f} MiB; "
          f"load average {LOAD_START}")
    header = ("schedule", "temporaries MiB", "in stage inputs", "arguments MiB", "planned MiB", "planned / measured")
    print("  ".join(header))
    temps, rows = {}, []
    for name, overrides in cases.items():
        temp, arguments, planned = compiled_memory(common + overrides)
        temps[name] = temp
        rows.append((name, f"{temp / 2**20:.2f}", f"{temp / one_input:.1f}", f"{arguments / 2**20:.2f}",
                     f"{planned / 2**20:.2f}", f"{planned / temp:.2f}"))
        print("  ".join(rows[-1]), flush=True)
    ratios = {f"{kind} / {name}": round(temps[kind] / temps[name], 3)
              for kind in ("1f1b", "zero_bubble") for name in ("gpipe, remat none", "gpipe, remat full")}
    for what, ratio in ratios.items():
        print(f"{what}: {ratio:.3f} (S/M = {s / m:.3f})")
    print(f"load average at the end: {records.load_average()}")
    if args.record:
        print("record:", records.write_record(args.record, "pipeline_memory",
                                              ["python", "end_to_end/pipeline_memory.py", *sys.argv[1:]],
                                              {"rows": records.table_rows(header, rows), "ratios": ratios,
                                               "S/M": s / m}, LOAD_START))
    ok = all(temps[kind] < temps[name] for kind in ("1f1b", "zero_bubble")
             for name in ("gpipe, remat none", "gpipe, remat full"))
    print("PASS: 1F1B and zero-bubble need fewer temporaries than gPipe" if ok
          else "FAIL: 1F1B's or zero-bubble's temporaries are not below gPipe's")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.argv[0] = "pipeline_memory"
    exit_with(main)
