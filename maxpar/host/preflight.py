"""Checks a run makes before any device work, so that a mistake costs seconds and gives a clear message.

Each raises ConfigError (exit status 2) naming the key, the value and what would work.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from maxpar.core import storage
from maxpar.core.config import Config, ConfigError
from maxpar.host.devices import simulate_cpu_devices, with_collective_timeouts


def check_output_directory(config: Config) -> None:
    """base_output_directory (and the run's directory when it exists) must be a directory this process can write.

    Checked by writing a file rather than with os.access, which says yes to root on a read-only file
    system; an unwritable directory otherwise surfaces as a PermissionError deep inside the first save.
    """
    key, value = "base_output_directory", config.base_output_directory
    if storage.is_remote(value):
        check_remote_directory(key, value)
        return
    base = Path(value).expanduser()
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{key}={value!r}: cannot create it ({e.strerror or e}); choose a directory you can "
                          f"write") from None
    run_dir = base / config.run_name if config.run_name else base
    directory = run_dir if run_dir.is_dir() else base
    try:
        with tempfile.TemporaryFile(dir=directory, prefix=".maxpar-write-check-"):
            pass
    except OSError as e:
        where = "" if directory == base else f" (the run directory {directory})"
        raise ConfigError(f"{key}={value!r}{where}: cannot write there ({e.strerror or e}); choose a directory you "
                          f"can write") from None


def check_remote_directory(key: str, value: str) -> None:
    """A gs:// directory must be on a reachable server, in a bucket that exists, writable with this process's
    credentials: checked by writing and deleting one object, so that a wrong bucket name or a missing login is
    one line now rather than a traceback from the first save. The bucket is never created."""
    url = storage.server_url()
    problem = storage.check_reachable(url)
    if problem is None:
        probe = storage.path(value) / f".maxpar-write-check-{os.getpid()}"
        try:
            probe.write_text("")
            probe.unlink()
        except Exception as e:  # gcsfs and google-auth raise many kinds (OSError, HttpError, RefreshError, ...)
            problem = remote_problem(value, e)
    if problem is not None:
        raise ConfigError(f"{key}={value!r}: cannot write there ({problem}; server {url}); check the bucket name "
                          f"and your credentials (gcloud auth application-default login), or set "
                          f"{storage.EMULATOR} for an emulator") from None


def remote_problem(value: str, error: Exception) -> str:
    """One phrase for a failed write to gs://BUCKET/…: missing bucket, no credentials, no permission, or the error.
    Without credentials gcsfs goes on anonymously, which the server refuses with 401."""
    bucket = value.removeprefix("gs://").split("/", 1)[0]
    text = " ".join(str(error).split())[:200]
    code = getattr(error, "code", None)
    if isinstance(error, FileNotFoundError) or code == 404:
        return f"no bucket {bucket!r}"
    if (code == 401 or "anonymous caller" in text.lower() or "credentials" in text.lower()
            or type(error).__name__ in ("DefaultCredentialsError", "RefreshError")):
        return f"no usable credentials: {text}"
    if isinstance(error, PermissionError) or code == 403 or text.startswith("Forbidden"):  # gcsfs: OSError on 403
        return f"permission denied: {text}"
    return f"{type(error).__name__}: {text}"


def _jax_started() -> bool:
    from jax._src import xla_bridge  # the only way to ask whether the backends already started
    return xla_bridge.backends_are_initialized()


def apply_simulated_devices(config: Config) -> None:
    """num_simulated_devices=N: give this process N CPU devices, which must happen before JAX starts its backends.

    Refused where it cannot take effect: JAX already running (in-process callers set XLA_FLAGS themselves) or
    asked for another platform (JAX_PLATFORMS); it makes the run use the CPU even where accelerators exist.
    Devices simulated by hand (XLA_FLAGS=--xla_force_host_platform_device_count=N) get the same collective
    timeouts (maxpar.host.devices).
    """
    count = config.num_simulated_devices
    if not count:
        flags = os.environ.get("XLA_FLAGS", "")
        if "--xla_force_host_platform_device_count=" in flags and not _jax_started():  # simulated by hand
            os.environ["XLA_FLAGS"] = with_collective_timeouts(flags)
        return
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms not in ("", "cpu"):
        raise ConfigError(f"num_simulated_devices={count} simulates CPU devices, but JAX_PLATFORMS={platforms!r}; "
                          f"use num_simulated_devices=0 on accelerators")
    if _jax_started():
        raise ConfigError(f"num_simulated_devices={count}: JAX has already started in this process, so its device "
                          f"count is fixed; set it before JAX starts (python -m maxpar.train ... does)")
    simulate_cpu_devices(count)
