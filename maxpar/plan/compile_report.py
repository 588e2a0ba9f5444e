"""`compile_topology`: the real train step compiled for a TPU topology this machine does not have, and what the
compiler says of it (per chip memory, collectives, FLOPs, its estimated step time), before anyone reserves chips.

The step is the trainer's own (`verify.compile_train_step`: the run layout resolved for the topology's devices,
the model, optimizer and shardings a run would use), compiled by XLA:TPU from libtpu. Memory is the compiler's
buffer assignment (`memory_analysis()`), held against the chip's HBM from configs/hardware. The estimated step is
XLA:TPU's cost model (`cost_analysis()['optimal_seconds']`), which counts a while loop's body once: with
`scan_layers=true` (a loop over the layers) its FLOPs, bytes and time describe the step with one layer's pass,
so the report says so and gives no MFU; `scan_layers=false` compiles every layer and the figures are the step's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
from etils import epath

from maxpar.core import storage
from maxpar.core.axes import Physical
from maxpar.core.config import Config, to_yaml
from maxpar.core.mesh import MeshShape, local_mesh_shape
from maxpar.host import topology
from maxpar.io import executable, logs
from maxpar.model.arithmetic import training_flops_per_token
from maxpar.plan import hlo
from maxpar.plan.hardware import Hardware, load_hardware
from maxpar.plan.verify import Compiled, compile_train_step, labelled_collectives

GIB = 2 ** 30
EXIT_FITS, EXIT_DOES_NOT_FIT = 0, 1
# XLA:TPU refuses a program over HBM at compile time, e.g. "CompileTimeHbmOom: ... the total memory required for
# HLO temporaries (780.30G) exceeds available HBM (95.73G)", or in older releases "Used 120.5G of 95.74G hbm".
_HBM_EXCEEDED = (re.compile(r"required for (?P<what>[\w ]+?) \((?P<used>[\d.]+)(?P<u>[KMGT])\) exceeds available HBM "
                            r"\((?P<cap>[\d.]+)(?P<c>[KMGT])\)"),
                 re.compile(r"Used (?P<used>[\d.]+)(?P<u>[KMGT]) of (?P<cap>[\d.]+)(?P<c>[KMGT]) hbm"))
_UNITS = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per chip bytes of the compiled step (the compiler's buffer assignment)."""

    arguments: float        # train state and batch shards
    temporaries: float      # activations, gradients, gathered weights, XLA's scratch
    output: float           # the new state and metrics
    aliased: float          # outputs written over donated arguments (the state): counted once
    generated_code: float
    capacity: float  # the chip's HBM

    @property
    def peak(self) -> float:
        return self.arguments + self.temporaries + self.output - self.aliased + self.generated_code

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity


@dataclasses.dataclass(frozen=True)
class CollectiveSum:
    """One kind of collective over one set of mesh axes: executions and wire bytes per device per step."""

    kind: str
    axes: str
    executions: float
    bytes: float


@dataclasses.dataclass(frozen=True)
class CompilerCost:
    """XLA's cost analysis of the step, per chip."""

    flops: float
    bytes_accessed: float
    seconds: float                 # the TPU cost model's estimated step ('optimal_seconds')
    loop_body_once: bool           # the layers are a scanned loop: the figures count its body once
    model_flops: float             # maxpar's count of the step's training FLOPs per chip (6N + attention)
    peak_flops: float | None

    @property
    def estimated(self) -> bool:
        """Whether the cost model gave a step time: it gives a negative one for multi-slice programs (their
        transfers between slices go through the host-side runtime, which it does not model)."""
        return self.seconds > 0

    @property
    def mfu(self) -> float | None:
        """The MFU the compiler's step estimate implies (None when it covers one pass of a loop only)."""
        if self.loop_body_once or not self.peak_flops or not self.estimated:
            return None
        return self.model_flops / (self.seconds * self.peak_flops)


@dataclasses.dataclass(frozen=True)
class TopologyReport:
    """What compiling the train step for a topology showed."""

    topology: str
    device_kind: str
    num_devices: int
    mesh: str
    dcn_axes: tuple[str, ...]
    memory: Memory
    collectives: tuple[CollectiveSum, ...]
    cost: CompilerCost | None
    compile_seconds: float
    advice: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "fits": self.fits, "peak_bytes": self.memory.peak,
                "mfu": self.cost.mfu if self.cost else None}


def memory_of(analysis: Any, hardware: Hardware) -> Memory:
    return Memory(arguments=analysis.argument_size_in_bytes, temporaries=analysis.temp_size_in_bytes,
                  output=analysis.output_size_in_bytes, aliased=analysis.alias_size_in_bytes,
                  generated_code=analysis.generated_code_size_in_bytes,
                  capacity=hardware.hbm_bytes)


