"""The end of a run: a few summary lines and the loss curve, so that a finished run says what it did and where.

matplotlib is optional (the `plot` extra): it is imported only to draw, and a run without it simply has
no loss_curve.png (the summary says so).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

LOSS_CURVE = "loss_curve.png"


def plot_losses(rows: Sequence[dict[str, Any]], path: Path, title: str, threshold: float | None = None) -> None:
    """Train and eval loss vs step as a PNG. Raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    few = len(rows) <= 20  # points, or a short run's single row would not show
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss", linewidth=1,
            marker="." if few else None)
    evals = [r for r in rows if r.get("eval_loss") is not None]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss", markersize=4)
    if threshold is not None:
        ax.axhline(threshold, color="gray", linestyle="--", linewidth=1, label=f"threshold {threshold}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@dataclasses.dataclass(frozen=True)
class RunTotals:
    """What the training loop of this invocation did."""

    first_step: int          # the step it resumed from (0 = a fresh run)
    last_step: int
    wall_s: float            # from setup to the end, compilation and restore included
    train_s: float           # the step loop alone
    tokens_per_step: int


def read_rows(metrics_path: Path) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl (earlier invocations of a resumed run included); a torn last line is skipped."""
    rows = []
    if metrics_path.exists():
        for line in metrics_path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def newest_checkpoint(run_dir: Path) -> Path | None:
    directory = run_dir / "checkpoints"
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()] if directory.is_dir() else []
    return directory / str(max(steps)) if steps else None


def summary_lines(run_dir: Path, totals: RunTotals, rows: Sequence[dict[str, Any]], curve: Path | str) -> list[str]:
    """The end-of-run report: steps, time, throughput, final losses, where the checkpoint and metrics are."""
    trained = totals.last_step - totals.first_step
    if trained > 0:
        rate = trained * totals.tokens_per_step / totals.train_s if totals.train_s > 0 else 0.0
        done = (f"steps {totals.first_step + 1}-{totals.last_step} ({trained}) in {totals.wall_s:.1f} s wall, "
                f"{totals.train_s:.1f} s of them training: {rate:,.0f} tokens/s")
    else:
        done = f"nothing to train: the run was already at step {totals.last_step}"
    lines = [f"maxpar: done: {done}"]
    last = rows[-1] if rows else None
    evals = [r for r in rows if r.get("eval_loss") is not None]
    if last is not None:
        losses = f"final train loss {last['loss']:.4f} (step {last['step']})"
        if evals:
            losses += f", eval loss {evals[-1]['eval_loss']:.4f} (step {evals[-1]['step']})"
        lines.append(f"  {losses}")
    checkpoint = newest_checkpoint(run_dir)
    lines.append(f"  checkpoint: {checkpoint if checkpoint else 'none (enable_checkpointing=false)'}")
    if checkpoint and (run_dir / "config.yml").exists():
        lines.append(f"  sample from it: {generate_command(run_dir, checkpoint)}")
    metrics = run_dir / "metrics.jsonl"
    lines.append(f"  metrics: {metrics if metrics.exists() else 'none'}; loss curve: {curve}")
    return lines


def generate_command(run_dir: Path, checkpoint: Path) -> str:
    """The one-line `python -m maxpar.generate` for a run, ready to paste: its saved config.yml holds every key (so
    no model preset is read again: model_name=), the checkpoint its parameters; paths shell-quoted."""
    config = yaml.safe_load((run_dir / "config.yml").read_text(encoding="utf-8")) or {}
    words = ["python -m maxpar.generate", shlex.quote(str(run_dir / "config.yml")), "model_name=",
             shlex.quote(f"load_parameters_path={checkpoint}"), *unstaged_mesh(config), *room_to_write(config),
             f"--prompt {shlex.quote(PROMPT)}"]
    return " ".join(words)


PROMPT = "def "


def room_to_write(config: Mapping[str, Any]) -> list[str]:
    """max_new_tokens that fits the run's max_target_length after BOS and the prompt (no tokenizer makes more
    tokens than bytes), where the configured one would not: a short-sequence run's command still runs."""
    length, new = config.get("max_target_length"), config.get("max_new_tokens")
    room = length - 1 - len(PROMPT.encode()) if isinstance(length, int) else None
    return [f"max_new_tokens={room}"] if room is not None and isinstance(new, int) and 0 < room < new else []


def unstaged_mesh(config: Mapping[str, Any]) -> list[str]:
    """Overrides that give a pipelined run's mesh no stage axis (maxpar.generate runs no pipeline): the stage
    degree goes to data parallelism, so the mesh still covers the run's devices; none for other runs."""
    overrides = []
    for level in ("ici", "dcn"):
        stages = config.get(f"{level}_stage_parallelism", 1)
        if stages == 1:
            continue
        overrides.append(f"{level}_stage_parallelism=1")
        degrees = [v for k, v in config.items() if k.startswith(f"{level}_") and k.endswith("_parallelism")]
        if stages == -1:  # the stage axis filled the level: data fills it now
            overrides.append(f"{level}_data_parallelism=-1")
        elif -1 not in degrees:  # no axis fills the level: data takes the stages' share
            overrides.append(f"{level}_data_parallelism={config.get(f'{level}_data_parallelism', 1) * stages}")
    return overrides


def finish_run(run_dir: Path, totals: RunTotals, title: str) -> list[str]:
    """Draw RUN/loss_curve.png (when matplotlib is installed and there are losses) and return the summary lines."""
    rows = read_rows(run_dir / "metrics.jsonl")
    curve: Path | str = "none (no losses logged)"
    if rows:
        try:
            plot_losses(rows, run_dir / LOSS_CURVE, title)
            curve = run_dir / LOSS_CURVE
        except ImportError:
            curve = "not drawn (matplotlib is missing: pip install -e '.[plot]')"
    return summary_lines(run_dir, totals, rows, curve)
