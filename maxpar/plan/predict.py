"""The plan: compute, communication, memory and pipeline bubble of a config on a target.

Timing model (stated in every report, see ASSUMPTIONS):
- A step is a forward and a backward phase (per microbatch, summed). Each
  phase lasts max(matmul time, HBM time, ICI comms, DCN comms): collectives
  overlap the compute of their own phase (XLA's async collectives), comms on
  different mesh axes do not overlap each other (the seed's assumption for
  mixed FSDP + TP), ICI and DCN are independent networks.
- Matmuls run at the profile's peak (a roofline: predicted MFU is an upper bound).
- A pipeline stretches the two phases by 1 / (1 - bubble); the optimizer update
  reads and writes the state once from HBM after the backward pass (with Muon, as long
  as its Newton-Schulz matmuls take, if longer).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

from maxpar.core.axes import Physical
from maxpar.core.config import BLOCK_ATTENTION, Config, ConfigError
from maxpar.core.layout import TracedState, batch_shape
from maxpar.core.mesh import MeshShape, resolve_mesh_shape
from maxpar.model.arithmetic import matmul_params, training_flops_per_token
from maxpar.model.roles import Block
from maxpar.plan import rooflines
from maxpar.plan.comms import BACKWARD, FORWARD, Comm, layer_runs
from maxpar.plan.context_comms import cp_intensity, predict_context_comms
from maxpar.plan.hardware import Hardware, ici_axis_shares, slice_shape_exists, torus_shape
from maxpar.plan.tensors import Layout, build_layout
from maxpar.plan.model_math import (attention_flops_per_token, dtype_bytes, fp8_matmul_params,
                                    memory_per_device, param_breakdown, state_bytes, tp_degrees)
from maxpar.plan.moe_comms import predict_moe_comms
from maxpar.plan.muon import muon_flops
from maxpar.plan.muon_comms import muon_comms
from maxpar.plan.pipeline_comms import explicit_backward_comms, pipeline_comms
from maxpar.plan.tensor_comms import lookup_comms, tensor_comms
from maxpar.plan.weight_comms import weight_comms
from maxpar.plan.zero_comms import zero_comms
from maxpar.training.train_step import trace_state

PHASES = (FORWARD, BACKWARD)
FULL_SCORES = ("the {attention} core computes the full seq x seq attention score matrix and masks it: the chip does "
               "twice the causal attention FLOPs that MFU counts (more with a sliding window, whose MFU counts only "
               "the keys inside it)")
BLOCK_SCORES = ("{attention} attention skips the score blocks above the causal diagonal (and outside a sliding "
                "window) and computes the partly visible ones whole: the chip does (1 + block / span) times the "
                "attention FLOPs that MFU counts, span = seq (or the window), block = {block}")
ASSUMPTIONS = (
    "matmuls run at the profile's peak dense bf16 FLOP/s (roofline): step time is a lower bound, MFU an upper bound",
    "each collective overlaps the compute of its own phase (forward or backward); collectives on different mesh "
    "axes do not overlap each other; ICI and DCN transfer concurrently",
    "ring (bandwidth-optimal) collectives: all-gather / reduce-scatter send (n-1)/n of the full array per device, "
    "all-reduce twice that; a mesh axis gets the ICI bandwidth of every torus axis it spans",
    "HBM traffic counts weight reads (3 per matmul per microbatch) and one read/write of the state by the "
    "optimizer, which runs after the backward pass without overlap",
)
MUON = ("opt_type=muon: each device runs the Newton-Schulz iteration (float32) on the whole hidden matrices it holds "
        "after the update's reshardings (counted with the backward phase's collectives), at the bf16 peak; the "
        "optimizer then lasts as long as those matmuls or its HBM pass, whichever is longer")


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the config would run."""

    hardware: Hardware
    num_devices: int
    num_slices: int
    note: str = ""                      # e.g. why this profile was assumed


