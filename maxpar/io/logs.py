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


@contextlib.contextmanager
def native_stderr_logged(logger: str) -> Iterator[None]:
    """Within: what native code writes to the process's stderr (file descriptor 2) is captured, and logged as INFO
    records of `logger` on the way out (so into the library log within `library_logs`). Python's own writes to
    sys.stderr in the meantime are captured too: keep it around a short call of one library."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines():
                if line.strip():
                    logging.getLogger(logger).info("%s", line)


_TENSORSTORE_AUTHENTICATED = False


def tensorstore_credentials(directory: str | os.PathLike) -> None:
    """Have TensorStore choose its Cloud Storage credentials now, once per process, its lines in the library log.

    Why: TensorStore's C++ prints its choice ('Using GOOGLE_AUTH_TOKEN_FOR_TESTING', 'Using credentials at ...') on
    stderr at INFO, which its Python module sends to stderr on purpose (no flag or variable of it changes that), at
    the first request of the process, from whatever thread makes it: a gs:// run's first checkpoint save would print
    it among maxpar's lines. So the first request is made here, under `native_stderr_logged`: one read of an object
    that need not exist, with one retry at most (a bucket that cannot be reached is reported by what needs it)."""
    global _TENSORSTORE_AUTHENTICATED
    if _TENSORSTORE_AUTHENTICATED or not storage.is_remote(directory):
        return
    _TENSORSTORE_AUTHENTICATED = True
    import tensorstore as ts
    storage.use_emulator()
    bucket, _, prefix = str(directory).removeprefix("gs://").partition("/")
    context = ts.Context({"gcs_request_retries": {"max_retries": 1, "initial_delay": "0.1s", "max_delay": "0.1s"}})
    with native_stderr_logged("tensorstore"):
        try:
            store = ts.KvStore.open({"driver": "gcs", "bucket": bucket}, context=context).result()
            store.read(f"{prefix.rstrip('/')}/.maxpar-credentials-probe".lstrip("/")).result()
        except Exception as e:  # any failure: the save or read that needs the bucket says what is wrong
            logging.getLogger("tensorstore").info("credentials probe of gs://%s: %s", bucket, e)

