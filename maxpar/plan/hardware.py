"""Hardware profiles (`configs/hardware/NAME.yml`) and how a mesh lands on their interconnect.

Profiles are data so that a new chip is a new YAML file with sourced numbers,
not a code change. The bandwidth a mesh axis gets depends on how many torus
axes it spans (the seed: "if we dedicate all three axes ... we 3x our
bandwidth"), so the layout of mesh axes on the torus is modelled here too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from omegaconf import OmegaConf

from maxpar.core.config import ConfigError

HARDWARE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"
TOPOLOGIES = ("torus", "switch")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator and its networks; every rate is per device unless named per host."""

    name: str
    platform: str                     # tpu | gpu
    device_kind: str                  # jax's device_kind, to match local devices
    peak_flops: float                 # dense bf16 FLOP/s
    peak_fp8_flops: float             # dense FLOP/s of fp8 matmuls (quantization=fp8)
    hbm_bytes: float
    hbm_bandwidth: float              # bytes/s
    ici_bandwidth: float              # bytes/s one device moves along one torus axis (or into NVSwitch)
    ici_topology: str                 # torus | switch
    max_slice_shape: tuple[int, ...]  # largest torus (or NVLink domain) one slice can be
    max_devices_per_slice: int
    devices_per_host: int
    dcn_bandwidth_per_host: float     # bytes/s

    @property
    def dcn_bandwidth_per_device(self) -> float:
        """A device's share of its host's NICs when every device of the host sends at once."""
        return self.dcn_bandwidth_per_host / self.devices_per_host

    @property
    def hbm_intensity(self) -> float:
        """FLOPs per byte of HBM traffic (below this per-device batch a matmul is memory-bound)."""
        return self.peak_flops / self.hbm_bandwidth


_NUMBERS = ("peak_flops", "peak_fp8_flops", "hbm_bytes", "hbm_bandwidth", "ici_bandwidth", "dcn_bandwidth_per_host")
_INTS = ("max_devices_per_slice", "devices_per_host")


