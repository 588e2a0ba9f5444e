"""Measurement records: one JSON file per benchmark or end-to-end run, under docs/results/.

A figure means little without when, on what code and on which machine it was taken, and how loaded that
machine was (the CPU runs share their cores). So every entry point that measures writes, with
`--record DIR`, a record holding exactly that next to its figures, and docs/performance.md is generated
from the records (`python -m maxpar.tools.results_page`), never typed.

A record's fields (REQUIRED): name (which benchmark: it picks the page's table), date (UTC, ISO 8601),
commit (short hash, or null), machine (cpu, cores, memory_gib, accelerator, python, jax), load_average
(`start` and `end`, each the 1/5/15-minute averages, or null), command, figures (the benchmark's own
data). Records converted from older prose may also carry `source` and `note`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"
REQUIRED = ("name", "date", "commit", "machine", "load_average", "command", "figures")


def load_average() -> list[float]:
    """The 1, 5 and 15-minute load averages, rounded for reading."""
    return [round(x, 2) for x in os.getloadavg()]


def git_commit(repo: Path = REPO) -> str | None:
    """The checkout's short commit hash, with `+dirty` when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
    return round(pages * size / 2**30, 1)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine(accelerator: str | None = None) -> dict[str, Any]:
    """What ran it: CPU model, cores, memory, the accelerator's name (None: CPU only), Python and JAX versions.

    The caller names the accelerator (its worker saw the device), so that this never starts JAX.
    """
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": _memory_gib(), "accelerator": accelerator,
            "python": platform.python_version(), "jax": _version("jax")}


def _plain(value: Any) -> Any:
    """JSON for what json does not know: a NumPy or JAX scalar as its Python value, anything else as text."""
    return value.item() if hasattr(value, "item") else str(value)


def write_record(directory: Path, name: str, command: Sequence[str], figures: Mapping[str, Any],
                 load_start: Sequence[float], accelerator: str | None = None) -> Path:
    """Write DIRECTORY/<name>-<UTC date and time>-<commit>.json and return its path.

    `load_start` is `load_average()` taken when the run began; the end's is read now.
    """
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    commit = git_commit()
    record = {"name": name, "date": now.isoformat().replace("+00:00", "Z"), "commit": commit,
              "machine": machine(accelerator), "load_average": {"start": list(load_start), "end": load_average()},
              "command": shlex.join(command), "figures": dict(figures)}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{now:%Y-%m-%dT%H%MZ}-{(commit or 'nocommit').replace('+', '-')}.json"
    path.write_text(json.dumps(record, indent=1, default=_plain) + "\n", encoding="utf-8")
    return path


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print `rows` of text cells under `header`, each column right-aligned to its widest cell."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    for line in (header, tuple("-" * w for w in widths), *rows):
        print("  " + "  ".join(cell.rjust(w) for cell, w in zip(line, widths)))


def table_rows(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[dict[str, str]]:
    """A printed table as a record's rows: one {column: cell} per row."""
    return [dict(zip(header, row)) for row in rows]


def add_record_option(parser: argparse.ArgumentParser) -> None:
    """`--record DIR`, the same for every entry point that measures."""
    parser.add_argument("--record", type=Path, metavar="DIR",
                        help="also write the figures as a JSON record (date, commit, machine, load average) into "
                             f"DIR; {RESULTS.relative_to(REPO)} is where docs/performance.md is generated from")
