"""Expert load over training: aux-loss-free bias balancing against the auxiliary loss and against none.

    python end_to_end/moe_balance.py [--steps 240] [--rows 4] [--length 64] [--bias-rates 0.001[,RATE...]]
                                     [--plot docs/moe_balance.png] [--record docs/results] [key=value ...]

Trains the `tiny-moe` shape (8 experts, top-2, 4 MoE layers; float32) three ways (more with several bias rates)
on one CPU device, from the same seed, on the same batches of the default offline text (one batch is read per
step and fed to every run), steps interleaved so a change of machine load hits them alike:

  aux_loss_free  routed_bias=true (DeepSeek-V3: a per-expert bias shifts the top-k choice, moved each step by
                 routed_bias_update_rate x sign(mean load - load)), load_balance_loss_weight=0
  aux_loss       load_balance_loss_weight (the Switch/Mixtral loss), no bias
  none           neither

All three score with `routed_score_func` (default sigmoid, DeepSeek-V3's router), so the balancing is the only
difference, and start from the same weights. Per step it keeps the train step's `loss` (cross-entropy only) and
`moe_load_max_over_mean` / `moe_load_max_over_mean_worst` (the busiest expert's routed copies over the mean,
averaged over the MoE layers / in the worst layer; 1 = even, experts / top-k = 4 = every token chose the same
expert). At the end each final model routes one more batch, for the figure per layer. Prints the table, optionally
plots the curves and writes a JSON record. PASS when every figure is finite and in range and the three runs' first
losses agree (same weights and data: the balancing acts from the first update on); which method balances best is
the finding, not the verdict.
"""

from __future__ import annotations

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=None)

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

from verdict import exit_with  # noqa: E402  end_to_end/verdict.py

from maxpar.tools import records  # noqa: E402

LOAD_START = records.load_average()