@dataclasses.dataclass(frozen=True)
class Batch:
    """Tokens of one step, fractional when planning a batch the trainer could not shard."""

    global_rows: float
    microbatch_rows: float
    tokens: float
    microbatches: int
    tokens_per_shard: float             # one microbatch's tokens on one batch shard
    shardable: bool                     # whether the trainer could build and shard this batch
    warnings: tuple[str, ...]


def plan_batch(config: Config, layout: Layout) -> Batch:
    """`layout.batch_shape` when the trainer accepts the batch, else the fractional planning batch + why."""
    warnings = []
    shardable = True
    try:
        shape = batch_shape(config, layout.num_devices)
        rows, micro, tokens = float(shape.global_rows), float(shape.microbatch_rows), float(shape.tokens_per_step)
    except ConfigError as e:
        micro = config.per_device_batch_size * layout.num_devices
        rows = micro * config.gradient_accumulation_steps
        tokens = rows * config.max_target_length
        warnings.append(f"planning with a fractional batch; the trainer would refuse it: {e}")
        shardable = False
    if micro % layout.batch_degree:
        shardable = False
        warnings.append(f"{micro:g} rows per microbatch do not split over the {layout.batch_degree} batch shards "
                        f"({'x'.join(layout.live(layout.batch_axes)) or 'none'}); the trainer cannot shard this batch "
                        f"(tokens are treated as evenly split)")
    return Batch(global_rows=rows, microbatch_rows=micro, tokens=tokens,
                 microbatches=config.gradient_accumulation_steps,
                 tokens_per_shard=micro * config.max_target_length / layout.batch_degree, shardable=shardable,
                 warnings=tuple(warnings))


def comm_bandwidth(comm: Comm, hardware: Hardware, shares: dict[str, float]) -> float:
    """Bytes/s one device gets for this collective's network and mesh axes."""
    if comm.network == "dcn":
        return hardware.dcn_bandwidth_per_device
    return hardware.ici_bandwidth * max(sum(shares.get(a, 0.0) for a in comm.axes), 1e-9)


def attention_overwork(config: Config) -> float:
    """Attention FLOPs the chip executes beyond those MFU counts, as a fraction of them (see FULL_SCORES,
    BLOCK_SCORES)."""
    if config.attention not in BLOCK_ATTENTION:
        return 1.0
    length = config.max_target_length
    span = config.sliding_window if 0 < config.sliding_window < length else length
    return min(attention_block(config) / span, 1.0)


def attention_block(config: Config) -> int:
    """The score block a block attention core computes whole on the diagonal: blockwise's square block, or the
    larger of splash's query and key blocks (the partly visible blocks of a causal row are about that wide)."""
    block = config.attention_block_size if config.attention == "blockwise" else max(config.sa_block_q,
                                                                                     config.sa_block_kv)
    return min(block, config.max_target_length)


FP8 = ("quantization=fp8: the layer stack's projection and dense-MLP matmuls (forward, both gradients, and a "
       "remat=full recompute) run at the profile's peak fp8 FLOP/s, every other matmul at the bf16 peak; MFU stays "
       "model FLOPs over the bf16 peak; weights are gathered in dtype as without fp8 (XLA gathers the dequantized "
       "weight, not its fp8 form), and the per-tensor amax all-reduces (one scalar each) are not counted")


def assumptions(config: Config) -> list[str]:
    scores = (BLOCK_SCORES.format(attention=config.attention, block=attention_block(config))
              if config.attention in BLOCK_ATTENTION else FULL_SCORES.format(attention=config.attention))
    return [*ASSUMPTIONS, scores, *([FP8] if config.quantization == "fp8" else []),
            *([MUON] if config.opt_type == "muon" else [])]


