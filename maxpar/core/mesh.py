"""Physical device mesh: ICI degrees within a slice, DCN degrees across slices.

`resolve_mesh_shape` is pure (tests call it with any device count);
`create_mesh` lays out real devices. A "slice" is a set of devices joined by
the fast interconnect: a TPU slice where devices have `slice_index`, otherwise
one process (a host), so that multi-process CPU/GPU jobs get a real DCN level.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from maxpar.core.axes import STAGE_AXIS, Physical
from maxpar.core.config import Config, ConfigError


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Resolved degrees per physical axis, in `axis_names` order."""

    axis_names: tuple[str, ...]
    ici: tuple[int, ...]
    dcn: tuple[int, ...]

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        return tuple(i * d for i, d in zip(self.ici, self.dcn))

    @functools.cached_property
    def sizes(self) -> dict[str, int]:
        """Degree per axis name."""
        return dict(zip(self.axis_names, self.shape))

    def degree(self, axis: str) -> int:
        return self.sizes[axis]

    def describe(self) -> str:
        return " ".join(f"{a}={i}x{d}" if d > 1 else f"{a}={i}"
                        for a, i, d in zip(self.axis_names, self.ici, self.dcn) if i * d > 1) or "single device"


class DeviceCountError(ConfigError):
    """The configured degrees need another number of devices than there are: `needed` per slice (a multiple of it
    when one degree is -1)."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


def _fill(level: str, degrees: Mapping[str, int], total: int, unit: str) -> dict[str, int]:
    """Replace the one -1 so that the product of degrees equals `total`."""
    known = math.prod(d for d in degrees.values() if d != -1)
    listing = ", ".join(f"{level}_{a}_parallelism={d}" for a, d in degrees.items() if d != 1)
    fills = [a for a, d in degrees.items() if d == -1]
    if fills:
        if total % known:
            raise DeviceCountError(f"cannot fill {level}_{fills[0]}_parallelism=-1: the other {level} degrees "
                              f"({listing}) multiply to {known}, which does not divide {total} {unit}", known)
        return {a: (total // known if d == -1 else d) for a, d in degrees.items()}
    if known != total:
        raise DeviceCountError(f"{level} degrees ({listing or 'all 1'}) multiply to {known} but there are {total} "
                               f"{unit}; set one {level}_*_parallelism to -1 to fill it", known)
    return dict(degrees)


def resolve_mesh_shape(config: Config, num_devices: int, num_slices: int = 1) -> MeshShape:
    """Fill the -1 degrees for `num_devices` devices spread over `num_slices` slices."""
    if num_devices % num_slices:
        raise ConfigError(f"{num_devices} devices do not split evenly into {num_slices} slices")
    ici = _fill("ici", config.ici_parallelism(), num_devices // num_slices, "devices per slice")
    dcn = _fill("dcn", config.dcn_parallelism(), num_slices, "slices")
    names = config.mesh_axes
    return MeshShape(names, tuple(ici[a] for a in names), tuple(dcn[a] for a in names))


def degree_overrides(config: Config, ici: Mapping[str, int], dcn: Mapping[str, int], num_devices: int,
                     num_slices: int) -> dict[str, int]:
    """The ici_/dcn_*_parallelism keys that lay `config` out on these degrees per axis: at each level whose degrees
    differ from those the config resolves to, the keys whose values differ (a -1 included: it may fill otherwise)."""
    configured = resolve_mesh_shape(config, num_devices, num_slices)
    keys: dict[str, int] = {}
    for level, wanted, resolved, raw in (("ici", ici, configured.ici, config.ici_parallelism()),
                                         ("dcn", dcn, configured.dcn, config.dcn_parallelism())):
        if dict(zip(configured.axis_names, resolved)) != dict(wanted):
            keys.update({f"{level}_{axis}_parallelism": degree for axis, degree in wanted.items()
                         if raw[axis] != degree})
    return keys


def one_host_mesh(config: Config, mesh: MeshShape, platform: str) -> list[str]:
    """Degrees (and on a CPU the simulated devices) that lay the run's mesh out in one process, without stages.

    On a CPU one process can simulate all the run's devices, so every axis keeps its whole degree, the DCN share
    folded into ICI; elsewhere one host holds one slice's devices, so the ICI degrees stay and the DCN ones go.
    The stage degree moves to data, so the mesh still covers the devices. A -1 stays: it fills to the same degree.
    """
    on_cpu = platform == "cpu"
    degrees = dict(zip(mesh.axis_names, mesh.shape if on_cpu else mesh.ici))
    degrees[Physical.DATA], degrees[STAGE_AXIS] = degrees[Physical.DATA] * degrees[STAGE_AXIS], 1
    ici = config.ici_parallelism()
    overrides = [f"ici_{axis}_parallelism={degree}" for axis, degree in degrees.items()
                 if ici[axis] != degree and (ici[axis] != -1 or axis == STAGE_AXIS)]
    overrides += [f"dcn_{axis}_parallelism=1" for axis, degree in config.dcn_parallelism().items()
                  if degree not in (1, -1)]  # a -1 fills the one slice with 1
    if config.num_slices not in (1, -1):
        overrides.append("num_slices=1")
    devices = math.prod(degrees.values())
    if on_cpu and config.num_simulated_devices != devices and (devices > 1 or config.num_simulated_devices):
        overrides.append(f"num_simulated_devices={devices}")
    return overrides


def slice_granules(devices: Sequence[jax.Device]) -> tuple[int, bool]:
    """(number of slices, whether they are processes rather than TPU slices).

    Multi-process CPU and GPU devices report `slice_index` 0 everywhere, so it only counts on TPU or
    where it actually tells devices apart; otherwise each process is a slice.
    """
    if all(hasattr(d, "slice_index") for d in devices) and (
            devices[0].platform == "tpu" or len({d.slice_index for d in devices}) > 1):
        return len({d.slice_index for d in devices}), False
    if devices[0].platform == "tpu":  # libtpu's one-slice topologies (compile_topology) have no slice_index
        return 1, False
    return len({d.process_index for d in devices}), True


def num_slices_for(config: Config, devices: Sequence[jax.Device]) -> int:
    """The slice count the mesh will use: detected, or the configured 1 (flat)."""
    detected, _ = slice_granules(devices)
    if config.num_slices in (-1, detected):
        return detected
    if config.num_slices == 1:
        return 1
    raise ConfigError(f"num_slices={config.num_slices} but the devices form {detected} slice(s) "
                      f"(TPU slices, or processes elsewhere); use -1 to detect or 1 for one flat mesh")


def local_mesh_shape(config: Config, devices: Sequence[jax.Device],
                     runs: Callable[[MeshShape], object] | None = None) -> MeshShape:
    """`resolve_mesh_shape` for real devices; on the CPU, too few devices come with how many to simulate: a count
    whose mesh `runs` (the caller's check of the whole config on a mesh, raising ConfigError) accepts too."""
    num_slices = num_slices_for(config, devices)
    try:
        return resolve_mesh_shape(config, len(devices), num_slices)
    except DeviceCountError as e:
        if devices[0].platform != "cpu" or "devices per slice" not in str(e):
            raise
        processes = len({d.process_index for d in devices})
        raise ConfigError(f"{e}; {simulation_hint(config, e.needed, num_slices, processes, runs)}") from None


def simulation_hint(config: Config, needed: int, num_slices: int, num_processes: int,
                    runs: Callable[[MeshShape], object] | None) -> str:
    """The num_simulated_devices (per process) to try: the smallest multiple of the `needed` devices per slice (any
    multiple, when a -1 fills the rest) whose mesh resolves and `runs`, so that the hint does not lead into the
    next error; else why the smallest would not run either."""
    multiples = (1, 2, 4, 8) if -1 in config.ici_parallelism().values() else (1,)
    first_error = None
    for total in (needed * multiple * num_slices for multiple in multiples):
        if total % num_processes:
            continue
        try:
            shape = resolve_mesh_shape(config, total, num_slices)
            if runs is not None:
                runs(shape)
        except ConfigError as e:
            first_error = first_error or e
            continue
        count = total // num_processes
        return (f"on a CPU machine simulate devices with num_simulated_devices={count} or "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={count}")
    if first_error is None:
        return f"the {needed * num_slices} devices it needs do not split evenly over {num_processes} processes"
    return f"simulating {needed * num_slices} CPU devices would not run this config either: {first_error}"


def create_mesh(config: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the Mesh of `config` over `devices` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    return build_mesh(local_mesh_shape(config, devices), devices)


def build_mesh(shape: MeshShape, devices: Sequence[jax.Device]) -> Mesh:
    """Lay out `devices` in a mesh of these degrees; hierarchical (hybrid) when there is more than one slice."""
    if math.prod(shape.dcn) == 1:
        array = mesh_utils.create_device_mesh(shape.shape, devices, allow_split_physical_axes=True)
    else:
        _, by_process = slice_granules(devices)
        array = mesh_utils.create_hybrid_device_mesh(
            shape.ici, shape.dcn, devices, process_is_granule=by_process, allow_split_physical_axes=True)
    return Mesh(np.asarray(array), shape.axis_names)


