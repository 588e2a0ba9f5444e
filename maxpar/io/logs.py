"""Where the libraries' log records go: a file, not the user's terminal (`log_level`).

Why: absl, Orbax, JAX and asyncio log through Python's `logging`, and absl's first record installs a handler
that prints every WARNING and above on stderr (`logging.basicConfig`). A damaged checkpoint that maxpar sets
aside with a one-line warning then shows as pages of Orbax tracebacks, and every read-only checkpoint read
warns that its directory is read only. While a run or a tool works, `library_logs` sends those records to a
file instead; `log_level=debug` prints them on the terminal too. maxpar's own lines are printed, not logged,
and an uncaught exception's traceback is printed by Python, not logged: both still reach the terminal.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from etils import epath

from maxpar.core import storage

FORMAT = "%(asctime)s %(levelname)s %(name)s %(filename)s:%(lineno)d] %(message)s"


def library_log_path(run_dir: epath.Path, process_index: int = 0, process_count: int = 1) -> epath.Path:
    """The run's library log: one file per process, so that the processes of a job never interleave lines."""
    return run_dir / ("libraries.log" if process_count == 1 else f"libraries.process_{process_index}.log")


def tool_log_path(tool: str) -> Path:
    """The library log of a tool that has no run directory (generate, convert): one file per user and tool in
    the temporary directory, replaced at the tool's next start, so that it never grows or writes into a run."""
    return Path(tempfile.gettempdir()) / f"maxpar-{os.getuid()}" / f"{tool}.log"


def prints_on_terminal(handler: logging.Handler) -> bool:
    """Whether `handler` is the one absl's first record installs (`logging.basicConfig`: a plain StreamHandler on
    stderr). Handlers of other kinds (a user's files, pytest's capture) are kept as they are."""
    return type(handler) is logging.StreamHandler


class _FileHandler(logging.FileHandler):
    """A FileHandler that creates the file, and its directory, at the first record: a run that stops before any
    library logs anything leaves no directory behind."""

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


@contextlib.contextmanager
def library_logs(path: Path | epath.Path, log_level: str, mode: str = "a") -> Iterator[None]:
    """Within: library records of `log_level` and above go to `path` (created at the first one), and to the
    terminal only when `log_level` is debug. The root logger's handlers and level are restored on the way out.
    A `path` on an object store is written locally and copied up on the way out (`storage.LocalMirror`)."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    remote = storage.is_remote(path)
    mirror = storage.LocalMirror(path.parent, names=[path.name] if mode == "a" else []) if remote else None
    local = mirror.directory / path.name if mirror else path
    to_file = _FileHandler(local, mode=mode, encoding="utf-8", delay=True)
    to_file.setFormatter(logging.Formatter(FORMAT))
    show = log_level == "debug"
    kept = [handler for handler in saved_handlers if show or not prints_on_terminal(handler)]
    if show and not any(prints_on_terminal(handler) for handler in kept):
        kept.append(logging.StreamHandler(sys.stderr))
    root.handlers = [*kept, to_file]
    root.setLevel(log_level.upper())
    saved_hook, sys.unraisablehook = sys.unraisablehook, log_unraisable
    try:
        yield
    finally:
        gc.collect()  # what the libraries abandoned (a failed read's futures) reports its errors here, not later
        sys.unraisablehook = saved_hook
        root.handlers = saved_handlers
        root.setLevel(saved_level)
        to_file.close()
        if mirror:
            storage.close_after(mirror.close, lambda message: print(f"maxpar: warning: {path.name}: {message}",
                                                                    file=sys.stderr, flush=True))


def log_unraisable(unraisable: "sys.UnraisableHookArgs") -> None:
    """An exception Python could not raise (one left in an abandoned future, e.g. by Orbax's reads of a damaged
    checkpoint, reported when the future is collected) as a library record, instead of a traceback on stderr."""
    logging.getLogger("unraisable").warning(
        "%s: %r", unraisable.err_msg or "Exception ignored in", unraisable.object,
        exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback))
