"""Which microbatch and repeat each pipeline stage works on at each iteration: gPipe and circular.

Kept apart from the SPMD implementation (`maxpar.pipeline.spmd`) so the schedule
can be read, printed and tested on its own; the implementation evaluates the
same `stage_task` on arrays of stage indices, so there is one definition.

The layers: with L layers, S stages and R repeats, a *block* is L / (S x R)
consecutive layers; block number r x S + s runs on stage s in repeat r. So with
24 layers, 4 stages and 2 repeats, stage 0 runs layers 0-2 and 12-14, stage 1
runs 3-5 and 15-17 (R = 1 is gPipe: stage s runs one block of L / S layers).

The iterations: there are M x R + S - 1 of them. At iteration t stage s takes
*micro-step* k = t - s: microbatch k mod M, in repeat k div M, when 0 <= k < M x R
(otherwise it idles: the bubble). Stage s hands its result to stage s + 1, which
runs the next block of the same microbatch at t + 1; the last stage hands it back
to stage 0, which needs it M - S + 1 iterations later (the next repeat of that
microbatch), hence M >= S for circular schedules. Every stage is busy M x R of
the M x R + S - 1 iterations: the bubble is (S - 1) / (M x R + S - 1).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple


class ScheduleKind(enum.StrEnum):
    """The pipeline schedules (config key `pipeline_schedule`, `auto` resolved by `resolve`). gPipe and circular
    run here, their backward derived by autodiff; the others are explicit-backward op tables
    (`maxpar.core.op_schedule`) that `maxpar.pipeline.one_f_one_b` executes."""

    GPIPE = "gpipe"
    CIRCULAR = "circular"
    ONE_F_ONE_B = "1f1b"
    ZERO_BUBBLE = "zero_bubble"
    INTERLEAVED_1F1B = "interleaved_1f1b"

    @property
    def explicit_backward(self) -> bool:
        return self not in (ScheduleKind.GPIPE, ScheduleKind.CIRCULAR)

    @staticmethod
    def resolve(name: str, num_repeats: int) -> ScheduleKind:
        """`name` as configured; `auto` is gPipe with one repeat, circular with more."""
        if name == "auto":
            return ScheduleKind.GPIPE if num_repeats == 1 else ScheduleKind.CIRCULAR
        return ScheduleKind(name)


EXPLICIT_BACKWARD = frozenset(kind for kind in ScheduleKind if kind.explicit_backward)


def pipeline_bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Idle fraction of a pipeline: (S - 1) / (R x M + S - 1); gPipe is R = 1."""
    if stages <= 1:
        return 0.0
    return (stages - 1) / (repeats * microbatches + stages - 1)


class Task(NamedTuple):
    """What a stage does at one iteration; python ints/bools, or arrays when given arrays."""

    microbatch: Any
    repeat: Any
    active: Any        # False in the bubble: the stage computes on placeholder data that is dropped


def stage_task(iteration: Any, stage: Any, num_microbatches: int, num_repeats: int) -> Task:
    """The task of `stage` at `iteration` (ints or integer arrays, broadcast together).

    microbatch and repeat are valid indices even when idle (taken modulo M and R), so an
    array implementation can index with them unconditionally and drop the result.
    """
    step = iteration - stage
    return Task(microbatch=step % num_microbatches, repeat=(step // num_microbatches) % num_repeats,
                active=(step >= 0) & (step < num_microbatches * num_repeats))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline of `num_stages` stages over `num_layers` layers, M microbatches, R repeats, run by schedule `kind`
    (by default the forward-only loop: gPipe with one repeat, circular with more). The layout resolves it once
    (`maxpar.core.layout.pipeline_schedule`); every other module reads `kind` and `explicit_backward` from here."""

    num_stages: int
    num_microbatches: int
    num_repeats: int
    num_layers: int
    kind: ScheduleKind | None = None

    def __post_init__(self) -> None:
        if self.kind is None:
            object.__setattr__(self, "kind", ScheduleKind.resolve("auto", self.num_repeats))
        s, m, r, layers = self.num_stages, self.num_microbatches, self.num_repeats, self.num_layers
        if min(s, m, r, layers) < 1 or layers % (s * r):
            raise ValueError(f"no schedule for {layers} layers, {s} stages, {r} repeats, {m} microbatches")
        if r > 1 and m < s:
            raise ValueError(f"a circular schedule needs microbatches >= stages, got {m} < {s}")

    @property
    def explicit_backward(self) -> bool:
        """Whether the schedule runs the backward itself (an op table), not autodiff through the forward loop."""
        return self.kind.explicit_backward

    @property
    def num_iterations(self) -> int:
        return self.num_microbatches * self.num_repeats + self.num_stages - 1

    @property
    def layers_per_block(self) -> int:
        """Consecutive layers a stage runs per repeat: L / (S x R)."""
        return self.num_layers // (self.num_stages * self.num_repeats)

    @property
    def bubble(self) -> float:
        """Idle fraction of every stage, (S - 1) / (R x M + S - 1)."""
        return pipeline_bubble(self.num_stages, self.num_microbatches, self.num_repeats)

    def task(self, iteration: int, stage: int) -> Task:
        return stage_task(iteration, stage, self.num_microbatches, self.num_repeats)

    def layers(self, stage: int, repeat: int) -> range:
        """The layers stage `stage` runs in repeat `repeat`."""
        start = (repeat * self.num_stages + stage) * self.layers_per_block
        return range(start, start + self.layers_per_block)

    def table(self) -> list[list[Task]]:
        """table[t][s]: the task of stage s at iteration t."""
        return [[self.task(t, s) for s in range(self.num_stages)] for t in range(self.num_iterations)]

    def assignment(self) -> str:
        """Which layers each stage holds, e.g. 'stage 0: 0-2, 12-14; stage 1: 3-5, 15-17'."""
        def span(block: range) -> str:
            return f"{block.start}-{block.stop - 1}" if len(block) > 1 else str(block.start)
        return "; ".join(f"stage {s}: " + ", ".join(span(self.layers(s, r)) for r in range(self.num_repeats))
                         for s in range(self.num_stages))

    def describe(self) -> str:
        """One line for the run header: schedule, S, M, R and the bubble."""
        s, m, r = self.num_stages, self.num_microbatches, self.num_repeats
        label = "gPipe" if self.kind == ScheduleKind.GPIPE else self.kind
        return (f"{label} pipeline: S={s} stages, M={m} microbatches, R={r} repeat(s), "
                f"{self.layers_per_block} layer(s) per block, {self.num_iterations} iterations; "
                f"bubble (S-1)/(R*M+S-1) = {s - 1}/{r * m + s - 1} = {self.bubble:.1%}")
