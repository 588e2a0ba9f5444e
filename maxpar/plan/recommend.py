"""Search the meshes (and remat policies, pipeline schedules) that fit the devices and memory; rank them by
predicted step time.

The search keeps what the user fixed about the run (model, batch, sequence, slices) and varies every axis the model
can use, at both levels of the mesh:

- degrees: tensor (within a slice, up to twice the query heads), expert (a mixture of experts: divisors of
  num_experts), stage (divisors of the stacked layers / repeats; each with the pipeline schedules the repeats
  allow), context (sequences of LONG_SEQUENCE tokens and more: within a slice, shards of at least
  MIN_CONTEXT_SHARD tokens, with a block attention core: blockwise, or a configured splash; blockwise is also
  tried alone there); data and FSDP share the rest. A `Family` fixes all but data and FSDP.
- placement: tensor and context stay within a slice; the slices (DCN) take data first, then stages, FSDP and
  experts (`ACROSS_SLICES`: the axes by how much they send per step: a data-parallel reduction once a step,
  stage-to-stage activations, FSDP's weight gathers and the experts' all-to-alls every layer); ICI the rest.
- memory: within a family, turning data parallelism into FSDP only shards more, so memory never grows with the
  FSDP degree, and the remat policies only trade memory for recompute (none > minimal > full). So each family is
  walked from data=1 up, each mesh under the policies in that order: the first that fits is the mesh's fastest
  and is planned; a policy that did not fit is not tried at larger data degrees, and a mesh that does not fit
  under remat=full ends its family. Only a candidate that fits is planned whole (its communication too).

Every candidate goes through the same `evaluate` as the plan itself, so a candidate that the trainer would reject
(a dimension that does not split, a batch that does not shard) is never recommended.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Iterator
from typing import Any

import jax

from maxpar.core.axes import PHYSICAL_AXES, Physical
from maxpar.core.config import BLOCK_ATTENTION, AxisRule, Config, ConfigError
from maxpar.core.layout import TracedState, is_spec
from maxpar.core.mesh import degree_overrides, resolve_mesh_shape
from maxpar.core.sharding import mesh_axes
from maxpar.plan.tensors import Layout
from maxpar.plan.predict import Target, evaluate_layout, memory_fit, plan_batch, plan_layout

REMAT_POLICIES = ("none", "minimal", "full")  # fastest first: a policy only adds recompute
LONG_SEQUENCE = 16384  # from here on the search also tries context parallelism and blockwise attention
MIN_CONTEXT_SHARD = 1024  # tokens per context shard the search goes down to
# The axes the slices (DCN) take, in this order; tensor and context, with per-layer collectives on the
# activations, stay within a slice.
ACROSS_SLICES = (Physical.DATA, Physical.STAGE, Physical.FSDP, Physical.EXPERT)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def schedules(config: Config, stages: int) -> list[str]:
    """The pipeline schedules that run `config`'s repeats on `stages` stages ([config's] without stages): one block
    per stage (gpipe, 1f1b, zero_bubble) or R of them (circular, interleaved_1f1b, which also needs M a multiple
    of S)."""
    if stages == 1:
        return [config.pipeline_schedule]
    if config.num_pipeline_repeats == 1:
        return ["gpipe", "1f1b", "zero_bubble"]
    micro = stages if config.num_pipeline_microbatches == -1 else config.num_pipeline_microbatches
    return ["circular"] + (["interleaved_1f1b"] if micro % stages == 0 else [])


@dataclasses.dataclass(frozen=True)
class Family:
    """The degrees of every axis but data and FSDP (which share the rest of the devices), with the attention
    core and pipeline schedule they run."""
    tensor: int
    expert: int
    stage: int
    context: int
    attention: str
    schedule: str

    def rest(self, num_devices: int) -> int:
        """The devices data x FSDP split (0: these degrees do not divide the devices)."""
        fixed = self.tensor * self.expert * self.stage * self.context
        return num_devices // fixed if num_devices % fixed == 0 else 0

    def degrees(self, data: int, fsdp: int) -> dict[str, int]:
        return {Physical.DATA: data, Physical.FSDP: fsdp, Physical.TENSOR: self.tensor, Physical.EXPERT: self.expert,
                Physical.STAGE: self.stage, Physical.CONTEXT: self.context}


def families(config: Config, target: Target) -> list[Family]:
    """Every family of degrees the model can use on the target (see the module docstring)."""
    per_slice = target.num_devices // target.num_slices
    configured = resolve_mesh_shape(config, target.num_devices, target.num_slices)
    configured_context = configured.degree(Physical.CONTEXT)
    long = config.max_target_length >= LONG_SEQUENCE
    # what a context-parallel candidate attends with: a configured splash serves the all_gather strategy only
    splash_cp = config.attention == "splash" and config.context_parallel_strategy == "all_gather"
    context_attention = config.attention if splash_cp or config.attention == "blockwise" else "blockwise"
    tensors = [t for t in divisors(per_slice) if t <= max(config.num_query_heads, 1) * 2]
    experts = [e for e in divisors(config.num_experts) if target.num_devices % e == 0] if config.num_experts > 1 else [1]
    stages = [s for s in divisors(config.num_stack_layers // config.num_pipeline_repeats) if target.num_devices % s == 0]
    contexts = sorted({configured_context, *([c for c in divisors(per_slice)
                                               if c <= config.max_target_length // MIN_CONTEXT_SHARD] if long else [])})
    found = []
    for context in contexts:
        attentions = ([context_attention] if context > 1 else
                      [config.attention] + (["blockwise"] if long and config.attention not in BLOCK_ATTENTION else []))
        for attention in attentions:
            for tensor in tensors:
                if per_slice % (tensor * context):
                    continue
                for expert in experts:
                    for stage in stages:
                        found += [Family(tensor, expert, stage, context, attention, schedule)
                                  for schedule in schedules(config, stage)]
    return [f for f in found if f.rest(target.num_devices)]


@functools.lru_cache(maxsize=8)
def _split_dims(state: TracedState, rules: tuple[AxisRule, ...]) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """(size, mesh axes) of every parameter dimension the rules shard, each pair once."""
    found = set()
    for leaf, logical in zip(jax.tree_util.tree_leaves(state.abstract.params),
                             jax.tree_util.tree_leaves(state.specs.params, is_leaf=is_spec)):
        found |= {(size, axes) for size, axes in zip(leaf.shape, mesh_axes(tuple(logical), rules)) if axes}
    return tuple(sorted(found))


def splits(degrees: dict[str, int], config: Config, state: TracedState) -> bool:
    """Whether every parameter dimension divides by the degrees of the mesh axes sharding it: the trainer's shape
    check (`maxpar.core.layout.check_splits`) without building a layout, so that meshes it would reject cost
    nothing."""
    return all(size % math.prod(degrees[a] for a in axes) == 0
               for size, axes in _split_dims(state, tuple(config.axis_rules)))


def place(degrees: dict[str, int], target: Target) -> tuple[dict[str, int], dict[str, int]] | None:
    """(ICI, DCN) degrees per axis: the slices take ACROSS_SLICES in order, the other axes stay within a slice;
    None where the degrees cannot fill the slices that way."""
    left = target.num_slices
    dcn = dict.fromkeys(PHYSICAL_AXES, 1)
    for axis in ACROSS_SLICES:
        dcn[axis] = math.gcd(degrees[axis], left)
        left //= dcn[axis]
    if left != 1:
        return None
    return {axis: degrees[axis] // dcn[axis] for axis in PHYSICAL_AXES}, dcn


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One mesh of a family with a remat policy: what `evaluate` plans."""
    family: Family
    ici: dict[str, int]
    dcn: dict[str, int]
    remat: str

    def keys(self) -> dict[str, Any]:
        """Every key the candidate sets."""
        return {**{f"ici_{a}_parallelism": d for a, d in self.ici.items()},
                **{f"dcn_{a}_parallelism": d for a, d in self.dcn.items()},
                "remat_policy": self.remat, "attention": self.family.attention,
                "pipeline_schedule": self.family.schedule}

    def overrides(self, config: Config, target: Target) -> dict[str, Any]:
        """The keys to paste after `config`: ici data / FSDP / tensor and the remat policy always; the degrees of a
        level whose mesh differs from the config's; the attention and schedule where they change."""
        degrees = degree_overrides(config, self.ici, self.dcn, target.num_devices, target.num_slices)
        keys = self.keys()
        always = ("ici_data_parallelism", "ici_fsdp_parallelism", "ici_tensor_parallelism")
        return {**{key: keys[key] for key in always}, **degrees, "remat_policy": self.remat,
                **{key: keys[key] for key in ("attention", "pipeline_schedule") if getattr(config, key) != keys[key]}}


