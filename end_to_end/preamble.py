"""The end-to-end scripts' shared start, before they import JAX.

    from preamble import prepare  # end_to_end/preamble.py: a script's folder is sys.path[0]
    REPO = prepare(devices=8)

simulates `devices` CPU devices (None: leaves JAX's devices alone), puts the repository and, with
`tests` (the default), tests/ (the test helpers) on sys.path, and returns the repository's path.
Scripts that only need the path (they run everything in child processes) import `REPO` alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def prepare(devices: int | None = 8, tests: bool = True) -> Path:
    if "jax" in sys.modules and devices is not None:
        raise RuntimeError("preamble.prepare must run before JAX is imported: the device count is fixed then")
    sys.path[:0] = [str(REPO), str(REPO / "tests")] if tests else [str(REPO)]
    if devices is not None:
        from maxpar.host.devices import simulate_cpu_devices
        simulate_cpu_devices(devices)
    return REPO
