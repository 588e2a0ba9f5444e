"""Search the meshes (and remat policies) that fit the devices and memory; rank by predicted step time.

The search keeps what the user fixed about the run (model, batch, sequence,
slices, DCN degrees, expert and stage degrees) and varies what is free inside
a slice: the ICI data / FSDP / tensor degrees and the remat policy; for long sequences
(max_target_length >= LONG_SEQUENCE) also the context degree and a block attention core (blockwise, or the
configured splash); with pipeline stages
also the schedule (its bubble and held activations differ; the stacked weights' layout does not). Every
candidate goes through the same `evaluate` as the plan itself, so a candidate
that the trainer would reject (a dimension that does not split, a batch that
does not shard) is never recommended.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maxpar.core.axes import Physical
from maxpar.core.config import BLOCK_ATTENTION, Config, ConfigError
from maxpar.core.mesh import MeshShape
from maxpar.core.layout import TracedState
from maxpar.core.mesh import resolve_mesh_shape
from maxpar.plan.predict import Target, evaluate

REMAT_POLICIES = ("none", "minimal", "full")
LONG_SEQUENCE = 16384  # from here on the search also tries context parallelism and blockwise attention
MIN_CONTEXT_SHARD = 1024  # tokens per context shard the search goes down to


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def schedules(config: Config, mesh: MeshShape) -> list[str]:
    """The pipeline schedules that run `config`'s stages and repeats (none without stages): one block per stage
    (gpipe, 1f1b, zero_bubble) or R of them (circular, interleaved_1f1b, which also needs M a multiple of S)."""
    stages = mesh.degree(Physical.STAGE) if Physical.STAGE in mesh.axis_names else 1
    if stages == 1:
        return []
    if config.num_pipeline_repeats == 1:
        return ["gpipe", "1f1b", "zero_bubble"]
    micro = stages if config.num_pipeline_microbatches == -1 else config.num_pipeline_microbatches
    return ["circular"] + (["interleaved_1f1b"] if micro % stages == 0 else [])


def candidate_overrides(config: Config, target: Target) -> list[dict[str, Any]]:
    """Every (ici data, fsdp, tensor, context, remat, pipeline schedule) split of a slice, other degrees as
    configured.

    The context degree (with a block attention core, which it needs) is searched for long sequences only;
    there blockwise attention is also tried without it (no seq^2 scores) unless a block core is configured.
    """
    mesh = resolve_mesh_shape(config, target.num_devices, target.num_slices)
    ici = dict(zip(mesh.axis_names, mesh.ici))
    free = ici[Physical.DATA] * ici[Physical.FSDP] * ici[Physical.TENSOR] * ici.get(Physical.CONTEXT, 1)
    long = config.max_target_length >= LONG_SEQUENCE
    attentions = [config.attention] + (["blockwise"] if long and config.attention not in BLOCK_ATTENTION else [])
    # splash serves context parallelism with the all_gather strategy only
    splash_cp = config.attention == "splash" and config.context_parallel_strategy == "all_gather"
    context_attention = config.attention if splash_cp or config.attention == "blockwise" else "blockwise"
    found = []
    configured = ici.get(Physical.CONTEXT, 1)
    # Shards of at least MIN_CONTEXT_SHARD tokens: below that the per-layer k/v traffic outweighs the split.
    contexts = [c for c in divisors(free) if c == configured or c <= config.max_target_length // MIN_CONTEXT_SHARD]
    for context in contexts if long else [configured]:
        for attention in attentions if context == 1 else [context_attention]:
            extra: dict[str, Any] = {}
            if context != configured:
                extra["ici_context_parallelism"] = context
            if attention != config.attention:
                extra["attention"] = attention
            for tensor in divisors(free // context):
                if tensor > max(config.num_query_heads, 1) * 2:
                    break
                for data in divisors(free // context // tensor):
                    for remat in REMAT_POLICIES:
                        found.append({"ici_data_parallelism": data,
                                      "ici_fsdp_parallelism": free // context // tensor // data,
                                      "ici_tensor_parallelism": tensor, "remat_policy": remat, **extra})
    kinds = schedules(config, mesh)
    return [{**overrides, "pipeline_schedule": kind} for overrides in found for kind in kinds] if kinds else found


def pasted(overrides: dict[str, Any]) -> str:
    """Overrides as they are pasted after the config on the command line."""
    return " ".join(f"{k}={v}" for k, v in overrides.items())


def why_none(target: Target, rejected: int, smallest: tuple[float, dict[str, Any], bool] | None) -> str:
    """Why no candidate is feasible, from the smallest footprint met (total bytes, overrides, batch shardable)."""
    if smallest is None:
        return f"every mesh split of the slice is rejected ({rejected} candidates): the model's dims do not divide"
    total, overrides, shardable = smallest
    return (f"nothing fits; the smallest footprint is {total / 1e9:,.1f} GB per device of "
            f"{target.hardware.hbm_bytes / 1e9:,.1f} GB (" + pasted(overrides)
            + ("" if shardable else "; its batch does not shard either")
            + "): use more devices, a smaller per_device_batch_size or max_target_length")


def recommend(config: Config, target: Target, state: TracedState, top: int = 5) -> dict[str, Any]:
    """The `top` fastest feasible candidates, with ready-to-paste overrides."""
    mesh = resolve_mesh_shape(config, target.num_devices, target.num_slices)
    fixed = {f"ici_{a}_parallelism": d for a, d in zip(mesh.axis_names, mesh.ici)
             if a in (Physical.EXPERT, Physical.STAGE)}
    fixed.update({f"dcn_{a}_parallelism": d for a, d in zip(mesh.axis_names, mesh.dcn)})
    feasible, rejected, smallest = [], 0, None
    candidates = candidate_overrides(config, target)
    for overrides in candidates:
        candidate = dataclasses.replace(config, **fixed, **overrides)
        try:
            result = evaluate(candidate, target, state)  # the run layout's checks, context ones included
        except ConfigError:
            rejected += 1
            continue
        memory = result["memory_per_device_bytes"]
        if smallest is None or memory["total"] < smallest[0]:
            smallest = (memory["total"], overrides, result["batch_shardable"])
        if not memory["fits"] or not result["batch_shardable"]:
            continue
        feasible.append({"overrides": pasted(overrides), "step_time_s": result["step_time_s"], "mfu": result["mfu"],
                         "memory_total_bytes": memory["total"], "bound": result["bound"],
                         "mesh": result["mesh_description"]})
    feasible.sort(key=lambda r: (r["step_time_s"], r["memory_total_bytes"]))
    return {"hardware": target.hardware.name, "num_devices": target.num_devices, "searched": len(candidates),
            "rejected_by_shapes": rejected, "feasible": len(feasible), "best": feasible[:top],
            "why_none": "" if feasible else why_none(target, rejected, smallest)}