def available(directory: Path = HARDWARE_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.yml"))


def load_hardware(name: str, directory: Path = HARDWARE_DIR) -> Hardware:
    """Read and check `directory/NAME.yml`; bad or missing files are ConfigErrors."""
    path = directory / f"{name}.yml"
    if not name or not path.is_file():
        raise ConfigError(f"hardware={name!r}: no profile {path}; available: {', '.join(available(directory))}")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as e:  # yaml errors come in many types
        raise ConfigError(f"cannot parse hardware profile {path}: {e}") from None
    fields = {f.name for f in dataclasses.fields(Hardware)} - {"name"}
    if not isinstance(data, dict) or set(data) != fields:
        have = set(data) if isinstance(data, dict) else set()
        raise ConfigError(f"hardware profile {path}: missing keys {sorted(fields - have)}, "
                          f"unknown keys {sorted(have - fields)}")
    for key in _NUMBERS:
        if not isinstance(data[key], (int, float)) or isinstance(data[key], bool) or data[key] <= 0:
            raise ConfigError(f"hardware profile {path}: {key}={data[key]!r} must be a positive number")
    for key in _INTS:
        if not isinstance(data[key], int) or data[key] < 1:
            raise ConfigError(f"hardware profile {path}: {key}={data[key]!r} must be a positive integer")
    if data["ici_topology"] not in TOPOLOGIES:
        raise ConfigError(f"hardware profile {path}: ici_topology must be one of {', '.join(TOPOLOGIES)}")
    shape = data["max_slice_shape"]
    if not isinstance(shape, list) or not shape or not all(isinstance(d, int) and d >= 1 for d in shape):
        raise ConfigError(f"hardware profile {path}: max_slice_shape must be a list of positive integers")
    if math.prod(shape) < data["max_devices_per_slice"]:
        raise ConfigError(f"hardware profile {path}: max_slice_shape {shape} holds fewer than "
                          f"max_devices_per_slice={data['max_devices_per_slice']} devices")
    return Hardware(name=name, **{**data, "max_slice_shape": tuple(shape),
                                  **{k: float(data[k]) for k in _NUMBERS}})


def hardware_for_device_kind(device_kind: str, directory: Path = HARDWARE_DIR) -> str | None:
    """The profile whose device_kind is the longest match for a jax device_kind, if any."""
    matches = []
    for name in available(directory):
        kind = load_hardware(name, directory).device_kind
        if kind.lower() in device_kind.lower():
            matches.append((len(kind), name))
    return max(matches)[1] if matches else None


def default_num_slices(hardware: Hardware, num_devices: int) -> int:
    """Fewest slices, each within the hardware's slice limit, that split the devices evenly."""
    for slices in range(math.ceil(num_devices / hardware.max_devices_per_slice), num_devices + 1):
        if num_devices % slices == 0:
            return slices
    return num_devices


def torus_shape(hardware: Hardware, devices_per_slice: int) -> tuple[int, ...]:
    """The most cubic torus (or NVLink domain) of `devices_per_slice` devices, within the largest slice if possible.

    Real slice shapes are chosen at reservation time; the most balanced
    factorisation is the usual choice and what the bandwidth model assumes. A
    count that no slice shape holds (e.g. 8192 v5p chips) still gets the most
    balanced shape; `slice_shape_exists` tells the caller to warn.
    """
    if devices_per_slice > hardware.max_devices_per_slice:
        raise ConfigError(f"{devices_per_slice} devices per slice exceed {hardware.name}'s "
                          f"max_devices_per_slice={hardware.max_devices_per_slice}; raise num_slices")
    if hardware.ici_topology == "switch":
        return (devices_per_slice,)
    caps = sorted(hardware.max_slice_shape)
    candidates = _factorisations(devices_per_slice, len(caps))
    fitting = [dims for dims in candidates if all(d <= c for d, c in zip(sorted(dims), caps))]
    return tuple(sorted(min(fitting or candidates, key=lambda dims: max(dims) / min(dims))))


def slice_shape_exists(hardware: Hardware, devices_per_slice: int) -> bool:
    """Whether some torus within the largest slice has exactly this many devices."""
    dims = torus_shape(hardware, devices_per_slice)
    return all(d <= c for d, c in zip(sorted(dims), sorted(hardware.max_slice_shape)))


def _factorisations(n: int, k: int) -> list[tuple[int, ...]]:
    """Ordered k-tuples of positive integers (non-decreasing) whose product is n."""
    if k == 1:
        return [(n,)]
    result = []
    for first in range(1, int(round(n ** (1 / k))) + 2):
        if n % first == 0:
            result += [(first, *rest) for rest in _factorisations(n // first, k - 1) if rest[0] >= first]
    return result


def ici_axis_shares(hardware: Hardware, axis_names: Sequence[str], ici_degrees: Mapping[str, int],
                    devices_per_slice: int) -> dict[str, float]:
    """How many torus axes' worth of bandwidth each mesh axis gets inside a slice.

    Mesh axes are laid onto the torus fastest-varying first (the last of
    `mesh_axes`, `tensor` by default), filling one torus axis before the next;
    a mesh axis that covers part of a torus axis of size s with degree g gets
    log(g)/log(s) of it, so the shares of all mesh axes add up to the number of
    torus axes (the seed's M_X + M_Y ~ 3 on a 3D torus). Behind a switch
    (NVLink) every mesh axis gets the full per-device bandwidth: 1.0.
    """
    shares = {a: 0.0 for a in axis_names}
    if hardware.ici_topology == "switch":
        return {a: (1.0 if ici_degrees.get(a, 1) > 1 else 0.0) for a in axis_names}
    dims = list(torus_shape(hardware, devices_per_slice))
    capacity = [math.log(d) for d in dims]  # log-size left on each torus axis
    k = 0
    for axis in reversed(list(axis_names)):
        need = math.log(ici_degrees.get(axis, 1))
        while need > 1e-12 and k < len(dims):
            if capacity[k] <= 1e-12:
                k += 1
                continue
            used = min(need, capacity[k])
            shares[axis] += used / math.log(dims[k])
            capacity[k] -= used
            need -= used
        if need > 1e-9:  # degrees that do not factor into the torus: give the rest one axis' worth
            shares[axis] += need / math.log(max(dims))
    return shares
