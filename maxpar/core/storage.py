"""Paths a user names (output directories, checkpoints, config files): local or on an object store (gs://).

Why one module: `pathlib.Path("gs://b/run")` silently means the local folder `gs:/b/run`, so every user path goes
through `path()` (an `etils.epath.Path`, which reaches gs:// through gcsfs and hands Orbax/TensorStore the same
URL). Files that need a local file system (appended logs, TensorBoard events, traces, safetensors) are written
to a `LocalMirror` or staging directory and copied up; files that a library opens only by local name (ArrayRecord
shards, safetensors' memory map) are read from local copies; JSONL and Parquet shards through gcsfs file objects
and ranged reads. `STORAGE_EMULATOR_HOST` points every gs:// read and write at a GCS API server such as an
emulator: `use_emulator` derives the variables TensorStore and gcsfs read from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import io
import os
import shutil
import socket
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import IO, TypeVar

from etils import epath

REMOTE_SCHEMES = ("gs://",)
EMULATOR = "STORAGE_EMULATOR_HOST"
T = TypeVar("T")
GCS_URL = "https://storage.googleapis.com"


def is_remote(value: str | os.PathLike) -> bool:
    return str(value).startswith(REMOTE_SCHEMES)


def emulator_environment(environ: MutableMapping[str, str]) -> dict[str, str]:
    """The variables to add so that TensorStore and gcsfs both use the server `STORAGE_EMULATOR_HOST` names (unset
    ones only): TensorStore's own URL variable, a dummy token (an emulator checks none), and no gcsfs gRPC probe
    (it waits a minute against a server that speaks only the JSON API)."""
    host = environ.get(EMULATOR)
    if not host:
        return {}
    wanted = {"TENSORSTORE_GCS_HTTP_URL": host, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
              "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    return {key: value for key, value in wanted.items() if key not in environ}


def use_emulator(environ: MutableMapping[str, str] = os.environ) -> None:
    """Apply `emulator_environment`; idempotent. Runs before any gs:// path is made, so before the libraries read
    the variables."""
    environ.update(emulator_environment(environ))


def path(value: str | os.PathLike) -> epath.Path:
    """A user's path: gs://… stays a URL (and the emulator variables are set), a local one gets `~` expanded."""
    if is_remote(value):
        use_emulator()
        return epath.Path(str(value))
    return epath.Path(os.path.expanduser(str(value)))


def _gcs():
    """The gcsfs file system (it reads STORAGE_EMULATOR_HOST itself; `use_emulator` sets what else it needs)."""
    use_emulator()
    import fsspec
    return fsspec.filesystem("gs")


def glob_files(pattern: str) -> list[str]:
    """The files `pattern` matches (`**` recursive), sorted; a gs:// pattern is expanded by gcsfs."""
    if not is_remote(pattern):
        return sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    found = _gcs().glob(pattern, detail=True)
    return sorted(f"gs://{name}" for name, info in found.items() if info.get("type") == "file")


def read_text(value: str) -> str:
    """A whole text file, read as `open(value, encoding="utf-8", errors="replace")` reads it (universal newlines,
    undecodable bytes as U+FFFD), wherever it is."""
    if not is_remote(value):
        with open(value, encoding="utf-8", errors="replace") as f:
            return f.read()
    return io.TextIOWrapper(io.BytesIO(path(value).read_bytes()), encoding="utf-8", errors="replace").read()


def open_binary(value: str) -> IO[bytes]:
    """A seekable binary file object for reading, local or gs:// (gcsfs fetches the ranges read)."""
    return _gcs().open(value, "rb") if is_remote(value) else open(value, "rb")


