"""Which devices JAX starts with: how many simulated CPU devices XLA creates and how long their collectives
may wait (flags for this process or a child's environment), and the CPU alone where libtpu is installed but
no accelerator is attached.

Imports nothing heavy, so scripts and tests can call it before JAX initializes.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import NamedTuple

_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S+")

# XLA:CPU runs each simulated device's part of a collective on its own thread and waits for all of them at a
# rendezvous: it logs "may be stuck" after the warning timeout and, the termination timeout after that warning,
# aborts the process (exit 134, "Termination timeout for `all reduce ...` of 40 seconds exceeded": 40 s counted from
# the warning, so 60 s after the first thread arrived, by XLA's defaults). A device thread can lag that long on a
# loaded machine (8 devices sharing 2 busy cores, a long context): nothing is stuck then, only late. These give a
# loaded laptop ten minutes; a genuinely stuck collective still ends.
COLLECTIVE_WARN_S = 60
COLLECTIVE_TERMINATE_S = 540
_WARN_FLAG = "xla_cpu_collective_call_warn_stuck_timeout_seconds"
_TERMINATE_FLAG = "xla_cpu_collective_call_terminate_timeout_seconds"
_COLLECTIVE_TIMEOUTS = {_WARN_FLAG: COLLECTIVE_WARN_S, _TERMINATE_FLAG: COLLECTIVE_TERMINATE_S}
XLA_DEFAULTS = {_WARN_FLAG: 20, _TERMINATE_FLAG: 40}  # XLA's own, where the flags do not set them


class CollectiveTimeouts(NamedTuple):
    """XLA:CPU's rendezvous timeouts, as XLA_FLAGS set them: a warning after `warn_s`, the abort `terminate_s` later."""

    warn_s: int
    terminate_s: int

    @classmethod
    def of(cls, xla_flags: str) -> CollectiveTimeouts:
        def value(flag: str) -> int:
            found = re.findall(rf"--{flag}=(\d+)", xla_flags)
            return int(found[-1]) if found else XLA_DEFAULTS[flag]
        return cls(value(_WARN_FLAG), value(_TERMINATE_FLAG))

    @property
    def abort_s(self) -> int:
        """Seconds from the first device thread's arrival at a collective to the abort, if another never comes."""
        return self.warn_s + self.terminate_s


def late_collective_words(timeouts: CollectiveTimeouts) -> str:
    """What an abort of a late collective means, said before it happens: the process then dies inside XLA, where
    maxpar can add nothing."""
    return (f"if XLA then aborts (exit 134, \"Termination timeout for `all reduce ...` of {timeouts.terminate_s} "
            f"seconds exceeded\"), the simulated CPU devices' threads waited {timeouts.abort_s} s for each other on "
            f"an overloaded machine: rerun when it is quieter (the run resumes from its newest checkpoint), or allow "
            f"more with XLA_FLAGS=--{_TERMINATE_FLAG}=N")


def with_collective_timeouts(xla_flags: str) -> str:
    """`xla_flags` plus the simulated devices' collective timeouts above, where the flags do not set them already."""
    given = xla_flags.split()
    return " ".join(given + [f"--{flag}={seconds}" for flag, seconds in _COLLECTIVE_TIMEOUTS.items()
                             if not any(g.startswith(f"--{flag}=") for g in given)])


def with_device_count(xla_flags: str, count: int) -> str:
    """`xla_flags` asking for exactly `count` host devices, with room for their collectives to wait: an earlier
    count is replaced, other flags kept."""
    return with_collective_timeouts(" ".join(_DEVICE_COUNT.sub("", xla_flags).split()
                                             + [f"--xla_force_host_platform_device_count={count}"]))


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
