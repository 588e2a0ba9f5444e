"""Draw README's figure: predicted matmul time vs communication time across batch sizes, per strategy.

    python end_to_end/plan_figure.py [--out docs/plan_comms_vs_compute.png]

Every point is a `maxpar.plan` prediction (the same `evaluate` the CLI runs) for LLaMA-3 70B,
bfloat16, 8k context, on a 4096-chip TPU v5p slice (16x16x16), sweeping the global batch. It
shows the backward pass, where every strategy's binding collectives run (DP's gradient
all-reduce, FSDP's gathers and reduce-scatters, TP's input-gradient all-reduces): a strategy is
communication-bound where its curve lies above the matmul line, and the crossing is the plan's
critical batch -- the seeds' picture (how-to-parallelize-a-transformer.md, "comms-flops-time").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=None)  # a plan needs no devices: JAX keeps its own
DEVICES = 4096
MODEL = ["model_name=llama3-70b", "dtype=bfloat16", "weight_dtype=bfloat16", "max_target_length=8192"]
STRATEGIES = {  # DP and FSDP coincide in the backward pass: an all-reduce is a reduce-scatter + all-gather
    "DP 4096": ["ici_data_parallelism=-1", "ici_fsdp_parallelism=1"],
    "FSDP 4096": ["ici_fsdp_parallelism=-1"],
    "FSDP 1024 x TP 4": ["ici_fsdp_parallelism=-1", "ici_tensor_parallelism=4"],
    "FSDP 512 x TP 8": ["ici_fsdp_parallelism=-1", "ici_tensor_parallelism=8"],
}


def sweep(overrides: list[str], rows_per_device: list[float]) -> list[dict]:
    """Plans for every batch size: global tokens, backward-pass matmul and ICI communication seconds."""
    from maxpar.core.config import load_config
    from maxpar.plan.hardware import load_hardware
    from maxpar.training.train_step import trace_state
    from maxpar.plan.predict import Target, evaluate

    target = Target(load_hardware("tpu-v5p"), DEVICES, 1)
    state = None
    points = []
    for rows in rows_per_device:
        config = load_config([str(REPO / "configs" / "base.yml"), *MODEL, *overrides,
                              f"per_device_batch_size={rows}"])
        state = state or trace_state(config)
        result = evaluate(config, target, state)
        points.append({"tokens": result["global_batch_tokens"],
                        "compute": result["compute_time_by_phase_s"]["backward"],
                        "ici": result["comm_time_by_phase_s"]["backward/ici"]})
    return points


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "docs" / "plan_comms_vs_compute.png"))
    args = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [2 ** (k / 2) for k in range(-16, 5)]  # 1/256 .. 4 rows of 8k tokens per chip
    fig, ax = plt.subplots(figsize=(8, 4.8))
    compute = None
    for name, overrides in STRATEGIES.items():
        points = sweep(overrides, rows)
        tokens = [p["tokens"] for p in points]
        compute = compute or (tokens, [p["compute"] for p in points])
        dotted = name.startswith("DP")  # DP would hide under FSDP
        style = dict(linestyle=":", marker="s", markersize=5) if dotted else dict(marker="o", markersize=3)
        ax.plot(tokens, [p["ici"] for p in points], label=f"{name}: ICI communication", **style)
    ax.plot(*compute, "k--", linewidth=2, label="matmuls at peak")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("global batch (tokens per step)")
    ax.set_ylabel("seconds per step, backward pass")
    ax.set_title("maxpar.plan: LLaMA-3 70B, bf16, 8k context on TPU v5p 16x16x16 (4096 chips)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.text(0.99, 0.01, "above the dashed line = communication-bound; crossing = critical batch",
             ha="right", fontsize=8, color="gray")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1024:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
