"""Fit before you run: the planner's per-device memory estimate against the memory the run will have.

A model that cannot fit otherwise grows until the kernel kills it (exit 137, no word on why) or the
accelerator runs out of memory minutes later. The estimate (`model_math.memory_per_device`: parameters,
optimizer state, gradients, activations) comes from an abstract trace of the trainer's own state and
shardings, so checking costs no device memory. The trainer checks against the local devices
(`python -m maxpar.train`), the launchers against the target's hardware profile (launch.xpk,
launch.jobset); `skip_memory_check=true` turns both off.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from maxpar.core.config import Config, ConfigError
from maxpar.core.mesh import MeshShape, local_mesh_shape, resolve_mesh_shape
from maxpar.plan.hardware import load_hardware
from maxpar.plan.tensors import build_layout
from maxpar.plan.model_math import memory_per_device
from maxpar.plan.predict import plan_batch
from maxpar.training.train_step import layout_check, trace_state

GB = 1e9
PARTS = (("params", "parameters"), ("reference", "DPO reference model"), ("optimizer", "optimizer state"),
         ("gradients", "gradients"),
         ("activations", "activations"), ("gathered_weights", "gathered weights"))


def memory_estimate(config: Config, mesh: MeshShape) -> dict[str, float]:
    """Peak bytes per device of `config` on `mesh` (by part, and 'total'); allocates nothing."""
    layout = build_layout(config, mesh, trace_state(config))
    return memory_per_device(config, layout, plan_batch(config, layout).tokens_per_shard)


def host_available_bytes() -> int:
    """Memory the host can still give this process: MemAvailable (page cache that can be dropped included)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def local_capacity(local_devices: Sequence[Any]) -> tuple[float, int, str]:
    """(bytes the check compares with, devices that share them, what they are in words).

    Accelerators: the smallest device's memory limit, per device. CPU: simulated devices all share the
    host's memory, so the host's available memory is compared with the sum over this process's devices.
    """
    if local_devices[0].platform == "cpu":
        available = host_available_bytes()
        return float(available), len(local_devices), (f"this host has {available / GB:.0f} GB of memory available "
                                                      f"for its {len(local_devices)} CPU device(s)")
    limits = [(device.memory_stats() or {}).get("bytes_limit") for device in local_devices]
    if any(limit is None for limit in limits):
        return float("inf"), 1, "device memory is not reported"
    limit = min(limits)
    return float(limit), 1, f"each {local_devices[0].device_kind} device has {limit / GB:.0f} GB"


def check_fits(config: Config, estimate: dict[str, float], capacity: float, sharing: int, where: str) -> None:
    """Raise ConfigError with the numbers and what to change when `sharing` devices of `estimate` exceed
    `capacity` bytes."""
    needed = estimate["total"] * sharing
    if needed <= capacity:
        return
    parts = ", ".join(f"{name} {estimate[key] / GB:.1f}" for key, name in PARTS if estimate.get(key))
    per_device = "" if sharing == 1 else f" x {sharing} devices"
    name = config.model_name or "this model"
    advice = ["more devices or more FSDP sharding (ici_fsdp_parallelism)"]
    if config.remat_policy != "full":
        advice.append("remat_policy=full")
    if config.per_device_batch_size > 1:
        advice.append("a smaller per_device_batch_size")
    if config.weight_dtype == "float32":
        advice.append("weight_dtype=bfloat16")
    raise ConfigError(f"{name} needs ~{needed / GB:.0f} GB ({estimate['total'] / GB:.1f} GB per device{per_device}: "
                      f"{parts} GB); {where}. Try {', '.join(advice)}; or skip_memory_check=true to run anyway "
                      f"(the estimate is the planner's: python -m maxpar.plan)")


def check_local_fit(config: Config, devices: Sequence[Any], local_devices: Sequence[Any]) -> None:
    """The trainer's check, before it allocates anything: `config` on the job's `devices`, against the memory of
    this process's `local_devices`."""
    if config.skip_memory_check:
        return
    capacity, sharing, where = local_capacity(local_devices)
    if capacity != float("inf"):
        mesh = local_mesh_shape(config, devices, layout_check(config))
        check_fits(config, memory_estimate(config, mesh), capacity, sharing, where)


def check_target_fit(config: Config, hardware_name: str, num_devices: int, num_slices: int) -> None:
    """The launchers' check: `config` on `num_devices` devices of the hardware profile `hardware_name`."""
    if config.skip_memory_check:
        return
    hardware = load_hardware(hardware_name)
    estimate = memory_estimate(config, resolve_mesh_shape(config, num_devices, num_slices))
    check_fits(config, estimate, hardware.hbm_bytes, 1,
               f"a {hardware.name} device has {hardware.hbm_bytes / GB:.0f} GB (configs/hardware/{hardware_name}.yml)")