def pasted(overrides: dict[str, Any]) -> str:
    """Overrides as they are pasted after the config on the command line."""
    return " ".join(f"{k}={v}" for k, v in overrides.items())


@dataclasses.dataclass
class Search:
    """The search's running state: what it planned, what fits, and the smallest footprint met (for `why_none`)."""
    config: Config
    target: Target
    state: TracedState
    planned: int = 0
    rejected: int = 0
    feasible: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    smallest: tuple[float, dict[str, Any], bool] | None = None

    def layout(self, candidate: Candidate) -> Layout | None:
        """The candidate's plan layout, None where the trainer would reject it."""
        self.planned += 1
        try:
            return plan_layout(dataclasses.replace(self.config, **candidate.keys()), self.target, self.state)
        except ConfigError:
            self.rejected += 1
            return None

    def rank(self, candidate: Candidate, layout: Layout) -> None:
        """Plan a candidate that fits and shards the batch (its layout built already), and keep it."""
        result = evaluate_layout(layout, self.target, self.state)
        self.feasible.append({"overrides": pasted(candidate.overrides(self.config, self.target)),
                              "step_time_s": result["step_time_s"], "mfu": result["mfu"],
                              "memory_total_bytes": result["memory_per_device_bytes"]["total"],
                              "bound": result["bound"], "mesh": result["mesh_description"]})

    def walk(self, family: Family) -> None:
        """Data degrees from 1 up (FSDP the rest): the fastest policy that fits each mesh, until none fits."""
        policies = REMAT_POLICIES  # those that may still fit: memory grows with the data degree
        for placed in meshes(family, self.config, self.target, self.state):
            for remat in policies:
                candidate = Candidate(family, *placed, remat)
                layout = self.layout(candidate)
                if layout is None:  # the mesh itself: another data degree may split the dims
                    break
                batch = plan_batch(layout.config, layout)
                memory = memory_fit(layout, batch, self.target.hardware)
                if self.smallest is None or memory["total"] < self.smallest[0]:
                    self.smallest = (memory["total"], candidate.overrides(self.config, self.target), batch.shardable)
                if not batch.shardable:  # the batch axes' product is the same for every data degree of a family
                    return
                if memory["fits"]:
                    self.rank(candidate, layout)
                    policies = policies[policies.index(remat):]
                    break
            else:  # not even remat=full fits: no larger data degree does
                return


