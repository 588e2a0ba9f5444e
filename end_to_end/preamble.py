"""The end-to-end scripts' shared start, before they import JAX.

    from preamble import prepare  # end_to_end/preamble.py: a script's folder is sys.path[0]
    REPO = prepare(devices=8)

simulates `devices` CPU devices (None: leaves JAX's devices alone), keeps JAX to the CPU where libtpu is installed
but no TPU or GPU is attached (as the entry points do: no libtpu start-up warnings), puts the repository on
sys.path, and returns its path. The micro model, corpus and child-process helpers the scripts share with the tests are
`maxpar.tools.testbed`'s: no script imports tests/.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def prepare(devices: int | None = 8) -> Path:
    if "jax" in sys.modules and devices is not None:
        raise RuntimeError("preamble.prepare must run before JAX is imported: the device count is fixed then")
    sys.path.insert(0, str(REPO))
    from maxpar.host.devices import cpu_unless_accelerators, simulate_cpu_devices
    cpu_unless_accelerators()
    if devices is not None:
        simulate_cpu_devices(devices)
    return REPO
