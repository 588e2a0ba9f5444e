"""The end of a run: a few summary lines and the loss curve, so that a finished run says what it did and where.

matplotlib (a core dependency) is imported only to draw, so a run that logged no losses never loads it; a
curve that cannot be drawn or written leaves the run finished, and the summary says why.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Sequence
from typing import Any

from etils import epath

from maxpar.core.config import Config
from maxpar.core.layout import PIPELINE_ONLY_KEYS
from maxpar.core.mesh import MeshShape, one_host_mesh

LOSS_CURVE = "loss_curve.png"


def plot_losses(rows: Sequence[dict[str, Any]], path: epath.PathLike, title: str,
                threshold: float | None = None) -> None:
    """Train and eval loss vs step as a PNG."""
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
    with epath.Path(path).open("wb") as f:  # a gs:// path too (savefig writes only local files by name)
        fig.savefig(f, format="png")
    plt.close(fig)


@dataclasses.dataclass(frozen=True)
class RunTotals:
    """What the training loop of this invocation did."""

    first_step: int          # the step it resumed from (0 = a fresh run)
    last_step: int
    wall_s: float            # from setup to the end, compilation and restore included
    train_s: float           # the step loop alone
    tokens_per_step: int


def read_rows(metrics_path: epath.Path) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl (earlier invocations of a resumed run included); a torn last line is skipped."""
    rows = []
    if metrics_path.exists():
        for line in metrics_path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def newest_checkpoint(run_dir: epath.Path) -> epath.Path | None:
    directory = run_dir / "checkpoints"
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()] if directory.is_dir() else []
    return directory / str(max(steps)) if steps else None


def summary_lines(run_dir: epath.Path, totals: RunTotals, rows: Sequence[dict[str, Any]], curve: epath.Path | str,
                  sampling: Sequence[str], *, checkpointing: bool = True) -> list[str]:
    """The end-of-run report: steps, time, throughput, final losses, where the checkpoint and metrics are (or why
    there is none), and the command that samples from it (with the `sampling_overrides`)."""
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
        lines += source_lines(last, evals[-1] if evals else None)
    checkpoint = newest_checkpoint(run_dir)
    lines.append(f"  checkpoint: {checkpoint or no_checkpoint_words(checkpointing, trained)}")
    if checkpoint and (run_dir / "config.yml").exists():
        lines.append(f"  sample from it: {generate_command(run_dir, checkpoint, sampling)}")
    metrics = run_dir / "metrics.jsonl"
    lines.append(f"  metrics: {metrics if metrics.exists() else 'none'}; loss curve: {curve}")
    return lines


def no_checkpoint_words(checkpointing: bool, trained: int) -> str:
    """Why a run has no checkpoint to show: checkpointing is off, or it trained no step (steps=0, or a run already
    at its last step before any save)."""
    if not checkpointing:
        return "none (enable_checkpointing=false)"
    return "none (no step was trained, so none was saved)" if trained <= 0 else "none written"


def source_lines(last: dict[str, Any], last_eval: dict[str, Any] | None) -> list[str]:
    """A dataset_mixture's line: the tokens trained on from each source, their shares (to hold against the weights)
    and each source's newest eval loss; none for a single source."""
    tokens = {key.split("/", 1)[1]: value for key, value in last.items() if key.startswith("tokens/")}
    if not tokens:
        return []
    total = sum(tokens.values()) or 1

    def figures(name: str, count: int) -> str:
        loss = (last_eval or {}).get(f"eval_loss/{name}")
        return f"{name} {count:,} tokens ({count / total:.1%})" + ("" if loss is None else f", eval loss {loss:.4f}")

    return ["  per source: " + "; ".join(figures(name, count) for name, count in tokens.items())]


def generate_command(run_dir: epath.Path, checkpoint: epath.Path, overrides: Sequence[str]) -> str:
    """The one-line `python -m maxpar.generate` for a run, ready to paste: its saved config.yml holds every key (so
    no model preset is read again: model_name=), the checkpoint its parameters, `overrides` what sampling changes
    (`sampling_overrides`); paths shell-quoted."""
    words = ["python -m maxpar.generate", shlex.quote(str(run_dir / "config.yml")), "model_name=",
             shlex.quote(f"load_parameters_path={checkpoint}"), *map(shlex.quote, overrides),
             f"--prompt {shlex.quote(PROMPT)}"]
    return " ".join(words)


PROMPT = "def "


def sampling_overrides(config: Config, mesh: MeshShape, platform: str) -> list[str]:
    """What turns a run's config (trained on `mesh`, devices of `platform`) into one `maxpar.generate` runs as it
    is: one process on one host (it joins no multi-process job), no pipeline, room for the new tokens."""
    return [*one_host_mesh(config, mesh, platform), *unstaged_keys(config), *room_to_write(config)]


def unstaged_keys(config: Config) -> list[str]:
    """The pipeline-only keys a pipelined run set, back at their values without stages (maxpar.generate refuses
    them)."""
    return [f"{key}={str(unstaged).lower()}" for key, unstaged in PIPELINE_ONLY_KEYS.items()
            if getattr(config, key) != unstaged]


def room_to_write(config: Config) -> list[str]:
    """max_new_tokens that fits the run's max_target_length after BOS and the prompt (no tokenizer makes more
    tokens than bytes), where the configured one would not: a short-sequence run's command still runs."""
    room = config.max_target_length - 1 - len(PROMPT.encode())
    return [f"max_new_tokens={room}"] if 0 < room < config.max_new_tokens else []


def finish_run(run_dir: epath.Path, totals: RunTotals, title: str, sampling: Sequence[str], *,
               checkpointing: bool = True) -> list[str]:
    """Draw RUN/loss_curve.png (when there are losses) and return the summary lines (`sampling`: the
    `sampling_overrides` of the command they end with)."""
    rows = read_rows(run_dir / "metrics.jsonl")
    curve: epath.Path | str = "none (no losses logged)"
    if rows:
        try:
            plot_losses(rows, run_dir / LOSS_CURVE, title)
            curve = run_dir / LOSS_CURVE
        except (ImportError, OSError) as e:  # a broken install or an unwritable run directory: the run still finished
            curve = f"not drawn ({type(e).__name__}: {e})"
    return summary_lines(run_dir, totals, rows, curve, sampling, checkpointing=checkpointing)
