"""Whether and how a run pipelines: its schedule from the config, the mesh and the logical rules.

Pure functions of (config, mesh axis sizes, rules, rows): the trainer calls them at
setup, where a bad combination is a ConfigError before anything compiles, and the
model calls them again while it is traced, against the mesh and rules in context.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn

from maxpar.config import AxisRule, Config, ConfigError, check_pipeline
from maxpar.pipeline.schedule import Schedule
from maxpar.sharding import entry_axes

STAGE_AXIS = "stage"        # the physical mesh axis whose degree is the number of stages S
STAGED = "layers"           # logical axis of the stacked layers: the stages split it; activations follow it
REPEATS = "pipeline_repeats"  # logical axis of the R blocks a stage holds in a circular pipeline (unsharded)


def split_repeats(x: Any, repeats: int) -> Any:
    """A circular pipeline's stack: [L, ...] -> [R, L/R, ...] (layer r * L/R + i at [r, i])."""
    return x.reshape(repeats, x.shape[0] // repeats, *x.shape[1:])


def merge_repeats(x: Any) -> Any:
    """[R, L/R, ...] -> [L, ...]: the inverse of `split_repeats`, back to the canonical layer order."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def mesh_axes_of(logical: str, rules: Sequence[AxisRule]) -> tuple[str, ...]:
    """The mesh axes a logical axis name maps to under `rules` (first applicable rule wins)."""
    return entry_axes(nn.logical_to_mesh_axes((logical,), list(rules))[0])


def resolve_schedule(config: Config, axis_sizes: Mapping[str, int], rules: Sequence[AxisRule]) -> Schedule | None:
    """The pipeline schedule on a mesh of `axis_sizes`, or None when it has one stage (layers run in order).

    Raises ConfigError for combinations the schedule cannot run, naming keys and values.
    """
    stages = int(axis_sizes.get(STAGE_AXIS, 1))
    if stages == 1:
        return None
    check_pipeline(config, stages)
    staged = mesh_axes_of(STAGED, rules)
    if staged != (STAGE_AXIS,):
        raise ConfigError(f"{stages} pipeline stages, but logical_axis_rules map the stacked `{STAGED}` axis to "
                          f"{list(staged) or 'no mesh axis'}; pipelining needs the rule [{STAGED}, [{STAGE_AXIS}]] "
                          f"(the stages split the layer stack)")
    micro = config.num_pipeline_microbatches
    return Schedule(num_stages=stages, num_microbatches=stages if micro == -1 else micro,
                    num_repeats=config.num_pipeline_repeats, num_layers=config.num_decoder_layers)


def pipeline_for_run(config: Config, axis_sizes: Mapping[str, int], microbatch_rows: int) -> Schedule | None:
    """Every pipeline check of a run on its resolved mesh (setup time), and its schedule."""
    check_pipeline(config, int(axis_sizes.get(STAGE_AXIS, 1)))
    schedule = resolve_schedule(config, axis_sizes, config.axis_rules)
    if schedule is not None:
        batch_axes = mesh_axes_of("activation_batch", config.axis_rules)
        check_batch(schedule, microbatch_rows, math.prod(axis_sizes[a] for a in batch_axes if a != STAGE_AXIS))
    return schedule


def check_batch(schedule: Schedule, microbatch_rows: int, loop_shards: int) -> None:
    """The rows a step pipelines must split into M microbatches that stay on their devices.

    loop_shards: the batch's pieces inside the loop, where every stage sees all rows of its data-parallel
    shard (that the rows split over all batch axes, stages included, `train.check_batch_layout` checks).
    """
    m = schedule.num_microbatches
    key = f"num_pipeline_microbatches={m}" + (" (-1: the number of stages)" if m == schedule.num_stages else "")
    if microbatch_rows % m:
        raise ConfigError(f"{key} must divide the {microbatch_rows} rows of a step (per_device_batch_size x devices, "
                          f"per gradient-accumulation microbatch)")
    if (microbatch_rows // loop_shards) % m:
        raise ConfigError(f"{key} must divide the {microbatch_rows // loop_shards} rows that each of the "
                          f"{loop_shards} data-parallel shards (mesh axes of activation_batch but the stages) runs "
                          f"through the pipeline, so that every pipeline microbatch stays on its devices; raise "
                          f"per_device_batch_size or change num_pipeline_microbatches")