def collective_sums(text: str, mesh: MeshShape) -> tuple[CollectiveSum, ...]:
    """Every collective of the compiled program by (kind, mesh axes), largest first; a collective matmul's
    permutes under the all-gather or reduce-scatter they do ("all-gather (collective matmul)")."""
    executions: dict[tuple[str, str], float] = defaultdict(float)
    moved: dict[tuple[str, str], float] = defaultdict(float)
    for axes, c in labelled_collectives(text, mesh):
        kind = f"{c.stands_for} (collective matmul)" if c.stands_for else c.kind
        executions[(kind, axes)] += c.count
        moved[(kind, axes)] += hlo.collective_wire_bytes(c) * c.count
    sums = [CollectiveSum(kind, axes, executions[(kind, axes)], moved[(kind, axes)]) for kind, axes in moved]
    return tuple(sorted(sums, key=lambda s: -s.bytes))


def compiler_cost(config: Config, compiled: Compiled) -> CompilerCost | None:
    """The cost analysis with maxpar's FLOP count beside it; None when the backend gives none."""
    try:
        cost = compiled.executable.cost_analysis()
    except Exception:  # some backends do not implement it
        return None
    if isinstance(cost, Sequence):  # older JAX: one dict per program
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    layout = compiled.layout
    devices = math.prod(layout.mesh.shape)
    model_flops = training_flops_per_token(config) * layout.batch.tokens_per_step / devices
    loops = config.scan_layers and config.num_decoder_layers > 1
    return CompilerCost(flops=float(cost["flops"]), bytes_accessed=float(cost.get("bytes accessed", 0.0)),
                        seconds=float(cost.get("optimal_seconds", 0.0)), loop_body_once=loops,
                        model_flops=model_flops, peak_flops=None)


def what_to_try(config: Config, memory: Memory | None, mesh: MeshShape | None = None) -> tuple[str, ...]:
    """Levers that lower the largest part of the peak (`memory`, `mesh` None: unknown, all of them), in the order
    worth trying."""
    tips = []
    if memory is None or memory.temporaries >= memory.arguments:
        if config.remat_policy != "full":
            tips.append(f"remat_policy=full (now {config.remat_policy}): recompute activations in the backward pass")
        if config.attention == "dot_product" and config.max_target_length >= 4096:
            tips.append("attention=blockwise (or splash on TPU): no seq x seq score matrix held")
        tips.append(f"a smaller per_device_batch_size (now {config.per_device_batch_size:g}), with "
                    f"gradient_accumulation_steps to keep the global batch")
    if mesh is None or mesh.degree(Physical.FSDP) < math.prod(mesh.shape):
        tips.append("shard the state over more chips: ici_fsdp_parallelism=-1, ici_data_parallelism=1")
    if config.optimizer_state_dtype in ("", "float32") and config.weight_dtype == "float32":
        tips.append("optimizer_state_dtype=bfloat16: half the AdamW moments")
    tips.append("a larger topology or more slices (compile_topology, compile_topology_num_slices)")
    return tuple(tips)


@dataclasses.dataclass(frozen=True)
class HbmExceeded:
    """XLA:TPU's refusal to compile a program that needs more HBM than the chip has."""

    what: str          # what the compiler was placing ("HLO temporaries"; "" when it does not say)
    needed: float      # bytes per chip
    capacity: float    # bytes per chip the compiler may use


def exceeded_hbm(message: str) -> HbmExceeded | None:
    """XLA:TPU's out-of-memory compile error read into numbers, if that is what `message` is."""
    for pattern in _HBM_EXCEEDED:
        m = pattern.search(message)
        if m:
            what = m.groupdict().get("what") or ""
            return HbmExceeded(what, float(m.group("used")) * _UNITS[m.group("u")],
                               float(m.group("cap")) * _UNITS[m.group("c")])
    return None