def methods(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each run's name and the config keys that make it, on top of the shared ones: one aux-loss-free run per
    bias update rate (named with its rate when there are several), then the auxiliary loss, then neither."""
    rates = [float(rate) for rate in args.bias_rates.split(",")]
    free = {("aux_loss_free" if len(rates) == 1 else f"aux_loss_free@{rate:g}"):
            ["routed_bias=true", f"routed_bias_update_rate={rate:g}", "load_balance_loss_weight=0"] for rate in rates}
    return {**free, "aux_loss": [f"load_balance_loss_weight={args.aux_weight:g}"],
            "none": ["load_balance_loss_weight=0"]}


def shared_overrides(args: argparse.Namespace) -> list[str]:
    """The config keys every run shares: the model, the score function, the batch and the step count."""
    return ["model_name=tiny-moe", "dtype=float32", f"routed_score_func={args.score_func}", f"steps={args.steps}",
            f"per_device_batch_size={args.rows}", f"max_target_length={args.length}", "enable_checkpointing=false",
            "eval_interval=-1", *args.overrides]


def with_weights_of(state, reference):
    """`state` with every parameter that `reference` also has copied from it (fresh buffers: the steps donate their
    state). The routing bias shifts Flax's per-module init RNG, so the bias model would otherwise start from other
    router and expert weights than the two models without it."""
    import jax.numpy as jnp
    from flax import traverse_util

    source = traverse_util.flatten_dict(reference.params)
    params = {path: jnp.array(source[path]) if path in source else value
              for path, value in traverse_util.flatten_dict(state.params).items()}
    return state.replace(params=traverse_util.unflatten_dict(params))


def per_layer_load(run, state, batch):
    """max/mean load of each MoE layer [layers] when the model in `state` routes `batch` (the train step's own
    objective, so its `expert_routed` counts are those the metric reads)."""
    import jax

    from maxpar.model.context_parallel import reorder_batch
    from maxpar.model.moe import load_max_over_mean
    from maxpar.model.mtp import with_mtp_targets
    from maxpar.training.train_step import objective

    config = run.config
    prepared = reorder_batch(with_mtp_targets(batch, config.mtp_num_layers), run.model.layout)
    sums = jax.jit(partial(objective, model=run.model, config=config))(state.params, state.fp8_meta, prepared)[1]
    return [float(x) for x in load_max_over_mean(sums["expert_routed"])]


def window_means(values: list[float], window: int) -> list[float]:
    """Means over consecutive windows of `window` steps (the last one may be shorter)."""
    return [round(sum(part) / len(part), 3) for i in range(0, len(values), window) if (part := values[i:i + window])]


def plot(path: Path, curves: dict[str, dict[str, list[float]]], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for method, curve in curves.items():
        steps = range(1, len(curve["loss"]) + 1)
        for ax, key in zip(axes, ("mean", "worst", "loss")):
            ax.plot(steps, curve[key], label=method, linewidth=1)
    for ax, label in zip(axes, ("max/mean expert load, mean over MoE layers", "max/mean expert load, worst layer",
                                "training loss (cross-entropy)")):
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--rows", type=int, default=4, help="rows per step")
    parser.add_argument("--length", type=int, default=64, help="tokens per row")
    parser.add_argument("--score-func", dest="score_func", default="sigmoid", choices=("sigmoid", "softmax"))
    parser.add_argument("--bias-rates", dest="bias_rates", default="0.001",
                        help="routed_bias_update_rate of the aux-loss-free run; comma-separated: one run each")
    parser.add_argument("--aux-weight", dest="aux_weight", type=float, default=0.01,
                        help="load_balance_loss_weight of the aux_loss run")
    parser.add_argument("--print-every", dest="print_every", type=int, default=25)
    parser.add_argument("--plot", type=Path, help="write the curves as a PNG here")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    records.add_record_option(parser)
    args = parser.parse_args()
    os.chdir(REPO)  # the configs' relative paths

    import jax

    from maxpar.core.config import load_config
    from maxpar.train import global_batch, setup_run
    from maxpar.training.train_step import create_state

    devices = jax.devices()[:1]
    runs, steps, states = {}, {}, {}
    variants = methods(args)
    for method, overrides in variants.items():
        config = load_config(["configs/base.yml", *shared_overrides(args), *overrides])
        runs[method] = setup_run(config, devices)
        steps[method] = runs[method].compile_train_step()
        states[method] = create_state(runs[method].model, runs[method].tx, runs[method].layout, runs[method].mesh)
    for method in variants:
        if method.startswith("aux_loss_free"):
            states[method] = with_weights_of(states[method], states["none"])
    config = runs["none"].config
    experts = config.num_experts
    print(f"moe_balance: {config.num_moe_layers} MoE layers x {experts} experts (top-{config.num_experts_per_tok}), "
          f"{config.routed_score_func} scores, {args.rows} rows x {args.length} tokens per step, {args.steps} steps, "
          f"1 CPU device (no simulated devices), float32; load average {LOAD_START}", flush=True)
    curves = {method: {"loss": [], "mean": [], "worst": []} for method in variants}
    data = iter(runs["none"].train_data)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        local = next(data)
        for method in variants:
            batch = global_batch(local, runs[method].in_sharding)
            states[method], metrics = steps[method](states[method], batch)
            metrics = jax.device_get(metrics)
            curve = curves[method]
            curve["loss"].append(float(metrics["loss"]))
            curve["mean"].append(float(metrics["moe_load_max_over_mean"]))
            curve["worst"].append(float(metrics["moe_load_max_over_mean_worst"]))
        if step % args.print_every == 0 or step == args.steps:
            print(f"  step {step:4d}  " + "  ".join(
                f"{m}: loss {curves[m]['loss'][-1]:.3f} load max/mean {curves[m]['mean'][-1]:.2f} "
                f"(worst {curves[m]['worst'][-1]:.2f})" for m in variants)
                + f"  [{time.perf_counter() - start:.0f} s]", flush=True)
    last = next(data)
    tail = max(1, args.steps // 10)
    header = ("method", "steps", "final loss", f"loss, last {tail} steps", f"max/mean mean, last {tail} steps",
              f"max/mean worst, last {tail} steps", "max/mean mean, whole run", "max/mean per layer, next batch")
    rows = []
    for method in variants:
        curve = curves[method]
        layers = per_layer_load(runs[method], states[method], global_batch(last, runs[method].in_sharding))
        rows.append(dict(zip(header, (
            method, args.steps, round(curve["loss"][-1], 4), round(sum(curve["loss"][-tail:]) / tail, 4),
            round(sum(curve["mean"][-tail:]) / tail, 3), round(sum(curve["worst"][-tail:]) / tail, 3),
            round(sum(curve["mean"]) / args.steps, 3), [round(x, 2) for x in layers]))))
    cells = [[str(v) if not isinstance(v, list) else " / ".join(f"{x:.2f}" for x in v) for v in row.values()]
             for row in rows]
    records.print_table(header, cells)
    load_end = records.load_average()
    print(f"load average at the end: {load_end}; {time.perf_counter() - start:.0f} s of training", flush=True)
    window = max(1, args.steps // 12)
    if args.plot:
        plot(args.plot, curves, f"tiny-moe ({experts} experts, top-{config.num_experts_per_tok}, "
             f"{config.routed_score_func}), {args.rows}x{args.length} tokens/step, 1 CPU device; "
             f"bias rate {args.bias_rates}, aux weight {args.aux_weight:g}; load {LOAD_START[0]}-{load_end[0]}")
        print("plot:", args.plot)
    if args.record:
        figures = {"rows": rows, "window_steps": window,
                   "max_over_mean_mean_by_window": {m: window_means(curves[m]["mean"], window) for m in variants},
                   "max_over_mean_worst_by_window": {m: window_means(curves[m]["worst"], window) for m in variants}}
        print("record:", records.write_record(args.record, "moe_balance",
                                              ["python", "end_to_end/moe_balance.py", *sys.argv[1:]], figures,
                                              LOAD_START))
    values = [v for c in curves.values() for series in c.values() for v in series]
    ceiling = experts / config.num_experts_per_tok * (1 + 1e-6)
    finite = all(math.isfinite(v) for v in values) and all(1.0 <= v <= ceiling for c in curves.values()
                                                           for v in c["mean"] + c["worst"])
    first = [curves[m]["loss"][0] for m in variants]
    same_start = max(first) - min(first) <= 1e-5 * abs(first[0])
    if finite and same_start:
        print("PASS: the runs start from the same loss and every load figure lies in [1, experts / top-k]")
        return 0
    print(f"FAIL: finite and in range: {finite}; first losses {first}")
    return 1


if __name__ == "__main__":
    exit_with(main)