def compute_flops(config: Config, tokens_per_device: float) -> dict[str, float]:
    """Model FLOPs (what MFU counts) and hardware FLOPs per phase per device (what the chip executes)."""
    per_token = training_flops_per_token(config)
    attention = attention_flops_per_token(config)      # causal, counted once (fwd + bwd)
    model = per_token * tokens_per_device
    extra = attention * attention_overwork(config) * tokens_per_device  # masked-out scores computed anyway
    hardware = {FORWARD: model / 3 + extra / 3, BACKWARD: 2 * model / 3 + 2 * extra / 3}
    layer_forward = 2 * (matmul_params(config) - config.emb_dim * config.vocab_size) + 2 * attention / 3
    if config.remat_policy == "full":
        hardware[BACKWARD] += layer_forward * tokens_per_device
    elif config.remat_policy == "minimal":  # attention einsums are not projections: recomputed
        hardware[BACKWARD] += 2 * attention / 3 * tokens_per_device
    return {"model": model, **hardware}


def fp8_flops(config: Config, tokens_per_device: float) -> dict[str, float]:
    """The part of each phase's hardware FLOPs that runs as fp8 matmuls (quantization=fp8; 0 otherwise): the layer
    stack's projections and dense MLPs, 2 FLOPs per weight per token forward, 4 backward (dx and dw), and their
    forward again under remat_policy=full (minimal saves their outputs)."""
    forward = 2 * fp8_matmul_params(config) * tokens_per_device
    return {FORWARD: forward, BACKWARD: 2 * forward + (forward if config.remat_policy == "full" else 0.0)}


def compute_seconds(flops: dict[str, float], fp8: dict[str, float], hardware: Hardware) -> dict[str, float]:
    """Matmul time per phase: fp8 FLOPs at the profile's fp8 peak, the rest at its bf16 peak."""
    return {p: (flops[p] - fp8[p]) / hardware.peak_flops + fp8[p] / hardware.peak_fp8_flops for p in PHASES}


def hbm_seconds(layout: Layout, microbatches: int, hardware: Hardware) -> dict[str, float]:
    """HBM time: weights streamed per matmul (forward 1x, backward 2x), the optimizer's state pass."""
    config = layout.config
    weights = 0.0
    pipe = layout.schedule
    for t in layout.params():
        if t.block in (Block.NORM, Block.EMBEDDING):
            continue
        batch = layout.weight_batch_axes(t)
        kept = math.prod(layout.degree(a) for a in t.axes if a not in batch)   # TP / stage shards stay sharded
        reads = pipe.num_iterations / pipe.num_repeats if pipe and t.layered else 1.0  # a block per iteration
        weights += t.size / kept * dtype_bytes(config.dtype) * reads
    state = sum(layout.local_bytes(t) for t in layout.tensors)
    grads = sum(layout.local_bytes(t) for t in layout.trained())
    return {FORWARD: weights * microbatches / hardware.hbm_bandwidth,
            BACKWARD: 2 * weights * microbatches / hardware.hbm_bandwidth,
            "optimizer": (2 * state + grads) / hardware.hbm_bandwidth}


def comm_rows(comms: list[Comm], times: list[float]) -> list[dict[str, Any]]:
    """One row per collective pattern, mesh axes and network, summed over the weights it moves."""
    rows: dict[tuple, dict[str, Any]] = {}
    for c, t in zip(comms, times):
        key = (c.pattern, c.axis, c.network, c.collective, c.phase, c.dtype)
        row = rows.setdefault(key, {"pattern": c.pattern, "axis": c.axis, "network": c.network,
                                    "collective": c.collective, "phase": c.phase, "dtype": c.dtype,
                                    "count_per_step": c.count, "bytes_per_device": 0.0, "time_s": 0.0,
                                    "by_weight": {}})
        row["bytes_per_device"] += c.bytes_per_device
        row["time_s"] += t
        if c.tensor:
            row["by_weight"][c.tensor] = row["by_weight"].get(c.tensor, 0.0) + c.bytes_per_device
    return sorted(rows.values(), key=lambda r: -r["time_s"])


