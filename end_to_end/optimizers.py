"""AdamW-cosine, AdamW-WSD and Muon-WSD on the default model, each at its tuned learning rate (a small sweep).

    python end_to_end/optimizers.py [--steps 300] [--learning-rates 1e-3,3e-3,1e-2] [--rates ARM=LR,LR,...]
                                    [--plot docs/optimizers.png] [--record docs/results] [key=value ...]

Trains the default model (configs/base.yml: its data, batch, warm-up and final fraction) for --steps steps on one
CPU device, once per optimizer arm and learning rate:

  adamw_cosine  opt_type=adamw lr_schedule_type=cosine (the default)
  adamw_wsd     opt_type=adamw lr_schedule_type=wsd, the last 20% of the steps decaying as 1-sqrt
  muon_wsd      opt_type=muon (muon_consistent_rms=0.2: AdamW's learning rate and weight decay carry over) with
                the same WSD schedule

Each run evaluates on the held-out documents every --eval-interval steps and at the end. An arm's tuned learning
rate is the one with the lowest final held-out loss. Prints the sweep, optionally plots the tuned runs' curves and
the sweep and writes a JSON record. PASS when every run's losses are finite and every arm's tuned run ends below
the loss of predicting bytes uniformly (ln vocab_size) by at least a nat; which arm wins is the finding, not the
verdict.
"""

from __future__ import annotations

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=None)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from verdict import exit_with  # noqa: E402  end_to_end/verdict.py

from maxpar.tools import records  # noqa: E402

LOAD_START = records.load_average()
WSD = ["lr_schedule_type=wsd", "wsd_decay_steps_fraction=0.2", "wsd_decay_style=1-sqrt"]
ARMS = {"adamw_cosine": ["opt_type=adamw", "lr_schedule_type=cosine"],
        "adamw_wsd": ["opt_type=adamw", *WSD],
        "muon_wsd": ["opt_type=muon", *WSD]}


def run(arm: str, learning_rate: float, args: argparse.Namespace) -> dict:
    """Train one arm at one learning rate in a fresh run directory; its metrics rows and wall time."""
    import jax

    from maxpar.core.config import load_config
    from maxpar.train import train

    config = load_config(["configs/base.yml", *ARMS[arm], f"learning_rate={learning_rate:g}", f"steps={args.steps}",
                          f"eval_interval={args.eval_interval}", "enable_checkpointing=false",
                          f"log_period={args.log_period}", *args.overrides])
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        train(config, devices=jax.devices()[:1], run_dir=Path(out) / "run")
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (Path(out) / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "wall_s": wall, "vocab_size": config.vocab_size}


def summary(arm: str, learning_rate: float, result: dict, tail: int) -> dict:
    rows = result["rows"]
    evals = [[r["step"], round(r["eval_loss"], 4)] for r in rows if r["eval_loss"] is not None]
    losses = [r["loss"] for r in rows]
    return {"arm": arm, "learning_rate": learning_rate, "final_eval_loss": evals[-1][1] if evals else None,
            f"train_loss_last_{tail}_logged": round(sum(losses[-tail:]) / len(losses[-tail:]), 4),
            "eval_losses": evals, "skipped_steps": rows[-1]["skipped_nonfinite"] + rows[-1]["skipped_spikes"],
            "wall_s": round(result["wall_s"], 1)}


