"""A real GCS JSON-API server on loopback for the tests: gcp-storage-emulator (the `test` extra), in memory."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from maxpar.core import storage

# What maxpar derives from STORAGE_EMULATOR_HOST (maxpar/core/storage.py): left out of the environment of the processes
# the tests start, so that they derive it themselves.
DERIVED = ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


# The emulator as a server TensorStore can use: its media downloads lack the `x-goog-generation` header that GCS sends
# and TensorStore's OCDBT reads ("Malformed StorageGeneration" otherwise), so the launcher adds it.
LAUNCHER = """
import sys
from gcp_storage_emulator.handlers import objects
original = objects.download
def download(request, response, storage, *args, **kwargs):
    original(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:
        return
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj.get("metageneration") or "1")
objects.download = download
from gcp_storage_emulator.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def emulator(bucket: str, log: Path, timeout_s: float = 60) -> Iterator[str]:
    """Run the emulator with an empty `bucket` while inside; yields its URL (the STORAGE_EMULATOR_HOST value)."""
    port = free_port()
    command = [sys.executable, "-c", LAUNCHER, "start", "--host=127.0.0.1",
               f"--port={port}", "--in-memory", f"--default-bucket={bucket}"]
    with open(log, "w", encoding="utf-8") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while storage.check_reachable(url, timeout_s=1) is not None:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gcp-storage-emulator did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def process_env(url: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment for a maxpar process that reaches the emulator through STORAGE_EMULATOR_HOST alone."""
    env = {key: value for key, value in (os.environ if base is None else base).items() if key not in DERIVED}
    return {**env, storage.EMULATOR: url}


def filesystem(url: str):
    """A gcsfs client on the emulator at `url`, its listings uncached (other processes write the bucket)."""
    import gcsfs
    return gcsfs.GCSFileSystem(endpoint_url=url, token="anon", skip_instance_cache=True, use_listings_cache=False)
