"""A real GCS JSON-API server on loopback for the tests: gcp-storage-emulator (the `test` extra), in memory or on disk."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from maxpar.core import storage
from maxpar.tools.emulator import LAUNCHER, Server, free_port  # noqa: F401 (the tests' names)

# What maxpar derives from STORAGE_EMULATOR_HOST (maxpar/core/storage.py): left out of the environment of the processes
# the tests start, so that they derive it themselves.
DERIVED = ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


@contextlib.contextmanager
def emulator(bucket: str, log: Path, timeout_s: float = 60) -> Iterator[str]:
    """Run the emulator with an empty `bucket` in memory while inside; yields its URL."""
    server = Server(bucket, log)
    try:
        yield server.start(timeout_s)
    finally:
        server.stop()


def process_env(url: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment for a maxpar process that reaches the emulator through STORAGE_EMULATOR_HOST alone."""
    env = {key: value for key, value in (os.environ if base is None else base).items() if key not in DERIVED}
    return {**env, storage.EMULATOR: url}


def filesystem(url: str):
    """A gcsfs client on the emulator at `url`, its listings uncached (other processes write the bucket)."""
    import gcsfs
    return gcsfs.GCSFileSystem(endpoint_url=url, token="anon", skip_instance_cache=True, use_listings_cache=False)
