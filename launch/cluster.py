"""What XPK and JobSet launches share: the trainer command line and what a TPU type means on GKE.

Pure functions only, so the generated commands and manifests are tested without a cluster.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

from maxpar.core.config import ConfigError, load_config
from maxpar.core.mesh import resolve_mesh_shape
from maxpar.core.storage import is_remote
from maxpar.io.run_config import load_run_config
from maxpar.plan.fit import check_target_fit
from maxpar.training.train_step import run_layout

TRAINER = ("python3", "-m", "maxpar.train")

# TPU generation -> (GKE accelerator label, cores per chip in the type's name, torus dimensions)
TPU_GENERATIONS = {
    "v4": ("tpu-v4-podslice", 2, 3),
    "v5p": ("tpu-v5p-slice", 2, 3),
    "v5litepod": ("tpu-v5-lite-podslice", 1, 2),
    "v6e": ("tpu-v6e-slice", 1, 2),
}
# TPU generation / GPU accelerator label -> hardware profile (configs/hardware) the memory check plans against
TPU_PROFILES = {"v5p": "tpu-v5p", "v5litepod": "tpu-v5e", "v6e": "tpu-v6e"}
GPU_PROFILES = {"h100": "h100", "h200": "h200"}
CHIPS_PER_HOST = 4  # multi-host GKE TPU node pools (ct4p, ct5p, ct5lp-hightpu-4t, ct6e-standard-4t)


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """One slice of a TPU type, as GKE schedules it: hosts, chips per host, node labels."""

    tpu_type: str
    accelerator: str
    topology: str
    chips: int
    hosts: int

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts


def torus_topology(chips: int, dims: int) -> str:
    """GKE's topology label for a slice: the most cubic power-of-two torus, smallest dimensions first
    and unused (size 1) dimensions last, e.g. 2x2x1, 2x2x4, 4x4, 8x16."""
    shape = [1] * dims
    for i in range(int(math.log2(chips))):
        shape[dims - 1 - i % dims] *= 2
    ordered = sorted(d for d in shape if d > 1) + [d for d in shape if d == 1]
    return "x".join(map(str, ordered))


def parse_tpu_type(tpu_type: str) -> TpuSlice:
    """`v5p-128`, `v5litepod-16`, `v6e-256`, `v4-32` -> the slice GKE provisions for it."""
    m = re.fullmatch(r"(v4|v5p|v5litepod|v6e)-(\d+)", tpu_type)
    choices = ", ".join(f"{g}-N" for g in TPU_GENERATIONS)
    if not m:
        raise ConfigError(f"--tpu_type={tpu_type!r}: expected one of {choices} (N = the number in the TPU type)")
    accelerator, cores_per_chip, dims = TPU_GENERATIONS[m.group(1)]
    count = int(m.group(2))
    chips = count // cores_per_chip
    if chips < 1 or count % cores_per_chip or chips & (chips - 1):
        raise ConfigError(f"--tpu_type={tpu_type!r}: {count} must be {cores_per_chip} x a power of two chips")
    hosts = max(chips // CHIPS_PER_HOST, 1)
    return TpuSlice(tpu_type, accelerator, torus_topology(chips, dims), chips, hosts)


def hardware_profile(accelerator: str) -> str:
    """The hardware profile of a TPU type (`v5p-128`) or GKE GPU label (`nvidia-h100-80gb`); '' when none exists."""
    tpu = re.fullmatch(r"(v4|v5p|v5litepod|v6e)-\d+", accelerator)
    if tpu:
        return TPU_PROFILES.get(tpu.group(1), "")
    return next((profile for key, profile in GPU_PROFILES.items() if key in accelerator.lower()), "")


def trainer_command(config_args: Sequence[str], num_devices: int, num_slices: int, job_name: str,
                    hardware: str = "") -> list[str]:
    """`python3 -m maxpar.train CONFIG.yml key=value ...`, checked against the job's devices and slices
    here (the whole run layout, every setup check the trainer makes before touching a device), so that a
    bad override or a mesh that does not fit fails before anything is scheduled; with a `hardware` profile
    (or the config's `hardware` key) the planned memory per device must fit it too.

    Without a `run_name` the trainer would pick a fresh timestamped run at every start, so a restarted
    job (JobSet max_restarts, XPK --max-restarts) would train from step 0; the job's name is used instead,
    and every restart resumes from the newest checkpoint.
    """
    config = load_run_config(list(config_args)).config  # the model of a checkpoint it starts from
    mesh_slices = 1 if config.num_slices == 1 else num_slices
    run_layout(config, resolve_mesh_shape(config, num_devices, mesh_slices))
    if config.num_slices not in (-1, 1, num_slices):
        raise ConfigError(f"num_slices={config.num_slices} but the job has {num_slices} slice(s); use -1 to detect")
    if config.hardware or hardware:
        check_target_fit(config, config.hardware or hardware, num_devices, mesh_slices)
    run_name = [] if config.run_name else [f"run_name={job_name}"]
    return [*TRAINER, *config_args, *run_name]


def positive(name: str, value: int) -> int:
    if value < 1:
        raise ConfigError(f"--{name}={value}: must be >= 1")
    return value


def dns_name(flag: str, name: str, max_length: int) -> str:
    """Kubernetes object names derived from `name` must be DNS labels: check it up front."""
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > max_length:
        raise ConfigError(f"--{flag}={name!r}: use lowercase letters, digits and '-', starting with a letter and "
                          f"not ending with '-', at most {max_length} characters")
    return name


def local_output_warning(config_args: Sequence[str]) -> str | None:
    """A cluster job's pods are rescheduled onto other nodes (preemption, failures, JobSet/XPK restarts): a local
    `base_output_directory` stays behind with its checkpoints, and the restarted job trains from step 0."""
    directory = load_config(list(config_args)).base_output_directory
    if is_remote(directory):
        return None
    return (f"warning: base_output_directory={directory} is a local path: a rescheduled pod loses it and its "
            f"checkpoints, and the job restarts from step 0; use a bucket, e.g. base_output_directory=gs://BUCKET/runs")
