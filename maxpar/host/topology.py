"""TPU topologies by their Cloud names (`v5p-256`, `v5e-256`, `v6e-256`, `v4-128`, `tpu7x-64`), built by libtpu on
any machine: devices that XLA:TPU compiles for without a TPU (`compile_topology`, `maxpar.plan --verify`).

Names follow Cloud TPU (and MaxText's `compile_topology`): the number counts TensorCores where a chip has two
(v4, v5p: one megacore device per chip, so `v5p-256` is 128 chips; TPU7x: each core is its own device, so
`tpu7x-64` is 64 devices on 32 chips) and chips where it has one (v5e, v6e). The slice shape is derived, not
listed: under 64 chips the 3D families use the small slices 2x2x1 .. 2x4x4, from 64 on whole 4x4x4 cubes in the
most cubic arrangement; the 2D families take 1x1, 2x2, 2x4 and then the most square power-of-two shape.

libtpu prints start-up warnings from C++ on file descriptor 2 before its own logging starts (no TPU environment
variables, "Logging before InitGoogle()"), so the topology is made with fd 2 pointed at a file: they land in the
run's libraries.log instead of the terminal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from maxpar.core.config import ConfigError

# Two processes that load libtpu at once (two test workers, a compile beside another) otherwise fail on its
# machine-wide lock file: compiling for a topology needs no exclusive use of a chip.
LIBTPU_ENV = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_STDERR_LOG_LEVEL": "3", "TPU_MIN_LOG_LEVEL": "3",
              "TF_CPP_MIN_LOG_LEVEL": "3"}


@dataclasses.dataclass(frozen=True)
class Family:
    """One TPU generation as libtpu and Cloud name it."""

    prefix: str                   # Cloud's name before the '-'
    libtpu_name: str              # libtpu's topology prefix
    dims: int                     # torus dimensions
    cores_per_device_name: int    # how many of the name's number make one device (2: megacore chips)
    devices_per_chip: int         # jax devices on one chip
    chip_config_name: str | None  # libtpu's chip config (megacore: two cores as one device)
    hardware: str                 # configs/hardware profile

    def name_count(self, devices: int) -> int:
        return devices * self.cores_per_device_name


FAMILIES = {f.prefix: f for f in (
    Family("v4", "v4", 3, 2, 1, "megacore", "tpu-v4"),
    Family("v5p", "v5", 3, 2, 1, "megacore", "tpu-v5p"),
    Family("v5e", "v5e", 2, 1, 1, None, "tpu-v5e"),
    Family("v6e", "v6e", 2, 1, 1, None, "tpu-v6e"),
    Family("tpu7x", "tpu7x", 3, 1, 2, "default", "tpu-7x"),
)}
ALIASES = {"v5litepod": "v5e"}
SMALL_3D = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}  # chips -> slice below a cube
CUBE = 64                                                                          # 4x4x4 chips
MAX_2D = 256                                                                       # 16x16: a v5e/v6e pod


@dataclasses.dataclass(frozen=True)
class TopologySpec:
    """A resolved topology name: what libtpu builds and which hardware profile it is."""

    name: str                            # as the user wrote it, e.g. v5p-256
    family: Family
    shape: tuple[int, ...]               # chips along each torus axis
    chips_per_host_bounds: tuple[int, int, int]

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def devices_per_slice(self) -> int:
        return self.chips * self.family.devices_per_chip

    @property
    def libtpu_topology(self) -> str:
        return f"{self.family.libtpu_name}:{'x'.join(map(str, self.shape))}"

    def describe(self, num_slices: int) -> str:
        per = f"{self.devices_per_slice} devices ({self.chips} chips, {self.libtpu_topology})"
        return f"{self.name}: {per}" + (f" x {num_slices} slices" if num_slices > 1 else "")


def valid_names() -> str:
    """The accepted forms, for an error message."""
    return ("v5p-N and v4-N (N = 2 x chips: 8, 16, 32, 64, then multiples of 128, e.g. v5p-256 = 128 chips), "
            "v5e-N and v6e-N (N = chips: 1, 4, 8, 16, 32, 64, 128, 256), tpu7x-N (N = devices = 2 x chips: 2, 8, "
            "16, 32, 64, then multiples of 128)")


def _most_cubic(n: int) -> tuple[int, int, int]:
    """The factorisation a <= b <= c of n with the smallest c / a (ties: the smaller c)."""
    best = None
    for a in range(1, n + 1):
        if n % a:
            continue
        for b in range(a, n // a + 1):
            if (n // a) % b or n // a // b < b:
                continue
            c = n // a // b
            if best is None or (c / a, c) < (best[2] / best[0], best[2]):
                best = (a, b, c)
    return best


def _shape_3d(chips: int) -> tuple[int, ...] | None:
    if chips in SMALL_3D:
        return SMALL_3D[chips]
    if chips % CUBE:
        return None
    return tuple(4 * d for d in _most_cubic(chips // CUBE))


def _shape_2d(chips: int) -> tuple[int, ...] | None:
    if chips < 1 or chips > MAX_2D or chips & (chips - 1):
        return None
    exponent = chips.bit_length() - 1
    return (2 ** (exponent // 2), 2 ** (exponent - exponent // 2))


def parse_topology(name: str, key: str = "compile_topology") -> TopologySpec:
    """`v5p-256` -> its family, chips and slice shape; anything else is a ConfigError listing the valid forms."""
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", name.strip().lower())
    prefix = ALIASES.get(match.group(1), match.group(1)) if match else None
    if not match or prefix not in FAMILIES:
        raise ConfigError(f"{key}={name!r}: not a TPU topology name; valid: {valid_names()}")
    family, count = FAMILIES[prefix], int(match.group(2))
    devices, rest = divmod(count, family.cores_per_device_name)
    chips, rest_chips = divmod(devices, family.devices_per_chip)
    shape = None
    if not rest and not rest_chips and chips:
        shape = _shape_3d(chips) if family.dims == 3 else _shape_2d(chips)
    if shape is None:
        raise ConfigError(f"{key}={name!r}: no {prefix} slice of that size; valid: {valid_names()}")
    hosts = (1, 1, 1) if chips == 1 else (2, 2, 1)
    return TopologySpec(name=name, family=family, shape=shape, chips_per_host_bounds=hosts)


def topology_for_hardware(hardware: str, devices_per_slice: int) -> TopologySpec | None:
    """The topology of `devices_per_slice` devices of a TPU hardware profile (tpu-v5p, 128 -> v5p-256); None for a
    profile no TPU family names. ConfigError when no slice has that many devices."""
    family = next((f for f in FAMILIES.values() if f.hardware == hardware), None)
    if family is None:
        return None
    return parse_topology(f"{family.prefix}-{family.name_count(devices_per_slice)}", key="num_devices")


def libtpu_installed() -> bool:
    """Whether libtpu (the TPU compiler) is importable: `pip install maxpar[tpu]`."""
    return importlib.util.find_spec("libtpu") is not None


def set_libtpu_environment() -> None:
    """libtpu's environment, set before it loads: shared loading, its own logging at ERROR and above only."""
    for key, value in LIBTPU_ENV.items():
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def stderr_to(path: Path | None) -> Iterator[None]:
    """Point file descriptor 2 at `path` (appended; a temporary file when None) for the block: C++ libraries that
    print before their logging starts write there, not on the terminal."""
    sys.stderr.flush()
    saved = os.dup(2)
    if path is None:
        target = tempfile.TemporaryFile(mode="w+b")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        target = open(path, "ab")
    try:
        os.dup2(target.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        target.close()


def _process_environment() -> dict[str, str]:
    """The C library's environment of this process (`os.environ` does not see what native code sets)."""
    import ctypes

    entries = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    found, i = {}, 0
    while entries[i]:
        key, _, value = entries[i].decode(errors="replace").partition("=")
        found[key], i = value, i + 1
    return found


@contextlib.contextmanager
def environment_kept() -> Iterator[None]:
    """Undo what native code sets in the process environment during the block. libtpu, made to describe a topology
    on a machine that is not a TPU VM, sets TPU_WORKER_ID, CLOUD_TPU_TASK_ID and CLOUD_TPU_ACCELERATOR_TYPE to its
    warning text ("WARNING: could not determine TPU worker number ..."), which every process started afterwards
    would inherit, and maxpar's own multi-host contract would then read as this host's worker id."""
    before = _process_environment()
    try:
        yield
    finally:
        after = _process_environment()
        for key in after.keys() - before.keys():
            os.unsetenv(key)
            os.environ.pop(key, None)
        for key, value in before.items():
            if after.get(key) != value:
                os.putenv(key, value)


def topology_devices(spec: TopologySpec, num_slices: int = 1, log: Path | None = None) -> list:
    """The devices of `num_slices` slices of `spec`, made by libtpu (no TPU needed); its start-up lines go to
    `log`. ConfigError when libtpu is missing or refuses the topology."""
    if num_slices < 1:
        raise ConfigError(f"compile_topology_num_slices={num_slices}: must be at least 1")
    if not libtpu_installed():
        raise ConfigError(f"compile_topology={spec.name} compiles with libtpu, which is not installed: "
                          f"pip install 'maxpar[tpu]' (or bash install.sh tpu)")
    set_libtpu_environment()
    from jax.experimental import topologies  # after the environment: libtpu reads it when it loads
    kwargs = {"chip_config_name": spec.family.chip_config_name} if spec.family.chip_config_name else {}
    try:
        with stderr_to(log), environment_kept():
            topology = topologies.get_topology_desc(
                platform="tpu", topology_name=spec.libtpu_topology, chips_per_host_bounds=spec.chips_per_host_bounds,
                num_slices=num_slices, **kwargs)
    except Exception as e:  # XlaRuntimeError / RuntimeError from the plugin: one line
        raise ConfigError(f"compile_topology={spec.name}: libtpu could not build {spec.libtpu_topology} x "
                          f"{num_slices} slice(s): {str(e).splitlines()[0]}") from None
    return list(topology.devices)

