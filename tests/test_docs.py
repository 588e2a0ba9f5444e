"""The documentation: the MkDocs site builds with --strict, and every shell block marked runnable in README.md and
docs/*.md runs and exits 0 (docs/architecture.md, "Runnable commands").

A runnable block is a fence directly after the line `<!-- runnable -->` (or `<!-- runnable: slow -->`, the slower
tier: `-k "not slow"` skips it). Each block runs as one `bash -e -o pipefail` script in a fresh temporary working
copy of the repository (its top-level entries linked), so what it writes stays out of the repository, with this
Python's bin directory first on PATH and without the suite's simulated devices: a command that needs several
devices says `num_simulated_devices=N` itself, as a reader's would. Identical blocks run once.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*runnable(?::\s*(?P<tier>[\w-]+))?\s*-->")
FENCE = re.compile(r"^(?P<ticks>`{3,})(?P<lang>[\w-]*)\s*$")
SHELLS = {"", "bash", "sh", "shell", "console"}
TIMEOUT_S = {"": 300, "slow": 600}  # per block; generous for a loaded 2-core machine
# README's two commands, exactly as .ci/run and new users run them; they reinstall, so they are never marked runnable.
README_COMMANDS = [
    "bash install.sh && . .venv/bin/activate && python -m maxpar.train configs/base.yml",
    "bash install.sh test && . .venv/bin/activate && python -m pytest -q -n 2",
]
README_MAX_LINES = 200
# Not linked into the working copy: version control, the environment, and what commands or builds write.
NOT_COPIED = {"outputs", "runs", "site", "build", "__pycache__"}


@dataclass
class Block:
    text: str
    tier: str
    where: list[str] = field(default_factory=list)  # "path:line" of the fence, first occurrence first


def fence_end(lines: list[str], opening: int) -> int | None:
    """Index of the line closing the fence opened at `opening` (None: never closed)."""
    ticks = FENCE.match(lines[opening].strip())["ticks"]
    for index in range(opening + 1, len(lines)):
        if lines[index].strip() == ticks:
            return index
    return None


def markers_and_blocks(path: Path) -> tuple[list[str], list[tuple[int, str, str]]]:
    """(problems, [(fence line number, tier, script)]) of one Markdown file. Markers inside code blocks (an example
    of the marker itself) are text, not markers."""
    lines = path.read_text().splitlines()
    problems, blocks = [], []
    rel = path.relative_to(REPO)
    index = 0
    while index < len(lines):
        line = lines[index]
        if FENCE.match(line.strip()):  # an unmarked code block: skip it whole
            closing = fence_end(lines, index)
            index = len(lines) if closing is None else closing + 1
            continue
        index += 1
        if not line.lstrip().startswith("<!--") or "runnable" not in line:
            continue
        where = f"{rel}:{index}"
        found = MARKER.fullmatch(line.strip())
        if found is None or line != line.strip():
            problems.append(f"{where}: not a marker line: {line!r} (write <!-- runnable --> alone, unindented)")
            continue
        tier = found["tier"] or ""
        if tier not in TIMEOUT_S:
            problems.append(f"{where}: unknown tier {tier!r} (known: {sorted(TIMEOUT_S)})")
            continue
        opening = FENCE.match(lines[index]) if index < len(lines) else None
        if opening is None or opening["lang"] not in SHELLS:
            problems.append(f"{where}: the marker is not directly followed by a shell fence (```bash)")
            continue
        closing = fence_end(lines, index)
        if closing is None:
            problems.append(f"{rel}:{index + 1}: the fence is never closed")
            break
        body = lines[index + 1:closing]
        if "".join(body).strip():
            blocks.append((index + 1, tier, "\n".join(body) + "\n"))
        else:
            problems.append(f"{rel}:{index + 1}: the runnable block is empty")
        index = closing + 1
    return problems, blocks


def collect() -> tuple[list[str], list[Block]]:
    problems, unique = [], {}
    for path in SOURCES:
        found, blocks = markers_and_blocks(path)
        problems += found
        for line, tier, text in blocks:
            key = " ".join(text.replace("\\\n", " ").split())  # the same commands, however they are wrapped
            block = unique.setdefault(key, Block(text, tier))
            block.where.append(f"{path.relative_to(REPO)}:{line}")
            if tier == "slow":
                block.tier = "slow"
    return problems, list(unique.values())


PROBLEMS, BLOCKS = collect()


def test_markers_are_well_formed():
    assert not PROBLEMS, "\n".join(PROBLEMS)
    assert BLOCKS, "no runnable blocks found"


def test_readme_keeps_its_two_commands_unmarked_and_stays_short():
    readme = (REPO / "README.md").read_text()
    lines = readme.splitlines()
    for command in README_COMMANDS:
        assert command in lines, f"README.md lost its command (.ci/run depends on it): {command}"
        assert not any(command in block.text for block in BLOCKS), f"README's install command is marked runnable: {command}"
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; keep it to {README_MAX_LINES}, details in docs/"


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=REPO, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, text=True, timeout=300)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout[-6000:]}"
    assert (tmp_path / "site" / "index.html").exists()


def working_copy(directory: Path) -> Path:
    directory.mkdir()
    for entry in REPO.iterdir():
        if entry.name.startswith(".") or entry.name in NOT_COPIED:
            continue
        (directory / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return directory


def reader_environment() -> dict[str, str]:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).split()
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[("slow-" if b.tier else "") + b.where[0] for b in BLOCKS])
def test_runnable_block(block: Block, tmp_path):
    work = working_copy(tmp_path / "repo")
    script = tmp_path / "block.sh"
    script.write_text(block.text)
    timeout = TIMEOUT_S[block.tier]
    process = subprocess.Popen(["bash", "-e", "-o", "pipefail", str(script)], cwd=work, env=reader_environment(),
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the block's whole process group: bash and the commands it started
        output, _ = process.communicate()
        pytest.fail(f"runnable block at {', '.join(block.where)} ran past {timeout} s:\n{block.text}\n"
                    f"--- output (tail)\n{output[-4000:]}")
    assert process.returncode == 0, (f"runnable block at {', '.join(block.where)} exited {process.returncode}:\n"
                                     f"{block.text}\n--- output (tail)\n{output[-4000:]}")