def plot(path: Path, results: dict, tuned: dict, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, sweep) = plt.subplots(1, 2, figsize=(13, 4.5))
    for arm, lr in tuned.items():
        rows = results[(arm, lr)]["rows"]
        steps = [r["step"] for r in rows]
        window = 5
        smooth = [sum(r["loss"] for r in rows[max(0, i - window + 1):i + 1]) / len(rows[max(0, i - window + 1):i + 1])
                  for i in range(len(rows))]
        line, = curves.plot(steps, smooth, linewidth=1, label=f"{arm} (lr {lr:g}) train")
        evals = [(r["step"], r["eval_loss"]) for r in rows if r["eval_loss"] is not None]
        curves.plot(*zip(*evals), "o--", color=line.get_color(), label=f"{arm} held-out")
    curves.set_xlabel("step")
    curves.set_ylabel("loss (nats)")
    curves.set_title("tuned runs: training loss (5-row mean) and held-out loss", fontsize=10)
    later = [r["loss"] for arm, lr in tuned.items() for r in results[(arm, lr)]["rows"] if r["step"] > 30]
    if later:  # the first steps fall from ln(vocab): leave them off the scale
        curves.set_ylim(top=max(later) + 0.2)
    curves.grid(alpha=0.3)
    curves.legend(fontsize=8)
    for arm in ARMS:
        points = sorted((lr, r["rows"][-1]["eval_loss"]) for (a, lr), r in results.items() if a == arm)
        sweep.plot(*zip(*points), "o-", label=arm)
    sweep.set_xscale("log")
    sweep.set_xlabel("peak learning rate")
    sweep.set_ylabel("final held-out loss (nats)")
    sweep.set_title("the sweep", fontsize=10)
    sweep.grid(alpha=0.3)
    sweep.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--learning-rates", dest="learning_rates", default="1e-3,3e-3,1e-2",
                        help="the peak learning rates every arm tries")
    parser.add_argument("--rates", action="append", default=[], metavar="ARM=LR,LR,...",
                        help="another set of learning rates for one arm (repeatable)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    parser.add_argument("--eval-interval", dest="eval_interval", type=int, default=100)
    parser.add_argument("--log-period", dest="log_period", type=int, default=10)
    parser.add_argument("--plot", type=Path, help="write the tuned runs' curves and the sweep as a PNG here")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    records.add_record_option(parser)
    args = parser.parse_args()
    os.chdir(REPO)  # the configs' relative paths
    arms = args.arms.split(",")
    rates = {arm: [float(x) for x in args.learning_rates.split(",")] for arm in arms}
    for item in args.rates:
        arm, _, values = item.partition("=")
        rates[arm] = [float(x) for x in values.split(",")]
    print(f"optimizers: the default model, {args.steps} steps on 1 CPU device, learning rates {rates}; "
          f"load average {LOAD_START}", flush=True)
    results, rows = {}, []
    tail = 5
    for arm in arms:
        for lr in rates[arm]:
            results[(arm, lr)] = run(arm, lr, args)
            rows.append(summary(arm, lr, results[(arm, lr)], tail))
            print(f"  {arm} lr {lr:g}: final held-out loss {rows[-1]['final_eval_loss']} in {rows[-1]['wall_s']} s "
                  f"[load {records.load_average()[0]}]", flush=True)
    finite = [r for r in rows if r["final_eval_loss"] is not None and math.isfinite(r["final_eval_loss"])]
    tuned = {arm: min((r for r in finite if r["arm"] == arm), key=lambda r: r["final_eval_loss"])["learning_rate"]
             for arm in arms if any(r["arm"] == arm for r in finite)}
    header = ("arm", "learning rate", "tuned", "held-out loss by step", "final held-out loss",
              f"train loss, last {tail} rows", "skipped", "wall s")
    cells = [[r["arm"], f"{r['learning_rate']:g}", "*" if tuned.get(r["arm"]) == r["learning_rate"] else "",
              " / ".join(f"{loss:.3f}@{step}" for step, loss in r["eval_losses"]), f"{r['final_eval_loss']}",
              f"{r[f'train_loss_last_{tail}_logged']:.3f}", str(r["skipped_steps"]), f"{r['wall_s']:.0f}"]
             for r in rows]
    records.print_table(header, cells)
    load_end = records.load_average()
    print(f"load average at the end: {load_end}")
    if args.plot and tuned:
        plot(args.plot, results, tuned, f"default model (configs/base.yml), {args.steps} steps, 1 CPU device; "
             f"load {LOAD_START[0]}-{load_end[0]}")
        print("plot:", args.plot)
    if args.record:
        figures = {"rows": records.table_rows(header, cells), "runs": rows, "tuned": tuned, "steps": args.steps}
        print("record:", records.write_record(args.record, "optimizers",
                                              ["python", "end_to_end/optimizers.py", *sys.argv[1:]], figures,
                                              LOAD_START))
    uniform = math.log(results[next(iter(results))]["vocab_size"])
    good = (len(finite) == len(rows) and len(tuned) == len(arms)
            and all(r["final_eval_loss"] < uniform - 1 for r in finite if tuned[r["arm"]] == r["learning_rate"]))
    if good:
        print(f"PASS: every run is finite and every arm's tuned run ends below ln(vocab) - 1 = {uniform - 1:.2f}")
        return 0
    print(f"FAIL: finite runs {len(finite)} of {len(rows)}; tuned {tuned}")
    return 1


if __name__ == "__main__":
    exit_with(main)