def _axis_table(comms: list[Comm], times: list[float], flops: dict[str, float], compute: dict[str, float],
                tokens_per_device: float, hardware: Hardware, shares: dict[str, float]) -> list[dict[str, Any]]:
    """Per mesh-axis group and network: bytes, time, intensity vs hardware, critical batch."""
    groups: dict[tuple[str, str], list[tuple[Comm, float]]] = defaultdict(list)
    for comm, seconds in zip(comms, times):
        groups[(comm.axis, comm.network)].append((comm, seconds))
    rows = []
    for (axis, network), items in sorted(groups.items()):
        total_bytes = sum(c.bytes_per_device for c, _ in items)
        bandwidth = comm_bandwidth(items[0][0], hardware, shares)
        critical, intensity = 0.0, math.inf
        for phase in PHASES:
            in_phase = [(c, s) for c, s in items if c.phase == phase]
            if not in_phase:
                continue
            phase_bytes = sum(c.bytes_per_device for c, _ in in_phase)
            intensity = min(intensity, flops[phase] / phase_bytes)
            fixed = sum(s for c, s in in_phase if not c.scales_with_batch)
            per_token = sum(s for c, s in in_phase if c.scales_with_batch) / tokens_per_device
            compute_per_token = compute[phase] / tokens_per_device
            critical = max(critical, fixed / (compute_per_token - per_token)
                           if compute_per_token > per_token else math.inf)
        rows.append({
            "axis": axis, "network": network, "bytes_per_device": total_bytes, "time_s": sum(s for _, s in items),
            "bandwidth_bytes_per_s": bandwidth,
            "ici_axes_spanned": sum(shares.get(a, 0.0) for a in axis.split("+")) if network == "ici" else None,
            "arithmetic_intensity": intensity, "hardware_intensity": hardware.peak_flops / bandwidth,
            "critical_batch_tokens_per_device": None if math.isinf(critical) else critical,
            "compute_bound": intensity > hardware.peak_flops / bandwidth,
        })
    return rows


def plan_layout(config: Config, target: Target, state: TracedState | None = None) -> Layout:
    """The run layout `config` would train with on the target's devices (ConfigError if it cannot run)."""
    mesh = resolve_mesh_shape(config, target.num_devices, target.num_slices)
    return build_layout(config, mesh, state or trace_state(config))


def step_comms(layout: Layout, batch: Batch) -> list[Comm]:
    """Every predicted collective of one step, strategy by strategy: the partitioner's (the weights', the
    activations', the token lookup's), the MoE dispatch's and context attention's."""
    microbatches = batch.microbatches
    local = batch.tokens_per_shard / layout.context_degree  # context parallelism: each device holds 1/C of the tokens
    runs = layer_runs(layout, local, microbatches)
    args = (layout, batch.tokens_per_shard, microbatches)
    if layout.ops:  # the explicit-backward executor: its own gradient reductions
        weights, stages = [], explicit_backward_comms(layout, local, runs, microbatches)
    else:
        weights, stages = weight_comms(layout, microbatches), pipeline_comms(layout, local, runs, microbatches)
    return (zero_comms(layout, weights) + stages
            + tensor_comms(layout, runs, local, microbatches)
            + lookup_comms(layout, local, microbatches)
            + predict_moe_comms(*args) + predict_context_comms(*args) + muon_comms(layout))


def network_seconds(comms: list[Comm], times: list[float]) -> dict[tuple[str, str], float]:
    """Collective seconds per (phase, network)."""
    return {(p, n): sum(t for c, t in zip(comms, times) if c.phase == p and c.network == n)
            for p in PHASES for n in ("ici", "dcn")}


def comm_seconds(network: dict[tuple[str, str], float], phase: str) -> float:
    """A phase's communication time: ICI and DCN transfer concurrently."""
    return max(network[(phase, "ici")], network[(phase, "dcn")])


