"""The benchmark's outputs: a Markdown table (also what the terminal shows) and a PNG bar chart.

A result row is the worker's JSON: measured figures, or `error` (the worker crashed or timed
out), `refused` (the config was rejected for this machine, e.g. cuDNN attention on a CPU) or
`out_of_memory`. Only measured rows have numbers; the others say why in the table and the chart.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def not_measured(row: Row) -> str | None:
    """Why a row has no figures (None if it has them)."""
    for key, label in (("error", "error"), ("refused", "not run"), ("out_of_memory", "out of memory")):
        if key in row:
            return f"{label}: {row[key]}"
    return None


def _collectives(row: Row) -> str:
    text = ", ".join(f"{op} {n}" for op, n in row["collectives"].items()) or "none"
    if row.get("remat_warnings"):
        text += f"; {row['remat_warnings']} involuntary remat warning(s)"
    return text


def _mfu(row: Row) -> str:
    return "n/a" if row.get("mfu") is None else f"{row['mfu']:.1%}"


def _device_memory(row: Row) -> str:
    return "n/a" if row.get("peak_device_gib") is None else f"{row['peak_device_gib']:.1f}"


Column = tuple[str, Callable[[Row], str]]

CPU_COLUMNS: tuple[Column, ...] = (
    ("strategy", lambda r: r["name"]),
    ("mesh", lambda r: r["mesh"]),
    ("compile s", lambda r: f"{r['compile_s']:.1f}"),
    ("step s (median)", lambda r: f"{r['step_s']:.3f}"),
    ("CPU s/step", lambda r: f"{r['cpu_s']:.2f}"),
    ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
    ("peak RSS MiB", lambda r: f"{r['peak_rss_mib']:,.0f}"),
    ("final loss", lambda r: f"{r['final_loss']:.4f}"),
    ("collectives", _collectives),
)

GPU_COLUMNS: tuple[Column, ...] = (
    ("setting", lambda r: r["name"]),
    ("tokens/step", lambda r: f"{r['tokens_per_step']:,}"),
    ("compile s", lambda r: f"{r['compile_s']:.1f}"),
    ("step s (median)", lambda r: f"{r['step_s']:.3f}"),
    ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
    ("TFLOP/s/device", lambda r: f"{r['tflops_per_device']:.1f}" if r["tflops_per_device"] >= 10
                                 else f"{r['tflops_per_device']:.3f}"),
    ("MFU", _mfu),
    ("peak device GiB", _device_memory),
    ("final loss", lambda r: f"{r['final_loss']:.4f}"),
)


def markdown_table(rows: Sequence[Row], header: str, columns: Sequence[Column]) -> str:
    """The rows as a Markdown table under a one-line description of the run."""
    lines = [header, "", "| " + " | ".join(name for name, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        reason = not_measured(row)
        if reason is not None:
            cells = [row["name"], reason.replace("|", "\\|")] + [""] * (len(columns) - 2)
        else:
            cells = [cell(row) for _, cell in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_chart(rows: Sequence[Row], path: Path, title: str) -> None:
    """Tokens/s per row (MFU written on the bar where known) beside compile seconds, as a PNG.

    matplotlib is imported here, so a worker process never loads it.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    names = [row["name"].replace(",", ",\n") for row in rows]  # one lever per line
    measured = [not_measured(row) is None for row in rows]
    title_lines = textwrap.wrap(title, 130)
    height = 0.3 * sum(name.count("\n") + 1.5 for name in names) + 1.2 + 0.16 * len(title_lines)
    fig, (speed, compile_ax) = plt.subplots(1, 2, figsize=(11, height), dpi=120,
                                            gridspec_kw={"width_ratios": [3, 1]}, sharey=True)
    positions = range(len(rows))
    speed.barh(positions, [row["tokens_per_s"] if ok else 0 for row, ok in zip(rows, measured)], color="tab:blue")
    compile_ax.barh(positions, [row["compile_s"] if ok else 0 for row, ok in zip(rows, measured)], color="tab:gray")
    for y, (row, ok) in enumerate(zip(rows, measured)):
        if ok:
            label = f" {row['tokens_per_s']:,.0f}" + ("" if row.get("mfu") is None else f"  (MFU {row['mfu']:.1%})")
        else:
            label = " " + not_measured(row).split(":")[0]
        speed.text(row["tokens_per_s"] if ok else 0, y, label, va="center", fontsize=8)
    speed.set_yticks(list(positions), names, fontsize=8)
    speed.invert_yaxis()
    speed.set_xlabel("tokens/s (median step)")
    speed.xaxis.set_major_locator(MaxNLocator(5))
    compile_ax.set_xlabel("compile s")
    for ax in (speed, compile_ax):
        ax.grid(axis="x", alpha=0.3)
    speed.margins(x=0.25)
    fig.suptitle("\n".join(title_lines), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.16 * len(title_lines) / height))
    fig.savefig(path)
    plt.close(fig)