def read_range(value: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file: one ranged request on gs://, not a whole-block read-ahead."""
    if is_remote(value):
        return _gcs().cat_file(value, start=start, end=end)
    with open(value, "rb") as f:
        f.seek(start)
        return f.read(end - start)


def cache_directory() -> Path:
    """Node-local copies of objects that a library can open only as local files (ArrayRecord shards)."""
    return Path(tempfile.gettempdir()) / f"maxpar-{os.getuid()}" / "cache"


def local_copy(value: str, cache: Path | None = None) -> str:
    """`value` itself when local; else the path of a node-local copy of the object, downloaded once. The copy is
    named by the server, the URL and the object's generation, so a replaced object is fetched again, and written
    under a temporary name first, so that processes sharing the node never see half of it."""
    if not is_remote(value):
        return value
    info = _gcs().info(value)
    generation = info.get("generation") or info.get("etag") or info.get("mtime")
    version = f"{server_url()}/{value}@{generation}:{info.get('size')}"
    target = (cache or cache_directory()) / hashlib.sha256(version.encode()).hexdigest()[:32] / Path(value).name
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        _gcs().get_file(value, str(partial))
        os.replace(partial, target)
    return str(target)


def absolute(value: epath.Path) -> epath.Path:
    """`value` made absolute where that means something (a local path); a URL is already absolute, and
    `absolute()` would turn it into a local `./gs:/…`."""
    return value if is_remote(value) else value.absolute()


def server_url(environ: MutableMapping[str, str] = os.environ) -> str:
    """The GCS API server gs:// paths reach."""
    return environ.get(EMULATOR) or GCS_URL


def check_reachable(url: str, timeout_s: float = 5.0) -> str | None:
    """None if a TCP connection to `url`'s host opens within `timeout_s`, else why not. Asked first because gcsfs
    retries an unreachable server for half a minute before it raises."""
    parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        return f"cannot connect to {parsed.hostname}:{port}: {e.strerror or e}"
    return None


def copy_tree(source: Path, target: epath.Path) -> None:
    """Copy every file under local `source` to `target` (same relative names), overwriting."""
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        destination = target / file.relative_to(source).as_posix()
        destination.write_bytes(file.read_bytes())


@contextlib.contextmanager
def local_directory(source: epath.Path, patterns: Sequence[str] = ("*",)) -> Iterator[Path]:
    """`source` as a local directory while inside: itself when local; else a temporary copy of its top-level
    files matching `patterns` (for libraries that open files by local name, such as safetensors' memory map)."""
    if not is_remote(source):
        yield Path(source)
        return
    directory = Path(tempfile.mkdtemp(prefix="maxpar-download-"))
    try:
        for pattern in patterns:
            for file in source.glob(pattern):
                if file.is_file():
                    (directory / file.name).write_bytes(file.read_bytes())
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def staged_directory(target: epath.Path) -> Iterator[Path]:
    """A local directory standing for `target` while inside: itself when local; else a temporary directory copied
    up when the block succeeds, so that a failure leaves no half-written output in the bucket."""
    if not is_remote(target):
        yield Path(target)
        return
    directory = Path(tempfile.mkdtemp(prefix="maxpar-staging-"))
    try:
        yield directory
        copy_tree(directory, target)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class UploadPolicy:
    """When a `LocalMirror` of growing files is copied up: whenever `due` says so (at most once every
    `interval_s`), and whenever the caller must not lose what it has (a checkpoint save, the end of the run), which
    it reports with `uploaded`. Each upload copies whole files, so uploading every row would cost quadratically in
    the run's length; the clock starts when the mirror is seeded (it then equals its target)."""

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._last = clock()

    def due(self) -> bool:
        return self._clock() - self._last >= self.interval_s

    def uploaded(self) -> None:
        self._last = self._clock()


class Unreachable(OSError):
    """The storage server refused the connection: failed at once, without the libraries' own retries."""


def check_server(target: str | os.PathLike) -> None:
    """Raise `Unreachable` when `target` is on an object store whose server takes no connection now.

    gcsfs retries a refused connection for about half a minute (6 tries, 1 to 16 s apart) and TensorStore for
    minutes before either raises; asking first lets a `RetryPolicy` decide how long an outage is waited out.
    """
    if is_remote(target):
        problem = check_reachable(server_url(), timeout_s=2.0)
        if problem is not None:
            raise Unreachable(f"{problem} (server {server_url()})")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How often a write to storage is tried, and how long to wait between tries: `base_delay_s` doubling after
    every failure, at most `max_delay_s`. One object, so that every write that must survive a short outage (a
    checkpoint save) waits out the same outage the same way."""

    attempts: int = 4
    base_delay_s: float = 2.0
    max_delay_s: float = 60.0

    def delays(self) -> list[float]:
        """The waits after each failed attempt but the last."""
        return [min(self.base_delay_s * 2 ** i, self.max_delay_s) for i in range(self.attempts - 1)]

    def run(self, action: Callable[[], T], what: str, warn: Callable[[str], None],
            sleep: Callable[[float], None] = time.sleep) -> T:
        """`action()`, tried again after each failure while attempts are left, with a one-line warning naming
        `what` (the step and the URL) and the error; the last failure raises `StorageError`."""
        for attempt, delay in enumerate([*self.delays(), None], start=1):
            try:
                return action()
            except Exception as e:  # any failure of a write may be the outage; the last one is reported
                if delay is None:
                    raise StorageError(f"{what} failed {self.attempts} time(s); last: {describe_error(e)}") from e
                warn(f"{what} failed ({describe_error(e)}); attempt {attempt + 1} of {self.attempts} in {delay:g} s")
                sleep(delay)
        raise AssertionError("unreachable")  # the loop returns or raises


class StorageError(OSError):
    """A write to storage that failed for good (every attempt of its `RetryPolicy`, or a mirror's last copy); the
    trainer prints it in one line and exits with status 74."""


def describe_error(error: BaseException, limit: int = 300) -> str:
    """One line: the root cause's type and the start of its first line.

    The root cause says what is wrong ("Connect call failed", "Requested byte range ... is not valid for value
    of size ..." for a truncated file); the outer errors of TensorStore and Orbax are a page of their spec.
    """
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text if len(text) <= limit else text[:limit] + " ..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def close_after(close: Callable[[], None], warn: Callable[[str], None]) -> None:
    """`close()` at the end of a block (in a `finally`). When the block is already failing, a failure of `close`
    (the storage unreachable) is a warning, so that the error that ended the block is the one reported."""
    if sys.exc_info()[1] is None:
        close()
        return
    try:
        close()
    except Exception as e:  # whatever closing raised, the first error is what the user must see
        warn(f"while stopping: {describe_error(e)}")


class LocalMirror:
    """A local directory that stands for `target`: `target` itself when it is local; else a temporary directory,
    seeded with `names` from `target` where they exist (so appends continue them), whose files `sync` copies up.

    For what needs a local file system: appended files (metrics.jsonl, libraries.log), TensorBoard's event writer
    (tensorboardX's own GCS writer is broken), profiler traces.
    """

    def __init__(self, target: epath.Path, names: Sequence[str] = ()):
        self.target = target
        self.remote = is_remote(target)
        if not self.remote:
            self.directory = Path(target)
            return
        self.directory = Path(tempfile.mkdtemp(prefix="maxpar-mirror-"))
        for name in names:
            if (target / name).exists():
                (self.directory / name).parent.mkdir(parents=True, exist_ok=True)
                (self.directory / name).write_bytes((target / name).read_bytes())

    def sync(self) -> None:
        if self.remote:
            check_server(self.target)
            copy_tree(self.directory, self.target)

    def close(self) -> None:
        """Copy up a last time and remove the temporary directory; when that copy fails the directory is kept
        (it holds the only copy) and the error names it."""
        if self.remote:
            try:
                self.sync()
            except Exception as e:
                raise StorageError(f"could not copy {self.directory} up to {self.target} ({describe_error(e)}); the "
                                   f"files are kept there") from e
            shutil.rmtree(self.directory, ignore_errors=True)
