"""How many simulated CPU devices XLA creates: one flag, for this process or a child's environment.

Imports nothing heavy, so scripts and tests can call it before JAX initializes.
"""

from __future__ import annotations

import os
import re

_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S+")


def with_device_count(xla_flags: str, count: int) -> str:
    """`xla_flags` asking for exactly `count` host devices: an earlier count is replaced, other flags kept."""
    return " ".join(_DEVICE_COUNT.sub("", xla_flags).split() + [f"--xla_force_host_platform_device_count={count}"])


def simulate_cpu_devices(count: int) -> None:
    """Give this process `count` simulated CPU devices (JAX on the CPU unless told otherwise); before JAX starts."""
    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), count)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
