"""Human tables and JSON for plans, recommendations and verification results."""

from __future__ import annotations

import math
from typing import Any


def public(result: dict[str, Any]) -> dict[str, Any]:
    """A result as strict JSON: infinities (an axis that is never compute-bound) as null."""
    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return value
    return clean(result)


def human_bytes(value: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:,.3g} {unit}"
    return f"{value:,.0f} B"


def si(value: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:g}"


def seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.3g} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} us"


def table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    def line(cells):
        return indent + "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _summary(plan: dict[str, Any]) -> list[str]:
    """The title, parameters, batch and FLOPs."""
    p = plan["params"]
    out = [f"maxpar plan: {plan['model_name']} on {plan['num_devices']:,} x {plan['hardware']} "
           f"({plan['num_slices']} slice{'s' if plan['num_slices'] > 1 else ''}), mesh {plan['mesh_description']}"]
    if plan["hardware_note"]:
        out.append(f"  note: {plan['hardware_note']}")
    experts = f"experts {si(p['experts'])}, " if p.get("experts") else ""
    return out + [
        f"  params     total {si(p['total'])} (token embedding {si(p['embedding'])}, attention {si(p['attention'])}, "
        f"mlp {si(p['mlp'])}, {experts}output {si(p['output'])}, norms {si(p['norm'])}; active {si(p['active'])})",
        *([f"             main model {si(p['total'] - p['mtp'])} total, {si(p['active'] - p['mtp_active'])} active; "
           f"MTP modules {si(p['mtp'])} ({si(p['mtp_active'])} active)"] if p.get("mtp") else []),
        f"  batch      {plan['global_batch_rows']:,.6g} rows = {plan['global_batch_tokens']:,.0f} tokens per step "
        f"({plan['tokens_per_device']:,.1f} per device, {plan['microbatches']} microbatch(es))",
        f"  flops      {plan['flops_per_token']:.4g} per token (training: 6 x matmul params + causal attention "
        f"counted once), {plan['flops_per_step']:.4g} per step",
    ]


def _memory(plan: dict[str, Any]) -> list[str]:
    mem = plan["memory_per_device_bytes"]
    whole = plan["state_bytes"]
    return [
        "memory per device",
        table(["", "bytes"], [[k, human_bytes(mem[k])] for k in ("params", "reference", "gradients", "optimizer",
                                                                 "activations", "gathered_weights", "muon_working",
                                                                 "total")
                              if k not in ("reference", "muon_working") or mem[k]]),
        f"  {'fits in' if mem['fits'] else 'DOES NOT FIT in'} {human_bytes(mem['hbm_bytes'])} of HBM",
        f"  one copy of the state, summed over its shards: params {human_bytes(whole['params'])} "
        f"({whole['params_per_parameter']:.3g} bytes per parameter), optimizer {human_bytes(whole['optimizer'])} "
        f"({whole['optimizer_per_parameter']:.3g} bytes per parameter)",
    ]


def _communication(plan: dict[str, Any]) -> list[str]:
    """The collectives by pattern, then per mesh axis."""
    out = ["communication per step, per device (summed over weights and layers)"]
    rows = [[c["pattern"], c["axis"], c["network"], c["collective"], c["dtype"], human_bytes(c["bytes_per_device"]),
             seconds(c["time_s"])] for c in plan["comms"]]
    out.append(table(["pattern", "axis", "net", "collective", "dtype", "bytes", "time"], rows) if rows
               else "  none (single device)")
    out += ["", "per mesh axis (intensity = FLOPs per byte sent; compute-bound while above the hardware's)"]
    rows = []
    for a in plan["axes"]:
        critical = a["critical_batch_tokens_per_device"]
        spanned = "-" if a["ici_axes_spanned"] is None else f"{a['ici_axes_spanned']:.2f}"
        rows.append([a["axis"], a["network"], spanned,
                     human_bytes(a["bytes_per_device"]), seconds(a["time_s"]), f"{a['arithmetic_intensity']:,.0f}",
                     f"{a['hardware_intensity']:,.0f}", "never" if critical is None else f"{critical:,.0f}"])
    if rows:
        out.append(table(["axis", "net", "torus axes", "bytes", "time", "intensity", "hw intensity",
                          "critical batch/device"], rows))
    return out


def _time(plan: dict[str, Any]) -> list[str]:
    compute = plan["compute_time_by_phase_s"]
    hbm = plan["hbm_time_by_phase_s"]
    comm = plan["comm_time_by_phase_s"]
    return [
        "time per step",
        table(["phase", "matmuls", "HBM", "ICI comms", "DCN comms"],
              [[ph, seconds(compute[ph]), seconds(hbm[ph]), seconds(comm[f"{ph}/ici"]), seconds(comm[f"{ph}/dcn"])]
               for ph in ("forward", "backward")]
              + [["optimizer", seconds(compute["optimizer"]) if "optimizer" in compute else "-",
                  seconds(hbm["optimizer"]), "-", "-"]]),
        f"  compute_time_s {plan['compute_time_s']:.4g}   pipeline_bubble {plan['pipeline_bubble']:.1%}   "
        f"step_time_s {plan['step_time_s']:.4g}   mfu {plan['mfu']:.1%}",
        f"  bound: {plan['bound']} -- {plan['bound_reason']}",
        f"  tensor_parallelism_limit: {plan['tensor_parallelism_limit']} (largest ICI tensor degree the model's dims "
        "allow whose collectives stay hidden behind compute)",
    ]


RULES_SOURCE = '"How to Scale Your Model" (Austin et al., the scaling book)'  # rooflines.py's closed forms


