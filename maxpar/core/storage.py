"""Paths a user names (output directories, checkpoints, config files): local or on an object store (gs://).

Why one module: `pathlib.Path("gs://b/run")` silently means the local folder `gs:/b/run`, so every user path goes
through `path()` (an `etils.epath.Path`, which reaches gs:// through gcsfs and hands Orbax/TensorStore the same
URL). Files that need a local file system (appended logs, TensorBoard events, traces) are written to a
`LocalMirror` and copied up. `STORAGE_EMULATOR_HOST` points every gs:// read and write at a GCS API server such
as an emulator: `use_emulator` derives the variables TensorStore and gcsfs read from it.
"""

from __future__ import annotations

import glob
import io
import os
import shutil
import socket
import tempfile
import urllib.parse
from collections.abc import MutableMapping, Sequence
from pathlib import Path

from etils import epath

REMOTE_SCHEMES = ("gs://",)
EMULATOR = "STORAGE_EMULATOR_HOST"
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


def glob_files(pattern: str) -> list[str]:
    """The files `pattern` matches (`**` recursive), sorted; a gs:// pattern is expanded by gcsfs."""
    if not is_remote(pattern):
        return sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    use_emulator()
    import fsspec
    found = fsspec.filesystem("gs").glob(pattern, detail=True)
    return sorted(f"gs://{name}" for name, info in found.items() if info.get("type") == "file")


def read_text(value: str) -> str:
    """A whole text file, read as `open(value, encoding="utf-8", errors="replace")` reads it (universal newlines,
    undecodable bytes as U+FFFD), wherever it is."""
    if not is_remote(value):
        with open(value, encoding="utf-8", errors="replace") as f:
            return f.read()
    return io.TextIOWrapper(io.BytesIO(path(value).read_bytes()), encoding="utf-8", errors="replace").read()


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
            copy_tree(self.directory, self.target)

    def close(self) -> None:
        """Copy up a last time and remove the temporary directory."""
        if self.remote:
            try:
                self.sync()
            finally:
                shutil.rmtree(self.directory, ignore_errors=True)
