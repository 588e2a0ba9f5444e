"""`python -m maxpar.plan CONFIG [key=value ...] [--json] [--recommend] [--verify] [--dump_hlo DIR] [--top N]`

Predict communication, compute, memory and pipeline bubble of a training
config on a target (`hardware=NAME num_devices=N [num_slices=S]`), optionally
search better meshes, and prove the prediction against the compiled step.
Exit status: 0 ok, 1 --verify found a difference over tolerance, 2 bad config.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

import jax

from maxpar.core.config import Config, ConfigError, load_config
from maxpar.core.layout import TracedState
from maxpar.core.mesh import num_slices_for, resolve_mesh_shape
from maxpar.host.devices import cpu_unless_accelerators
from maxpar.host.preflight import apply_simulated_devices
from maxpar.host.topology import TopologySpec, libtpu_installed, topology_devices, topology_for_hardware
from maxpar.io.logs import tool_log_path
from maxpar.io.run_config import load_run_config
from maxpar.plan import compile_report, report, verify
from maxpar.plan.hardware import available, default_num_slices, hardware_for_device_kind, load_hardware
from maxpar.plan.tensors import Layout
from maxpar.plan.predict import Plan, Target, make_plan, plan_layout
from maxpar.plan.recommend import recommend
from maxpar.training.train_step import trace_state

FALLBACK_HARDWARE = "tpu-v5p"  # the seeds' reference chip, used (and said) when nothing else names one
USAGE = __doc__.strip().splitlines()[0]


def parse_flags(argv: Sequence[str]) -> tuple[dict[str, object], list[str]]:
    """Split --flags from the config file and key=value overrides."""
    flags: dict[str, object] = {"json": False, "recommend": False, "verify": False, "dump_hlo": None, "top": 5}
    rest: list[str] = []
    items = list(argv)
    while items:
        item = items.pop(0)
        if not item.startswith("--"):
            rest.append(item)
            continue
        name, _, value = item[2:].partition("=")
        if name in ("json", "recommend", "verify") and not value:
            flags[name] = True
        elif name in ("dump_hlo", "top"):
            if not value:
                if not items:
                    raise ConfigError(f"--{name} needs a value")
                value = items.pop(0)
            if name == "top":
                if not value.isdigit() or int(value) < 1:
                    raise ConfigError(f"--top={value!r}: expected a positive integer")
                flags[name] = int(value)
            else:
                flags[name] = value
        else:
            raise ConfigError(f"unknown flag {item!r}; {USAGE}")
    if flags["dump_hlo"] and not flags["verify"]:
        raise ConfigError("--dump_hlo DIR writes the HLO that --verify compiles; add --verify")
    return flags, rest


def resolve_target(config: Config, local_kind: str | None, local_count: int | None,
                   local_slices: int | None) -> Target:
    """Hardware profile, device and slice counts: from the config, else from the local devices."""
    name, note = config.hardware, ""
    if not name:
        name = hardware_for_device_kind(local_kind or "")
        if name is None:
            name = FALLBACK_HARDWARE
            note = (f"hardware='' and no profile matches the local device kind {local_kind!r}: assumed {name}; "
                    f"set hardware=NAME ({', '.join(available())})")
        else:
            note = f"hardware={name} matched from the local devices ({local_kind})"
    hardware = load_hardware(name)
    num_devices = config.num_devices or local_count
    if not num_devices:
        raise ConfigError("num_devices=0 means the local device count, which is unknown here")
    if config.num_slices != -1:
        slices = config.num_slices
    elif not config.num_devices and local_slices:
        slices = local_slices
    else:
        slices = default_num_slices(hardware, num_devices)
    if num_devices % slices:
        raise ConfigError(f"num_devices={num_devices} does not split into num_slices={slices}")
    if num_devices // slices > hardware.max_devices_per_slice:
        raise ConfigError(f"{num_devices // slices} devices per slice exceed {hardware.name}'s "
                          f"max_devices_per_slice={hardware.max_devices_per_slice}; set num_slices")
    return Target(hardware=hardware, num_devices=num_devices, num_slices=slices, note=note)


def tpu_topology(config: Config, verifying: bool) -> TopologySpec | None:
    """The TPU topology --verify compiles for instead of the local devices: a TPU hardware target with a device
    count, and libtpu installed (XLA:TPU itself, so no conversion of the prediction applies)."""
    if not (verifying and config.hardware and config.num_devices and libtpu_installed()):
        return None
    hardware = load_hardware(config.hardware)
    if hardware.platform != "tpu":
        return None
    slices = config.num_slices if config.num_slices != -1 else default_num_slices(hardware, config.num_devices)
    if config.num_devices % slices:
        raise ConfigError(f"num_devices={config.num_devices} does not split into num_slices={slices}")
    return topology_for_hardware(config.hardware, config.num_devices // slices)


def local_devices(config: Config, verifying: bool) -> tuple[list[jax.Device] | None, tuple]:
    """The local devices and their (kind, count, slices): looked at only when --verify compiles on them or the
    config leaves the target to them."""
    if not verifying and config.hardware and config.num_devices:
        return None, (None, None, None)
    devices = jax.devices()
    local = (devices[0].device_kind, len(devices), num_slices_for(config, devices))
    if verifying and config.num_devices not in (0, len(devices)):
        raise ConfigError(f"--verify compiles on the local devices: num_devices={config.num_devices} but there are "
                          f"{len(devices)} (set num_devices=0, or XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    return devices, local


def planned(config: Config, target: Target, state: TracedState, recommending: bool
            ) -> tuple[Plan | None, Layout | None, dict[str, object], str]:
    """(plan, its layout, JSON result, text) of the configured mesh. One that cannot run raises, but under
    --recommend alone it is reported: the search may still find a mesh that can."""
    try:
        layout = plan_layout(config, target, state)
        plan = make_plan(config, target, state, layout)
        return plan, layout, dict(plan.report), report.render_plan(plan)
    except ConfigError as e:
        if not recommending:
            raise
        return (None, None, {"error": str(e), "hardware": target.hardware.name, "num_devices": target.num_devices},
                f"maxpar plan: the configured mesh cannot run: {e}")


def verified(config: Config, target: Target, devices: list[jax.Device], plan: Plan, layout: Layout,
             dump_hlo: str | None) -> tuple[dict[str, object], list[str]]:
    """(--verify's result, its text): the plan held against the train step compiled on the local devices."""
    if devices[0].platform != "tpu":  # XLA:TPU compiles one slice's program with its DCN transfers: any mesh
        verify.check_verifiable(resolve_mesh_shape(config, target.num_devices, target.num_slices))
    compiled = verify.compile_train_step(config, devices)
    text = []
    if dump_hlo:
        text.append(f"\ncompiled HLO written to {verify.dump_hlo(compiled.text, dump_hlo)}")
    result = verify.compare(plan, layout, compiled, config)
    return result, [*text, "\n" + report.render_verify(result)]


def compile_candidates(rest: list[str], best: list[dict[str, object]], devices: list[jax.Device],
                       target: Target) -> None:
    """Beside each recommended mesh, what XLA:TPU makes of it on the target's topology: its peak memory per chip
    and the compiler's estimated step (with scanned layers, one pass of the layer loop: `loop_body_once`)."""
    for candidate in best:
        config = load_config([*rest, *str(candidate["overrides"]).split()])
        try:
            compiled = verify.compile_train_step(config, devices)
        except (ConfigError, jax.errors.JaxRuntimeError) as e:
            candidate["compiled"] = {"error": str(e).splitlines()[0][:300]}
            continue
        compiled_report = compile_report.build_report(config, compiled, "", target.hardware)
        cost = compiled_report.cost
        candidate["compiled"] = {"peak_bytes": compiled_report.memory.peak, "fits": compiled_report.fits,
                                 "estimated_step_s": cost.seconds if cost else None,
                                 "loop_body_once": bool(cost and cost.loop_body_once),
                                 "compile_seconds": compiled.compile_seconds}


def run(argv: Sequence[str]) -> tuple[dict[str, object], str, int]:
    """(JSON result, human text, exit status) of one invocation."""
    flags, rest = parse_flags(argv)
    if not rest:
        raise ConfigError(USAGE)
    run_config = load_run_config(rest)  # a load_parameters_path=DIR plans the checkpoint's model
    config = run_config.config
    cpu_unless_accelerators()  # before JAX starts: no libtpu warnings where there is no TPU
    topology = tpu_topology(config, flags["verify"])
    if topology is None:
        apply_simulated_devices(config)  # num_simulated_devices=N: before the local devices are looked at
        devices, local = local_devices(config, flags["verify"])
        target = resolve_target(config, *local)
    else:
        target = resolve_target(config, None, None, None)
        devices = topology_devices(topology, target.num_slices, tool_log_path("plan"))
    state = trace_state(config)
    plan, layout, result, first = planned(config, target, state, flags["recommend"] and not flags["verify"])
    text, status = [*([run_config.note] if run_config.note else []), first], 0
    if flags["recommend"]:
        result["recommendations"] = recommend(config, target, state, top=flags["top"])
        text.append(report.render_recommendations(result["recommendations"]))
        if topology is not None:  # --recommend --verify on a TPU target: XLA:TPU compiles each candidate
            compile_candidates(rest, result["recommendations"]["best"], devices, target)
            text.append(report.render_compiled_candidates(result["recommendations"]["best"], topology.name))
        if "error" in result and not result["recommendations"]["best"]:
            status = 2
    if flags["verify"]:
        dump_hlo = str(flags["dump_hlo"]) if flags["dump_hlo"] else None
        result["verify"], lines = verified(config, target, devices, plan, layout, dump_hlo)
        text += lines
        status = 0 if result["verify"]["passed"] else 1
    return report.public(result), "\n".join(text), status


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    try:
        result, text, status = run(argv)
    except ConfigError as e:
        print(f"maxpar.plan: config error: {e}", file=sys.stderr)
        return 2
    json_mode = "--json" in argv
    print(json.dumps(result, indent=2) if json_mode else text)
    return status


if __name__ == "__main__":
    sys.exit(main())