def _rules_of_thumb(plan: dict[str, Any]) -> list[str]:
    r = plan["rules_of_thumb"]
    return [f"rules of thumb from {RULES_SOURCE} for this hardware and model", table(["", "value"], [
        ["ICI intensity C/W (FLOPs per byte)", f"{r['ici_intensity_flops_per_byte']:,.0f}"],
        [f"FSDP/DP critical batch per device ({r['torus_axes']} torus axes)",
         f"{r['fsdp_critical_batch_per_device']:,.0f}"],
        ["TP limit on one axis (F / alpha)", f"{r['tensor_parallel_limit']:.1f}"],
        ["optimal FSDP degree sqrt(B/F * Mx/My * N)", f"{r['optimal_fsdp_degree']:,.0f}"],
        ["mixed FSDP+TP critical batch per device 4 alpha^2/(Mx My F)",
         f"{r['mixed_fsdp_tp_critical_batch_per_device']:,.0f}"],
        ["DCN data-parallel critical batch per slice", f"{r['dcn_critical_batch_per_slice']:,.0f}"],
        ["HBM critical batch per device (C / HBM bandwidth)", f"{r['hbm_critical_batch_per_device']:,.0f}"],
        ["largest model for pure DP (HBM / 10 bytes)", si(r["max_params_pure_dp"])],
    ] + ([["CP k/v all-gather intensity seq x H / (KV x |CP|) (hidden while above ICI C/W)",
           f"{r['cp_intensity']:,.0f}"]] if r["cp_intensity"] is not None else []))]


def render_plan(plan: dict[str, Any]) -> str:
    out = [*_summary(plan), "", *_memory(plan), "", *_communication(plan), "", *_time(plan), "",
           *_rules_of_thumb(plan)]
    if plan["warnings"]:
        out += ["", "warnings"] + [f"  - {w}" for w in plan["warnings"]]
    out += ["", "assumptions"] + [f"  - {a}" for a in plan["assumptions"]]
    return "\n".join(out)


def render_recommendations(rec: dict[str, Any]) -> str:
    out = ["", f"recommended meshes for {rec['num_devices']:,} x {rec['hardware']} "
               f"({rec['searched']:,} of {rec['space']:,} candidates planned in {rec['search_s']:.1f} s, "
               f"{rec['feasible']} fit and shard the batch; ranked by predicted step time)"]
    if not rec["best"]:
        out.append("  none: " + rec["why_none"])
        return "\n".join(out)
    rows = [[str(i + 1), seconds(b["step_time_s"]), f"{b['mfu']:.1%}", human_bytes(b["memory_total_bytes"]),
             b["bound"], b["overrides"]] for i, b in enumerate(rec["best"])]
    out.append(table(["#", "step", "MFU", "memory/device", "bound", "overrides"], rows))
    return "\n".join(out)


def render_compiled_candidates(best: list[dict[str, Any]], topology: str) -> str:
    """The recommended meshes' predictions beside XLA:TPU's compile of each for `topology`."""
    out = ["", f"the recommended meshes compiled by XLA:TPU for {topology} (per chip; the compiler's step estimate "
               f"counts a scanned layer loop's body once: scan_layers=false for the whole step)"]
    rows = []
    for i, b in enumerate(best):
        c = b.get("compiled", {})
        if "error" in c:
            rows.append([str(i + 1), seconds(b["step_time_s"]), "-", human_bytes(b["memory_total_bytes"]), "-",
                         c["error"][:60]])
            continue
        step = "-" if c.get("estimated_step_s") is None else (
            seconds(c["estimated_step_s"]) + (" (one layer pass)" if c["loop_body_once"] else ""))
        rows.append([str(i + 1), seconds(b["step_time_s"]), step, human_bytes(b["memory_total_bytes"]),
                     human_bytes(c["peak_bytes"]), "fits" if c["fits"] else "DOES NOT FIT"])
    out.append(table(["#", "predicted step", "compiler's step", "predicted memory", "compiled peak", "HBM"], rows))
    return "\n".join(out)


def render_verify(result: dict[str, Any]) -> str:
    out = [f"maxpar plan --verify: {result['mesh_description']} on {result['num_devices']} "
           f"{result['platform']} devices ({result['backend_note']})"]
    out += [f"  {n}" if n.startswith("  ") else f"  note: {n}" for n in result["notes"]]
    out += ["", f"collectives per step, per device (bytes one device sends; tolerance {result['tolerance']:.0%})"]
    rows = []
    for b in result["buckets"]:
        target = " + ".join(f"{kind} {value:,.0f}" for kind, value in b["predicted_target"].items()) or "-"
        rows.append([b["axis"], b["collective"], f"{b['predicted_bytes']:,.0f}", f"{b['measured_bytes']:,.0f}",
                     "-" if b["error"] is None else f"{b['error']:+.1%}", b["status"], target])
    out.append(table(["axis", "collective", f"predicted ({result['platform']})", "measured", "diff", "status",
                      "predicted on the target"], rows))
    out += ["", "loops (a per-layer collective inside a while loop appears once in the HLO text and runs "
                "trip-count times)"]
    out += [f"  {loop}" for loop in result["loops"]] or ["  none"]
    out += ["", "memory per device (compiled.memory_analysis())"]
    rows = [[m["what"], f"{m['predicted_bytes']:,.0f}", f"{m['measured_bytes']:,.0f}",
             f"{m['error']:+.1%}", f"{m['tolerance']:.0%}", m["status"]] for m in result["memory"]]
    out.append(table(["", "predicted", "measured", "diff", "tolerance", "status"], rows))
    out += ["", f"verify: {'PASS' if result['passed'] else 'FAIL'}"]
    if result["failures"]:
        out += [f"  - {f}" for f in result["failures"]]
    return "\n".join(out)
