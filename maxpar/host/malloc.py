"""glibc malloc settings for a training process on XLA:CPU: keep each step's freed buffers mapped.

XLA:CPU allocates a step's buffers afresh every step. On a multi-device CPU mesh those come from glibc's
malloc, which with its defaults unmaps or trims the freed memory and faults it in again the next step. A
32 MiB mmap threshold, a 1 GiB trim threshold and a 64 MiB top pad keep it mapped: about a third of the page
faults, and a faster step (docs/performance.md, "Levers").

Process-wide, so only processes maxpar owns apply it (`python -m maxpar.train` and the benchmark's workers;
`cpu_malloc_tuning`), on the CPU backend, with glibc, and never over the user's own malloc settings.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from typing import Any

# mallopt parameters (glibc's malloc.h) and the values set; each has an environment twin a user may set instead.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20}
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def on_glibc() -> bool:
    """Whether this process runs on glibc (os.confstr names only glibc; musl and macOS have no such name)."""
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError, AttributeError):
        return False


def user_settings(env: Mapping[str, str]) -> list[str]:
    """The malloc variables the user set (GLIBC_TUNABLES when it names a glibc.malloc tunable): theirs stand."""
    names = [name for name in USER_VARIABLES if name in env]
    return names + (["GLIBC_TUNABLES"] if "glibc.malloc." in env.get("GLIBC_TUNABLES", "") else [])


def apply(libc: Any) -> None:
    """Set SETTINGS through `libc.mallopt` (which returns 1 on success)."""
    refused = [param for param, value in SETTINGS.items() if libc.mallopt(param, value) != 1]
    if refused:
        raise OSError(f"mallopt refused parameter(s) {refused}")


def tune(enabled: bool, platform: str, env: Mapping[str, str] | None = None, libc: Any = None) -> str | None:
    """Apply SETTINGS when the key is on, the backend is XLA:CPU, the C library glibc and the user set none of its
    variables (`libc`: the C library to call, default this process's). Returns a line for the run's log when it
    applied them or when the user's variables kept it from doing so, else None."""
    if not enabled or platform != "cpu" or not on_glibc():
        return None
    theirs = user_settings(os.environ if env is None else env)
    if theirs:
        return f"glibc malloc left to your {', '.join(theirs)}; cpu_malloc_tuning not applied"
    apply(ctypes.CDLL(None) if libc is None else libc)
    return ("glibc malloc keeps each step's freed buffers mapped (cpu_malloc_tuning, on by default; "
            "set cpu_malloc_tuning=false for glibc's defaults)")
