"""The seeds' closed-form rules of thumb, as functions of the hardware and model numbers.

These are the simplified (MLP-only, bf16, large-N) formulas of
`how-to-parallelize-a-transformer.md` and `sharding-strategies.md`; the planner
reports them next to its detailed per-collective model so a user can see both,
and the tests pin them to the seeds' worked numbers.
"""

from __future__ import annotations

import math

from maxpar.core.schedule import pipeline_bubble  # noqa: F401  (the seeds' rule of thumb)


def network_intensity(peak_flops: float, bandwidth: float) -> float:
    """alpha = C / W: FLOPs a device must do per byte it sends to hide the transfer (2550 on v5p ICI)."""
    return peak_flops / bandwidth


def fsdp_critical_batch(alpha: float, axes: float) -> float:
    """Per-device batch (tokens) below which pure DP/FSDP is communication-bound: alpha / n_axes."""
    return alpha / axes


def tensor_parallel_limit(mlp_dim: int, alpha: float, axes: float) -> float:
    """Largest TP degree that stays compute-bound: Y < n_axes * F / alpha (independent of batch)."""
    return axes * mlp_dim / alpha


def optimal_fsdp_degree(batch_tokens: float, mlp_dim: int, num_devices: int, fsdp_axes: float,
                        tensor_axes: float) -> float:
    """X_opt = sqrt(B/F * M_X/M_Y * N): the FSDP degree that minimises FSDP + TP comms."""
    return math.sqrt(batch_tokens / mlp_dim * fsdp_axes / tensor_axes * num_devices)


def mixed_critical_batch(alpha: float, mlp_dim: int, fsdp_axes: float, tensor_axes: float) -> float:
    """Per-device batch below which even the best FSDP x TP split is comm-bound: 4 alpha^2 / (M_X M_Y F)."""
    return 4 * alpha ** 2 / (fsdp_axes * tensor_axes * mlp_dim)


def dcn_critical_batch_per_slice(peak_flops: float, devices_per_slice: int, dcn_bandwidth_per_host: float,
                                 devices_per_host: int) -> float:
    """Per-slice batch below which data parallelism across slices is DCN-bound: C_pod / W_dcn,pod."""
    hosts = devices_per_slice / devices_per_host
    return peak_flops * devices_per_slice / (dcn_bandwidth_per_host * hosts)


def max_params_pure_dp(hbm_bytes: float, bytes_per_param: float = 10) -> float:
    """Largest model pure DP can hold: bf16 weights + float32 Adam moments = 10 bytes per parameter."""
    return hbm_bytes / bytes_per_param