def meshes(family: Family, config: Config, target: Target, state: TracedState
           ) -> Iterator[tuple[dict[str, int], dict[str, int]]]:
    """The (ICI, DCN) degrees of a family's meshes that split the parameters, data degree from 1 up."""
    rest = family.rest(target.num_devices)
    for data in divisors(rest):
        degrees = family.degrees(data, rest // data)
        placed = place(degrees, target) if splits(degrees, config, state) else None
        if placed is not None:
            yield placed


def candidate_overrides(config: Config, target: Target, state: TracedState) -> list[dict[str, Any]]:
    """Every candidate of the search space, as overrides, before any is pruned by memory: the families' meshes
    under each remat policy."""
    return [Candidate(family, *placed, remat).overrides(config, target) for family in families(config, target)
            for placed in meshes(family, config, target, state) for remat in REMAT_POLICIES]


def why_none(target: Target, rejected: int, smallest: tuple[float, dict[str, Any], bool] | None) -> str:
    """Why no candidate is feasible, from the smallest footprint met (total bytes, overrides, batch shardable)."""
    if smallest is None:
        return f"every mesh split of the devices is rejected ({rejected} candidates): the model's dims do not divide"
    total, overrides, shardable = smallest
    return (f"nothing fits; the smallest footprint is {total / 1e9:,.1f} GB per device of "
            f"{target.hardware.hbm_bytes / 1e9:,.1f} GB (" + pasted(overrides)
            + ("" if shardable else "; its batch does not shard either")
            + "): use more devices, a smaller per_device_batch_size or max_target_length")


def recommend(config: Config, target: Target, state: TracedState, top: int = 5) -> dict[str, Any]:
    """The `top` fastest feasible candidates, with ready-to-paste overrides, and how the search went."""
    start = time.perf_counter()
    search = Search(config, target, state)
    found = families(config, target)
    for family in found:
        search.walk(family)
    feasible = sorted(search.feasible, key=lambda r: (r["step_time_s"], r["memory_total_bytes"]))
    return {"hardware": target.hardware.name, "num_devices": target.num_devices, "families": len(found),
            "space": sum(len(REMAT_POLICIES) for family in found for _ in meshes(family, config, target, state)),
            "searched": search.planned,
            "rejected_by_shapes": search.rejected, "feasible": len(feasible), "best": feasible[:top],
            "search_s": time.perf_counter() - start,
            "why_none": "" if feasible else why_none(target, search.rejected, search.smallest)}
