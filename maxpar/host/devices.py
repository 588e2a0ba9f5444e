"""Which devices JAX starts with: how many simulated CPU devices XLA creates (one flag, for this process or a
child's environment), and the CPU alone where libtpu is installed but no accelerator is attached.

Imports nothing heavy, so scripts and tests can call it before JAX initializes.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S+")


def with_device_count(xla_flags: str, count: int) -> str:
    """`xla_flags` asking for exactly `count` host devices: an earlier count is replaced, other flags kept."""
    return " ".join(_DEVICE_COUNT.sub("", xla_flags).split() + [f"--xla_force_host_platform_device_count={count}"])


def simulate_cpu_devices(count: int) -> None:
    """Give this process `count` simulated CPU devices (JAX on the CPU unless told otherwise); before JAX starts."""
    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), count)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


# PCI vendor of Google's TPU chips, and the device files of the GPUs JAX's own plugins look for.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def tpu_chips_attached() -> bool:
    """Whether a Google accelerator is on this machine's PCI bus (JAX checks the same before it starts libtpu)."""
    for vendor in Path("/sys/bus/pci/devices").glob("*/vendor"):
        try:
            if vendor.read_text().strip() == _GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


def cpu_unless_accelerators() -> str | None:
    """With libtpu installed (the `tpu` extra, for compile_topology) JAX tries to start a TPU backend in every
    process, and on a machine without TPU chips libtpu prints warnings and errors on stderr before JAX falls back
    to the CPU. Where neither a TPU chip nor a GPU is present the CPU is the only backend that can start, so
    JAX_PLATFORMS=cpu changes nothing but that noise: set it then, unless the user chose platforms. Returns the
    value set, or None. Call before JAX starts its backends (compiling for a topology still works: it needs no
    TPU backend)."""
    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
        return None
    if tpu_chips_attached() or any(os.path.exists(f) for f in _GPU_DEVICE_FILES):
        return None
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported already: its config read the environment then
        import jax
        from jax._src import xla_bridge
        if not xla_bridge.backends_are_initialized() and not jax.config.jax_platforms:
            jax.config.update("jax_platforms", "cpu")
    return "cpu"
