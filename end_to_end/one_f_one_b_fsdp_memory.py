"""Compiled memory of 1F1B with FSDP inside the stages, per pipeline_fsdp_ag_* mode (printed).

    python end_to_end/one_f_one_b_fsdp_memory.py [--record docs/results] [key=value ...]

PP(2) x FSDP(4) on 8 simulated CPU devices, float32, a model whose stage weights outweigh its activations
(emb 256, mlp 1024, 4 layers per stage, 16 rows x 64 tokens, M = 4). The whole train step is compiled for each
FSDP gather mode of pipeline_schedule=1f1b: the default (every op gathers the stage's weights inside the
executor, their float32 gradients accumulate FSDP-split), pipeline_fsdp_ag_per_repeat (gathered once inside
the executor, gradients still split) and pipeline_fsdp_ag_once (gathered before it, gradients whole until one
reduction). It prints `compiled.memory_analysis()`'s temporaries per device and one stage's weights, whole, for
scale.

PASS when the default needs fewer temporaries than per_repeat, and per_repeat fewer than ag_once.
"""

from __future__ import annotations

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=8)

import argparse  # noqa: E402
import sys  # noqa: E402

from maxpar.tools import records  # noqa: E402
from verdict import exit_with  # noqa: E402

LOAD_START = records.load_average()

MODEL = ("emb_dim=256", "num_query_heads=4", "num_kv_heads=4", "head_dim=64", "mlp_dim=1024", "vocab_size=264",
         "num_decoder_layers=8", "max_target_length=64", "per_device_batch_size=2", "dtype=float32",
         "weight_dtype=float32", "dataset_type=synthetic", "enable_checkpointing=false", "ici_stage_parallelism=2",
         "ici_fsdp_parallelism=4", "ici_data_parallelism=1", "num_pipeline_microbatches=4",
         "pipeline_schedule=1f1b")
MODES = {"default (per op)": [], "pipeline_fsdp_ag_per_repeat": ["pipeline_fsdp_ag_per_repeat=true"],
         "pipeline_fsdp_ag_once": ["pipeline_fsdp_ag_once=true"]}


def compiled_temporaries(overrides: list[str]) -> int:
    """Temporary bytes per device of the compiled train step of the tiny config + `overrides`."""
    import jax

    from maxpar.tools.testbed import micro_config
    from maxpar.train import setup_run
    from maxpar.training.train_step import compile_train_step

    run = setup_run(micro_config(*MODEL, *overrides), jax.devices())
    return compile_train_step(run.model, run.tx, run.layout, run.mesh).memory_analysis().temp_size_in_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    records.add_record_option(parser)
    args, extra = parser.parse_known_args()
    layer = 4 * 256 * 256 + 3 * 256 * 1024 + 2 * 256  # attention, mlp, norms
    stage = 4 * layer * 4  # 4 layers, float32
    print(f"PP(2) x FSDP(4), M=4, 16 rows x 64 tokens; one stage's weights, whole: {stage / 2**20:.2f} MiB; "
          f"load average {LOAD_START}")
    header = ("mode", "temporaries MiB", "in stage weights")
    print("  ".join(header))
    temps, rows = {}, []
    for name, overrides in MODES.items():
        temps[name] = compiled_temporaries([*overrides, *extra])
        rows.append((name, f"{temps[name] / 2**20:.2f}", f"{temps[name] / stage:.2f}"))
        print("  ".join(rows[-1]), flush=True)
    print(f"load average at the end: {records.load_average()}")
    if args.record:
        print("record:", records.write_record(args.record, "one_f_one_b_fsdp_memory",
                                              ["python", "end_to_end/one_f_one_b_fsdp_memory.py", *sys.argv[1:]],
                                              {"rows": records.table_rows(header, rows),
                                               "stage_weights_bytes": stage}, LOAD_START))
    default, per_repeat, once = temps.values()
    ok = default < per_repeat < once
    print("PASS: the default gather keeps the fewest temporaries, pipeline_fsdp_ag_once the most" if ok
          else "FAIL: the gather modes' temporaries are not ordered default < per_repeat < ag_once")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.argv[0] = "one_f_one_b_fsdp_memory"
    exit_with(main)
