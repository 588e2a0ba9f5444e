"""Compiled memory of gPipe vs 1F1B (printed): XLA's temporaries per device of the whole train step.

    python end_to_end/pipeline_memory.py [--stages 4] [--microbatches 16] [key=value ...]

S stages x 8/S data-parallel replicas on 8 simulated CPU devices, float32, a model whose activations outweigh
its weights (emb 256, 256 tokens per row, 4 layers per stage by default). For gPipe (autodiff through the
scanned forward: every iteration's residuals live until the backward) under remat_policy none and full, and for
1F1B (pipeline_schedule=1f1b: a stage keeps at most S stage inputs and recomputes its block in the backward),
it prints `compiled.memory_analysis()`'s temporaries and arguments per device, and the size of one microbatch's
stage input [b, T, E] for scale: 1F1B's activation memory is about S of those where gPipe's grows with M.

PASS when 1F1B's temporaries are below gPipe's under both remat policies.
"""

from __future__ import annotations

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=8)

import argparse  # noqa: E402
import sys  # noqa: E402

from verdict import exit_with  # noqa: E402

MODEL = ("emb_dim=256", "num_query_heads=4", "num_kv_heads=4", "head_dim=64", "mlp_dim=512", "vocab_size=264",
         "max_target_length=256", "dtype=float32", "weight_dtype=float32", "dataset_type=synthetic",
         "enable_checkpointing=false")


def compiled_memory(overrides: list[str]) -> tuple[int, int]:
    """(temporary bytes, argument bytes) per device of the compiled train step of the tiny config + `overrides`."""
    import jax

    from helpers import tiny_config
    from maxpar.train import setup_run
    from maxpar.training.train_step import compile_train_step

    run = setup_run(tiny_config(*MODEL, *overrides), jax.devices())
    stats = compile_train_step(run.model, run.tx, run.layout, run.mesh).memory_analysis()
    return stats.temp_size_in_bytes, stats.argument_size_in_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--layers_per_stage", type=int, default=4)
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
             "1f1b": ["pipeline_schedule=1f1b"]}
    print(f"S={s} stages x {replicas} data replicas, M={m} microbatches of 1 row x 256 tokens, "
          f"{args.layers_per_stage} layers per stage; one stage input = {one_input / 2**20:.2f} MiB")
    print(f"{'schedule':<20} {'temporaries MiB':>16} {'in stage inputs':>16} {'arguments MiB':>14}")
    temps = {}
    for name, overrides in cases.items():
        temp, arguments = compiled_memory(common + overrides)
        temps[name] = temp
        print(f"{name:<20} {temp / 2**20:>16.2f} {temp / one_input:>16.1f} {arguments / 2**20:>14.2f}", flush=True)
    for name in ("gpipe, remat none", "gpipe, remat full"):
        print(f"1f1b / {name}: {temps['1f1b'] / temps[name]:.3f} (S/M = {s / m:.3f})")
    ok = all(temps["1f1b"] < temps[name] for name in ("gpipe, remat none", "gpipe, remat full"))
    print("PASS: 1F1B needs fewer temporaries than gPipe" if ok else "FAIL: 1F1B's temporaries are not below gPipe's")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.argv[0] = "pipeline_memory"
    exit_with(main)