def step_seconds(compute: dict[str, float], hbm: dict[str, float], network: dict[tuple[str, str], float],
                 bubble: float) -> float:
    """Each phase lasts as long as its slowest resource, stretched by the pipeline bubble; then the optimizer."""
    phase_time = {p: max(compute[p], hbm[p], network[(p, "ici")], network[(p, "dcn")]) for p in PHASES}
    return sum(phase_time.values()) / (1 - bubble) + max(hbm["optimizer"], compute.get("optimizer", 0.0))


def memory_fit(layout: Layout, batch: Batch, hardware: Hardware) -> dict[str, Any]:
    """`memory_per_device` with the HBM it must fit in."""
    memory = memory_per_device(layout.config, layout, batch.tokens_per_shard)
    memory["hbm_bytes"] = hardware.hbm_bytes
    memory["fits"] = memory["total"] <= hardware.hbm_bytes
    return memory


def limiting_resource(compute: dict[str, float], hbm: dict[str, float],
                      network: dict[tuple[str, str], float]) -> str:
    """What sets the step time: in each phase the slowest of matmuls, HBM and the busier network, summed."""
    optimizer = {"memory": hbm["optimizer"], "compute": compute.get("optimizer", 0.0)}
    limiting = {"compute": 0.0, "memory": 0.0, "communication": 0.0}
    slowest_update = max(optimizer, key=optimizer.get)
    limiting[slowest_update] += optimizer[slowest_update]
    for p in PHASES:
        candidates = {"compute": compute[p], "memory": hbm[p], "communication": comm_seconds(network, p)}
        slowest = max(candidates, key=candidates.get)
        limiting[slowest] += candidates[slowest]
    return max(limiting, key=limiting.get)


def target_warnings(config: Config, target: Target, batch: Batch) -> list[str]:
    """What makes the numbers less trustworthy: an unshardable batch, a slice shape the hardware has not, a dtype
    accelerators do not train in."""
    hardware = target.hardware
    warnings = list(batch.warnings)
    per_slice = target.num_devices // target.num_slices
    if not slice_shape_exists(hardware, per_slice):
        warnings.append(f"no {hardware.name} slice has exactly {per_slice} devices within "
                        f"{'x'.join(map(str, hardware.max_slice_shape))}; bandwidth assumes a "
                        f"{'x'.join(map(str, torus_shape(hardware, per_slice)))} torus")
    if config.dtype != "bfloat16":
        warnings.append(f"dtype={config.dtype}: timings use the bf16 peak and {config.dtype} byte counts; "
                        "accelerators train in dtype=bfloat16")
    return warnings


