"""Checks a run makes before any device work, so that a mistake costs seconds and gives a clear message.

Each raises ConfigError (exit status 2) naming the key, the value and what would work.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import jax

from maxpar.config import Config, ConfigError
from maxpar.plan.fit import check_local_fit
from maxpar.tools.host_devices import simulate_cpu_devices


def check_output_directory(config: Config) -> None:
    """base_output_directory (and the run's directory when it exists) must be a directory this process can write.

    Checked by writing a file rather than with os.access, which says yes to root on a read-only file
    system; an unwritable directory otherwise surfaces as a PermissionError deep inside the first save.
    """
    key, value = "base_output_directory", config.base_output_directory
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


def apply_simulated_devices(config: Config) -> None:
    """num_simulated_devices=N: give this process N CPU devices, which must happen before JAX starts its backends.

    Refused where it cannot take effect: JAX already running (in-process callers set XLA_FLAGS themselves) or
    asked for another platform (JAX_PLATFORMS); it makes the run use the CPU even where accelerators exist.
    """
    count = config.num_simulated_devices
    if not count:
        return
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms not in ("", "cpu"):
        raise ConfigError(f"num_simulated_devices={count} simulates CPU devices, but JAX_PLATFORMS={platforms!r}; "
                          f"use num_simulated_devices=0 on accelerators")
    from jax._src import xla_bridge  # the only way to ask whether the backends already started
    if xla_bridge.backends_are_initialized():
        raise ConfigError(f"num_simulated_devices={count}: JAX has already started in this process, so its device "
                          f"count is fixed; set it before JAX starts (python -m maxpar.train ... does)")
    simulate_cpu_devices(count)


def check_memory(config: Config) -> None:
    """Refuse (ConfigError) a config whose planned memory per device exceeds what the devices have."""
    check_local_fit(config, jax.devices(), jax.local_devices())
