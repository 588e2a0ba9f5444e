"""Per-chip memory of llama3-8b at 8k context on v5p-256, per attention core, as XLA:TPU compiles it (printed).

    python end_to_end/tpu_attention_memory.py [--record docs/results] [--attention dot_product,blockwise,splash]
                                              [key=value ...]

No TPU needed, only libtpu (`pip install "jax[tpu]==<jax's version>"`): the 128 chips of a `v5p:4x4x8` topology
(megacore, 4 chips per host, one slice) are compiled for on this machine's CPU. The run: model_name=llama3-8b
per_device_batch_size=2 max_target_length=8192 remat_policy=full, FSDP over the 128 chips (base.yml's mesh), extra
key=value overrides after it. For each attention core the trainer's step is compiled
(`maxpar.plan.verify.compile_train_step`, one core at a time: each takes minutes on a loaded 2-core machine) and
XLA:TPU's memory analysis per chip is printed — arguments, temporaries, outputs — beside the planner's estimate of
the temporaries for the same config on hardware=tpu-v5p (gradients + activations + gathered weights,
`maxpar.plan.verify.memory_rows`'s transient), with the compile time and the load average.

PASS when blockwise and splash each need fewer temporaries than dot_product (they keep no seq x seq scores).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the topology is compiled for; JAX itself runs on the CPU
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process on the machine may hold libtpu

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=None)

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from maxpar.tools import records  # noqa: E402
from verdict import exit_with  # noqa: E402

LOAD_START = records.load_average()
TOPOLOGY = dict(platform="tpu", topology_name="v5p:4x4x8", chip_config_name="megacore",
                chips_per_host_bounds=(2, 2, 1), num_slices=1)
RUN = ("model_name=llama3-8b", "per_device_batch_size=2", "max_target_length=8192", "remat_policy=full",
       "num_slices=1", "dataset_type=synthetic", "enable_checkpointing=false")
GIB = 2**30


def planned_temporaries(config, num_devices: int) -> float:
    """The planner's transient bytes per chip (gradients + activations + gathered weights) on hardware=tpu-v5p."""
    from maxpar.plan.hardware import load_hardware
    from maxpar.plan.predict import Target, make_plan

    memory = make_plan(config, Target(hardware=load_hardware("tpu-v5p"), num_devices=num_devices,
                                      num_slices=1))["memory_per_device_bytes"]
    return memory["gradients"] + memory["activations"] + memory["gathered_weights"]


def measure(attention: str, overrides: list[str], devices) -> dict[str, object]:
    from maxpar.core.config import load_config
    from maxpar.plan.verify import compile_train_step

    config = load_config([str(REPO / "configs" / "base.yml"), *RUN, f"attention={attention}", *overrides])
    load = records.load_average()
    start = time.perf_counter()
    compiled = compile_train_step(config, devices)
    seconds = time.perf_counter() - start
    memory = compiled.memory
    planned = planned_temporaries(config, len(devices))
    return {"attention": attention, "arguments GiB": f"{memory.argument_size_in_bytes / GIB:.2f}",
            "temporaries GiB": f"{memory.temp_size_in_bytes / GIB:.2f}",
            "outputs GiB": f"{memory.output_size_in_bytes / GIB:.2f}",
            "planned temporaries GiB": f"{planned / GIB:.2f}",
            "plan error": f"{(planned - memory.temp_size_in_bytes) / memory.temp_size_in_bytes:+.0%}",
            "compile s": f"{seconds:.0f}", "load before": " ".join(f"{x:.1f}" for x in load),
            "temp_bytes": memory.temp_size_in_bytes, "mesh": compiled.layout.mesh.describe()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="dot_product,blockwise,splash",
                        help="comma-separated attention cores to compile, one at a time")
    records.add_record_option(parser)
    args, overrides = parser.parse_known_args()
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(**TOPOLOGY).devices
    print(f"{' '.join(RUN)} {' '.join(overrides)} on {TOPOLOGY['topology_name']} ({len(devices)} chips, "
          f"{devices[0].device_kind}); load average {LOAD_START}", flush=True)
    rows = []
    for attention in args.attention.split(","):
        rows.append(measure(attention, overrides, devices))
        print(f"  {attention}: {rows[-1]['temporaries GiB']} GiB temporaries, compiled in {rows[-1]['compile s']} s",
              flush=True)
    header = ("attention", "arguments GiB", "temporaries GiB", "outputs GiB", "planned temporaries GiB", "plan error",
              "compile s", "load before")
    table = [tuple(str(row[h]) for h in header) for row in rows]
    records.print_table(header, table)
    print(f"mesh: {rows[0]['mesh']}")
    if args.record:
        path = records.write_record(args.record, "tpu_attention_memory", [sys.argv[0], *sys.argv[1:]],
                                    {"rows": records.table_rows(header, table), "run": [*RUN, *overrides],
                                     "topology": TOPOLOGY["topology_name"], "mesh": rows[0]["mesh"]}, LOAD_START,
                                    accelerator=f"none (compiled for {len(devices)} x {devices[0].device_kind})")
        print(f"record: {path}")
    temps = {row["attention"]: row["temp_bytes"] for row in rows}
    if "dot_product" not in temps:
        print("PASS: compiled (no dot_product row to compare with)")
        return 0
    worse = [a for a in ("blockwise", "splash") if a in temps and temps[a] >= temps["dot_product"]]
    if worse:
        print(f"FAIL: {', '.join(worse)} need as many temporaries as dot_product")
        return 1
    print("PASS: the block attention cores need fewer temporaries than dot_product")
    return 0


if __name__ == "__main__":
    exit_with(main)