@dataclasses.dataclass(frozen=True)
class Plan(Mapping[str, Any]):
    """One config on one target. Read by key (`plan["mfu"]`) it is `report`, the JSON-ready figures the command
    prints; what only code reads is typed beside them: every predicted collective (which `--verify` holds
    against the compiled step) and the batch they were predicted for."""

    report: dict[str, Any]
    collectives: list[Comm]             # every one, per weight and pattern (`report["comms"]` sums them by pattern)
    batch: Batch

    def __getitem__(self, key: str) -> Any:
        return self.report[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.report)

    def __len__(self) -> int:
        return len(self.report)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Where one step's time goes on the target (the module's timing model), per phase and device."""

    flops: dict[str, float]                 # `compute_flops`: model FLOPs, hardware FLOPs per phase
    compute: dict[str, float]               # matmul seconds per phase
    hbm: dict[str, float]                   # HBM seconds per phase, and the optimizer's
    network: dict[tuple[str, str], float]   # collective seconds per (phase, network)
    bubble: float
    seconds: float

    @property
    def totals(self) -> dict[str, float]:
        """Seconds per step of each resource, summed over the phases."""
        return {"compute": sum(self.compute.values()),
                "memory": sum(self.hbm[p] for p in PHASES) + self.hbm["optimizer"],
                "communication": sum(comm_seconds(self.network, p) for p in PHASES)}

    @property
    def comm_bound_phases(self) -> list[str]:
        """The phases whose collectives outlast their matmuls."""
        return [p for p in PHASES if comm_seconds(self.network, p) > self.compute[p]]


def pipeline_bubble(layout: Layout) -> float:
    """The stages' idle fraction: gPipe's and circular's formula, or counted on the op table of a schedule with an
    explicit backward (1f1b: the same; zero_bubble: (S-1)/(3M+S-1) for M >= S, its B and W one tick each;
    interleaved_1f1b: circular's (S-1)/(RM+S-1), a tick one of the R blocks' ops)."""
    return (layout.ops or layout.schedule).bubble


def step_time(layout: Layout, hardware: Hardware, batch: Batch, network: dict[tuple[str, str], float],
              tokens_per_device: float) -> StepTime:
    """Matmul, HBM and collective time per phase, and the step they make with the pipeline bubble."""
    config = layout.config
    flops = compute_flops(config, tokens_per_device)
    compute = compute_seconds(flops, fp8_flops(config, tokens_per_device), hardware)
    if config.opt_type == "muon":  # the update's Newton-Schulz matmuls (hardware FLOPs: MFU does not count them)
        flops["optimizer"] = muon_flops(layout)
        compute["optimizer"] = flops["optimizer"] / hardware.peak_flops
    hbm = hbm_seconds(layout, batch.microbatches, hardware)
    bubble = pipeline_bubble(layout) if layout.schedule else 0.0
    return StepTime(flops=flops, compute=compute, hbm=hbm, network=network, bubble=bubble,
                    seconds=step_seconds(compute, hbm, network, bubble))


def ici_shares(layout: Layout, target: Target) -> dict[str, float]:
    """How many torus axes' ICI bandwidth each mesh axis gets in one slice of the target."""
    mesh = layout.mesh
    return ici_axis_shares(target.hardware, mesh.axis_names, dict(zip(mesh.axis_names, mesh.ici)),
                           target.num_devices // target.num_slices)


def target_figures(layout: Layout, target: Target, shares: dict[str, float]) -> dict[str, Any]:
    """The report's model, hardware and mesh."""
    mesh = layout.mesh
    return {
        "model_name": layout.config.model_name or "custom",
        "hardware": target.hardware.name, "hardware_note": target.note, "num_devices": target.num_devices,
        "num_slices": target.num_slices,
        "mesh": {a: {"ici": i, "dcn": d} for a, i, d in zip(mesh.axis_names, mesh.ici, mesh.dcn)},
        "mesh_description": mesh.describe(),
        "torus_axes_per_mesh_axis": {a: s for a, s in shares.items() if s > 0},
    }


def workload_figures(state: TracedState, layout: Layout, batch: Batch, tokens_per_device: float) -> dict[str, Any]:
    """The report's parameters, FLOPs and batch."""
    per_token = training_flops_per_token(layout.config)
    return {
        "params": param_breakdown(state, layout),
        "flops_per_token": per_token,
        "flops_per_step": per_token * batch.tokens,
        "global_batch_tokens": batch.tokens,
        "global_batch_rows": batch.global_rows,
        "tokens_per_device": tokens_per_device,
        "microbatches": batch.microbatches,
        "batch_shardable": batch.shardable,
    }


def time_figures(layout: Layout, hardware: Hardware, batch: Batch, time: StepTime, axes: list[dict[str, Any]],
                 memory: dict[str, Any], tokens_per_device: float) -> dict[str, Any]:
    """The report's step time, MFU and what bounds them."""
    bound = limiting_resource(time.compute, time.hbm, time.network)
    pipe = layout.schedule
    return {
        "compute_time_s": sum(time.compute.values()),
        "compute_time_by_phase_s": time.compute,
        "hbm_time_by_phase_s": time.hbm,
        "comm_time_by_phase_s": {f"{p}/{n}": v for (p, n), v in time.network.items()},
        "axes": axes,
        "pipeline_bubble": time.bubble,
        "pipeline": pipe.describe() if pipe else None,
        "step_time_s": time.seconds,
        "mfu": time.flops["model"] / (time.seconds * hardware.peak_flops),
        "bound": bound,
        "bound_reason": _reason(bound, time, axes, tokens_per_device, hardware, memory, batch),
    }


def evaluate(config: Config, target: Target, state: TracedState) -> Plan:
    """Everything but the searches (TP limit, recommendations): one config on one target."""
    return evaluate_layout(plan_layout(config, target, state), target, state)


def evaluate_layout(layout: Layout, target: Target, state: TracedState) -> Plan:
    """`evaluate` on a run layout already built for the target."""
    hardware = target.hardware
    batch = plan_batch(layout.config, layout)
    tokens_per_device = batch.tokens / target.num_devices
    comms = step_comms(layout, batch)
    shares = ici_shares(layout, target)
    times = [c.bytes_per_device / comm_bandwidth(c, hardware, shares) for c in comms]
    time = step_time(layout, hardware, batch, network_seconds(comms, times), tokens_per_device)
    memory = memory_fit(layout, batch, hardware)
    axes = _axis_table(comms, times, time.flops, time.compute, tokens_per_device, hardware, shares)
    report = {**target_figures(layout, target, shares), **workload_figures(state, layout, batch, tokens_per_device),
              "memory_per_device_bytes": memory, "state_bytes": state_bytes(layout), "comms": comm_rows(comms, times),
              **time_figures(layout, hardware, batch, time, axes, memory, tokens_per_device),
              "warnings": target_warnings(layout.config, target, batch), "assumptions": assumptions(layout.config)}
    return Plan(report=report, collectives=comms, batch=batch)


def _reason(bound: str, time: StepTime, axes: list[dict[str, Any]], tokens_per_device: float, hardware: Hardware,
            memory: dict[str, Any], batch: Batch) -> str:
    """One sentence on what limits the step."""
    totals = time.totals
    worst = max(axes, key=lambda r: r["time_s"]) if axes else None
    if bound == "communication" and worst is not None:
        critical = worst["critical_batch_tokens_per_device"]
        why = (f"the {worst['axis']} axis stays communication-bound at any batch (its degree is too high for the "
               "matmul widths)" if critical is None else
               f"{tokens_per_device:,.0f} tokens per device is below the {worst['axis']} axis's critical batch of "
               f"{critical:,.0f}")
        text = (f"communication-bound: the {worst['axis']} collectives ({worst['network']}) take "
                f"{worst['time_s']:.3g} s per step against {totals['compute']:.3g} s of matmuls; {why}")
    elif bound == "memory":
        text = (f"HBM-bandwidth-bound: streaming weights and optimizer state takes {totals['memory']:.3g} s per step "
                f"against {totals['compute']:.3g} s of matmuls; a microbatch of {batch.tokens_per_shard:,.0f} tokens "
                f"per batch shard is below C / HBM bandwidth = {hardware.hbm_intensity:,.0f}")
    else:
        hidden = f"; the busiest axis ({worst['axis']}) needs {worst['time_s']:.3g} s and is hidden" if worst else ""
        if time.comm_bound_phases:
            hidden += (f", except in the {' and '.join(time.comm_bound_phases)} pass, where collectives outlast the "
                       "matmuls")
        text = f"compute-bound: matmuls take {totals['compute']:.3g} s per step{hidden}"
    if not memory["fits"]:
        text += (f" -- and it does not fit: {memory['total'] / 1e9:,.1f} GB per device needed, "
                 f"{hardware.hbm_bytes / 1e9:,.1f} GB of HBM")
    return text


def tensor_parallelism_limit(config: Config, target: Target, state: TracedState, mesh: MeshShape) -> int | None:
    """Largest ICI tensor degree whose collectives stay hidden behind compute (other degrees fixed, FSDP absorbs)."""
    ici = dict(zip(mesh.axis_names, mesh.ici))
    product = ici[Physical.FSDP] * ici[Physical.TENSOR]
    best = None
    for degree in sorted(d for d in range(1, product + 1) if product % d == 0):
        if degree > 1024:
            break
        kept = {f"ici_{a}_parallelism": ici[a] for a in (Physical.DATA, Physical.EXPERT, Physical.STAGE)}
        candidate = dataclasses.replace(config, ici_tensor_parallelism=degree, ici_fsdp_parallelism=product // degree,
                                        **kept)
        try:
            result = evaluate(candidate, target, state)
        except ConfigError:
            continue
        row = next((r for r in result["axes"] if r["axis"] == Physical.TENSOR and r["network"] == "ici"), None)
        if row is None or row["compute_bound"]:
            best = degree
        else:
            break
    return best


def rules_of_thumb(config: Config, hardware: Hardware, result: Mapping[str, Any], layout: Layout) -> dict[str, float]:
    """The seeds' closed forms at this hardware, model width and batch (see rooflines.py).

    FSDP takes all torus axes but one and TP one (the seed's M_X M_Y = 2 on a 3D torus).
    """
    alpha = rooflines.network_intensity(hardware.peak_flops, hardware.ici_bandwidth)
    n = result["num_devices"] // result["num_slices"]
    torus_axes = sum(1 for d in torus_shape(hardware, n) if d > 1) if hardware.ici_topology == "torus" else 1
    fsdp_axes, tensor_axes = max(torus_axes - 1, 1), 1
    context = layout.context_degree
    return {
        "ici_intensity_flops_per_byte": alpha,
        # context parallelism's k/v all-gather: seq x H / (KV x |CP|) FLOPs per byte (None without a context axis);
        # MLA gathers every head's own k and v (KV = H)
        "cp_intensity": cp_intensity(config.max_target_length, config.num_query_heads,
                                     config.num_query_heads if config.attention_type == "mla" else config.num_kv_heads,
                                     context) if context > 1 else None,
        "torus_axes": torus_axes,
        "fsdp_critical_batch_per_device": rooflines.fsdp_critical_batch(alpha, max(torus_axes, 1)),
        "tensor_parallel_limit": rooflines.tensor_parallel_limit(config.mlp_dim, alpha, tensor_axes),
        "optimal_fsdp_degree": rooflines.optimal_fsdp_degree(
            result["global_batch_tokens"] / result["num_slices"], config.mlp_dim, n, fsdp_axes, tensor_axes),
        "mixed_fsdp_tp_critical_batch_per_device": rooflines.mixed_critical_batch(
            alpha, config.mlp_dim, fsdp_axes, tensor_axes),
        "dcn_critical_batch_per_slice": rooflines.dcn_critical_batch_per_slice(
            hardware.peak_flops, n, hardware.dcn_bandwidth_per_host, hardware.devices_per_host),
        "hbm_critical_batch_per_device": hardware.hbm_intensity,
        "max_params_pure_dp": rooflines.max_params_pure_dp(hardware.hbm_bytes),
    }


def make_plan(config: Config, target: Target, state: TracedState | None = None,
              layout: Layout | None = None) -> Plan:
    """The full plan of one config on one target; `layout`: the `plan_layout` of the config on the target, if the
    caller already has it (verify needs it too)."""
    state = state or trace_state(config)
    layout = layout or plan_layout(config, target, state)
    plan = evaluate_layout(layout, target, state)
    return dataclasses.replace(plan, report={
        **plan.report,
        "tensor_parallelism_limit": tensor_parallelism_limit(config, target, state, layout.mesh),
        "rules_of_thumb": rules_of_thumb(config, target.hardware, plan, layout),
        "tp_degrees": tp_degrees(layout)})