def build_report(config: Config, compiled: Compiled, topology: str, hardware: Hardware) -> TopologyReport:
    """What XLA made of the step for `hardware` (its HBM and peak FLOP/s): memory, collectives, cost, advice."""
    layout = compiled.layout
    memory = memory_of(compiled.memory, hardware)
    cost = compiler_cost(config, compiled)
    if cost is not None:
        cost = dataclasses.replace(cost, peak_flops=hardware.peak_flops)
    dcn = tuple(a for a, d in zip(layout.mesh.axis_names, layout.mesh.dcn) if d > 1)
    return TopologyReport(topology=topology, device_kind=hardware.device_kind, num_devices=math.prod(layout.mesh.shape),
                          mesh=layout.mesh.describe(), dcn_axes=dcn, memory=memory,
                          collectives=collective_sums(compiled.text, layout.mesh), cost=cost,
                          compile_seconds=compiled.compile_seconds,
                          advice=() if memory.fits else what_to_try(config, memory, layout.mesh))


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def render(report: TopologyReport) -> list[str]:
    m = report.memory
    lines = [f"  compiled for {report.topology}, {report.device_kind}; mesh {report.mesh}"
             + (f" (DCN: {', '.join(report.dcn_axes)})" if report.dcn_axes else "")
             + f", in {report.compile_seconds:.1f} s",
             "  memory per chip (XLA's buffer assignment):",
             f"    arguments {_gib(m.arguments)}, temporaries {_gib(m.temporaries)}, output {_gib(m.output)} "
             f"({_gib(m.aliased)} of it over the donated state), code {_gib(m.generated_code)}",
             f"    peak {_gib(m.peak)} of {_gib(m.capacity)} HBM ({m.peak / m.capacity:.0%})"]
    if report.collectives:
        lines.append("  collectives per chip per step (wire bytes, ring algorithms; axes from replica groups):")
        for s in report.collectives:
            dcn = [a for a in s.axes.split("+") if a in report.dcn_axes]
            lines.append(f"    {s.kind:<36} over {s.axes:<14} {s.executions:>7,.0f} x, {s.bytes / 1e9:10.3f} GB"
                         + (" (crosses DCN)" if dcn else ""))
    c = report.cost
    if c is not None:
        scope = " (one pass of the scanned layer loop's body: XLA counts a loop body once)" if c.loop_body_once else ""
        lines.append(f"  compiler's cost per chip{scope}:")
        step = (f"estimated step {c.seconds * 1e3:.1f} ms" if c.estimated else
                f"no step estimate (the cost model gave {c.seconds:.3g} s: it does not model the transfers "
                f"between slices)")
        lines.append(f"    {c.flops:.3e} FLOPs, {c.bytes_accessed:.3e} bytes accessed, {step}")
        if c.mfu is not None:
            lines.append(f"    maxpar's count of the step: {c.model_flops:.3e} FLOPs per chip -> MFU {c.mfu:.1%} "
                         f"at the estimated step")
        elif c.loop_body_once:
            lines.append("    for the whole step's estimate and its MFU compile with scan_layers=false (every layer "
                         "in the program; a slower compile)")
    return lines


def compile_topology(config: Config, run_dir: epath.Path, log: Any = print) -> int:
    """`compile_topology=NAME`: compile the train step for NAME's chips, print what the compiler says, write
    RUN/compile_report.json (and compiled_trainstep_file); exit status 0 when it fits the chips' HBM, else 1."""
    spec = topology.parse_topology(config.compile_topology)
    slices = config.compile_topology_num_slices
    hardware = load_hardware(spec.family.hardware)
    library_log = logs.library_log_path(run_dir)
    local_log = None if storage.is_remote(library_log) else library_log  # libtpu's fd-2 lines: a local file only
    with logs.library_logs(library_log, config.log_level):
        devices = topology.topology_devices(spec, slices, local_log)
        log(f"maxpar: compiling the train step of {config.model_name or 'custom'} for {spec.describe(slices)} "
            f"with XLA:TPU (libtpu); library logs: {library_log}")
        try:
            compiled = compile_train_step(config, devices)
        except jax.errors.JaxRuntimeError as e:
            exceeded = exceeded_hbm(str(e))
            if exceeded is None:
                raise
            what = f" for {exceeded.what}" if exceeded.what else ""
            log(f"maxpar: does not fit: XLA:TPU needs {_gib(exceeded.needed)} per chip{what}, and {spec.name}'s "
                f"chips give it {_gib(exceeded.capacity)} of HBM ({_gib(exceeded.needed - exceeded.capacity)} "
                f"over; the compiler stopped there). Try:")
            for tip in what_to_try(config, None, local_mesh_shape(config, devices)):
                log(f"    {tip}")
            return EXIT_DOES_NOT_FIT
        report = build_report(config, compiled, spec.describe(slices), hardware)
        for line in render(report):
            log(line)
        out = run_dir / "compile_report.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report.as_dict(), indent=2) + "\n", encoding="utf-8")
        (run_dir / "train_step.hlo.txt").write_text(compiled.text, encoding="utf-8")
        log(f"  report: {out}; the compiled program: {run_dir / 'train_step.hlo.txt'}")
        if config.compiled_trainstep_file:
            saved = executable.save_executable(compiled.executable, config.compiled_trainstep_file,
                                               executable.CompiledFor(
                                                   devices[0].platform, devices[0].device_kind, len(devices),
                                                   report.mesh, spec.name, to_yaml(config)))
            log(f"  compiled train step written to {saved}")
    m = report.memory
    if report.fits:
        log(f"maxpar: fits: peak {_gib(m.peak)} of {_gib(m.capacity)} HBM per chip")
        return EXIT_FITS
    log(f"maxpar: does not fit: peak {_gib(m.peak)} per chip, {_gib(m.peak - m.capacity)} over the "
        f"{_gib(m.capacity)} of HBM. Try:")
    for tip in report.advice:
        log(f"    {tip}")
    return EXIT_DOES_NOT_FIT
