"""Pipeline schedules with explicit backward passes: tables of (tick, stage, microbatch, op), op in F | B | W.

`maxpar.core.schedule` describes the forward-only loop whose backward JAX derives by autodiff (gPipe,
circular): autodiff of a scanned forward runs every backward after every forward, so it cannot express
1F1B. Here the backward is part of the schedule: at each tick every stage runs at most one op on one
microbatch — F (its block's forward) or B (its backward: the cotangents of its input and of its weights) —
and an executor (`maxpar.pipeline.one_f_one_b`) runs the table as it is. One op takes one tick (the
executor's tick costs a backward, which re-runs the forward), and the bubble is counted in ticks.
Zero-bubble (ZB-H1, Qi et al. 2023) splits the backward: B is then the input's cotangent only (what the
previous stage waits for) and W the weights' gradient (which nothing waits for), each one tick.

The tables are built by one list-scheduler: each stage has a fixed *order* of ops (the schedule's policy:
gPipe all F then all B; 1F1B S - s - 1 warm-up forwards then alternating; ZB-H1 below), and at each tick
runs its next op if its inputs are ready, else (W only) the first W further on in its order whose B has run:
W fills the ticks a stage would wait. The dependencies:
  F(m, s)  after F(m, s - 1) (its input arrives the tick after);
  B(m, s)  after F(m, s) on the same stage, and after B(m, s + 1) (its cotangent arrives the tick after);
           the last stage's B starts from the loss head's cotangent, computed with its F;
  W(m, s)  after B(m, s) on the same stage.
`check` asserts these on any table, so the tests and the executor read one definition.

Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's virtual pipeline) gives each stage R blocks of
L / (S R) layers, circular's layout (`maxpar.core.schedule`): block v = r S + s is repeat r of stage s. The rules
above then hold per block: F(m, v) after F(m, v - 1) (from stage S - 1 to stage 0 of the next repeat too),
B(m, v) after B(m, v + 1). A tick is one block's op, 1 / R of a 1F1B tick, and the ramp of S - 1 ticks at each
end is the same in ticks: 2 (R M + S - 1) ticks, the bubble (S - 1) / (R M + S - 1), circular's, 1F1B's divided
by about R for M >> S; a stage holds up to 2 (S - s - 1) + (R - 1) S + 1 block inputs (its warm-up's, + 1).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import NamedTuple

from maxpar.core.schedule import ScheduleKind


class OpKind(enum.StrEnum):
    """What a stage runs at one tick: its block's forward, backward (zero_bubble: the input's cotangent only) or
    weight gradient (zero_bubble only)."""

    F = "F"
    B = "B"
    W = "W"


F, B, W = OpKind
# the schedules with a table here: the explicit-backward ones, and gPipe's as the reference they improve on
KINDS = (ScheduleKind.GPIPE, *(kind for kind in ScheduleKind if kind.explicit_backward))


class Op(NamedTuple):
    tick: int
    stage: int
    microbatch: int
    kind: OpKind
    repeat: int = 0  # which of the stage's blocks (interleaved_1f1b): block repeat x S + stage

    def block(self, stages: int) -> int:
        return self.repeat * stages + self.stage


def op_kinds(kind: ScheduleKind) -> tuple[OpKind, ...]:
    """The ops of schedule `kind`: a split backward (B, W) for zero_bubble, one B for the others."""
    return (F, B, W) if kind == ScheduleKind.ZERO_BUBBLE else (F, B)


def stage_order(kind: ScheduleKind, stage: int, stages: int, microbatches: int) -> list[tuple[OpKind, int]]:
    """The order in which `stage` runs its ops under schedule `kind`: [(op, microbatch), ...].

    1F1B keeps at most S - s microbatches in flight on stage s (F done, B not yet): that bounds the
    activations a stage holds by S, not M (Narayanan et al., PipeDream-Flush; Megatron-LM's schedule).
    ZB-H1 keeps 1F1B's F and B order and defers stage s's W by s microbatches (to the end of the order in
    the cool-down): s + S - s = S in flight on every stage, 1F1B's peak, and the deferred W fill the ticks
    1F1B's stages idle in the cool-down, so the bubble is S - 1 ticks of 3 M + S - 1 instead of 3 (S - 1).
    """
    m_all = range(microbatches)
    if kind == ScheduleKind.GPIPE:
        return [(F, m) for m in m_all] + [(B, m) for m in m_all]
    warmup = min(stages - stage - 1, microbatches)
    order = [(F, m) for m in range(warmup)]
    deferred: list[int] = []
    for m in range(microbatches):  # steady state: F(m + warmup), B(m); the cool-down has no F left
        if m + warmup < microbatches:
            order.append((F, m + warmup))
        order.append((B, m))
        if kind == ScheduleKind.ZERO_BUBBLE:
            deferred.append(m)
            if len(deferred) > stage and m + warmup < microbatches - 1:
                order.append((W, deferred.pop(0)))
    return order + [(W, m) for m in deferred]


def interleaved_order(stage: int, stages: int, microbatches: int, repeats: int) -> list[tuple[OpKind, int, int]]:
    """The order of `stage`'s ops under interleaved 1F1B: [(op, microbatch, block), ...] (Megatron-LM's).

    The microbatches go through in groups of S: a group's F over the stage's blocks in repeat order, its B in
    reverse, so that the F of group g's repeat r + 1 finds its inputs, sent by stage S - 1, at stage 0. The
    stage warms up with (S - s - 1) x 2 + (R - 1) x S forwards (Megatron-LM's count: the first B of the last
    block needs every stage's first group through every repeat), then alternates F and B, then cools down.
    """
    group = stages * repeats

    def nth(k: int, backward: bool) -> tuple[int, int]:
        r = (k % group) // stages
        return (k // group) * stages + k % stages, (repeats - 1 - r if backward else r) * stages + stage
    total = microbatches * repeats
    warmup = min((stages - stage - 1) * 2 + (repeats - 1) * stages, total)
    order = [(F, *nth(k, False)) for k in range(warmup)]
    for k in range(total):
        if k + warmup < total:
            order.append((F, *nth(k + warmup, False)))
        order.append((B, *nth(k, True)))
    return order


def held_inputs(kind: ScheduleKind, stages: int, microbatches: int, repeats: int = 1) -> int:
    """The most block inputs one stage holds at once (`OpSchedule.peak_in_flight`'s maximum, stage 0's), without
    building the table: M for gPipe, min(S, M) for 1F1B and ZB-H1, the warm-up + 1 for interleaved 1F1B."""
    if kind == ScheduleKind.GPIPE:
        return microbatches
    if kind == ScheduleKind.INTERLEAVED_1F1B:
        return min(microbatches * repeats, 2 * (stages - 1) + (repeats - 1) * stages + 1)
    return min(stages, microbatches)


def _ready(op: tuple[OpKind, int, int], blocks: int, done: dict[tuple[OpKind, int, int], int]) -> int | None:
    """The first tick `op` (kind, microbatch, block) may run at, given the ticks of the (kind, microbatch, block)
    ops `done` so far, for `blocks` blocks in all (S x R); None: not yet."""
    kind, m, v = op
    needs = {F: [(F, m, v - 1)] if v else [],
             B: [(F, m, v)] + ([(B, m, v + 1)] if v < blocks - 1 else []),
             W: [(B, m, v)]}[kind]
    if any(n not in done for n in needs):
        return None
    return max((done[n] + 1 for n in needs), default=0)


@dataclasses.dataclass(frozen=True)
class OpSchedule:
    """The op table of schedule `kind` for S stages, M microbatches and R blocks per stage (R > 1: interleaved_1f1b
    only; else one block of L / S layers per stage)."""

    kind: ScheduleKind
    num_stages: int
    num_microbatches: int
    num_repeats: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown schedule {self.kind!r}; valid: {', '.join(KINDS)}")
        object.__setattr__(self, "kind", ScheduleKind(self.kind))  # a configured name becomes its enum member
        if min(self.num_stages, self.num_microbatches, self.num_repeats) < 1:
            raise ValueError(f"no schedule for {self.num_stages} stages, {self.num_microbatches} microbatches, "
                             f"{self.num_repeats} repeats")
        if self.kind != "interleaved_1f1b" and self.num_repeats > 1:
            raise ValueError(f"{self.kind} runs one block per stage, not {self.num_repeats}")
        if self.kind == ScheduleKind.INTERLEAVED_1F1B and self.num_microbatches % self.num_stages:
            raise ValueError(f"interleaved_1f1b needs microbatches a multiple of the stages, got "
                             f"{self.num_microbatches} for {self.num_stages}")

    @property
    def num_blocks(self) -> int:
        return self.num_stages * self.num_repeats

    def stage_ops(self, stage: int) -> list[tuple[OpKind, int, int]]:
        """`stage`'s ops in its order: [(op, microbatch, block), ...]."""
        if self.kind == ScheduleKind.INTERLEAVED_1F1B:
            return interleaved_order(stage, self.num_stages, self.num_microbatches, self.num_repeats)
        return [(k, m, stage) for k, m in stage_order(self.kind, stage, self.num_stages, self.num_microbatches)]

    def ops(self) -> list[Op]:
        """Every op with its tick, by list-scheduling each stage's order (module docstring), sorted by tick."""
        return list(self._table())

    @functools.lru_cache(maxsize=256)  # the planner asks for the same few tables over and over
    def _table(self) -> tuple[Op, ...]:
        s_count = self.num_stages
        pending = [self.stage_ops(s) for s in range(s_count)]
        done: dict[tuple[OpKind, int, int], int] = {}
        table: list[Op] = []
        tick = 0
        while any(pending):
            ran = []
            for s in range(s_count):
                runnable = (i for i, op in enumerate(pending[s]) if (i == 0 or op[0] == W)
                            and (ready := _ready(op, self.num_blocks, done)) is not None and ready <= tick)
                i = next(runnable, None)
                if i is not None:
                    kind, m, v = pending[s].pop(i)
                    ran.append(((kind, m, v), Op(tick, s, m, kind, v // s_count)))
            if not ran and tick > max(done.values(), default=0) + 1:
                raise AssertionError(f"{self.kind}: the stage orders deadlock")
            for key, op in ran:  # what ran at this tick is ready for others from the next one
                done[key] = tick
                table.append(op)
            tick += 1
        return tuple(sorted(table, key=lambda op: (op.tick, op.stage)))

    @property
    def num_ticks(self) -> int:
        return max(op.tick for op in self.ops()) + 1

    def grid(self) -> list[list[Op | None]]:
        """grid[t][s]: the op of stage s at tick t, or None (idle: the bubble)."""
        rows: list[list[Op | None]] = [[None] * self.num_stages for _ in range(self.num_ticks)]
        for op in self.ops():
            rows[op.tick][op.stage] = op
        return rows

    @property
    def bubble(self) -> float:
        """Idle fraction of the stages over the schedule's ticks, counted on the table (one op = one tick)."""
        ops = self.ops()
        return 1 - len(ops) / (self.num_ticks * self.num_stages)

    def peak_in_flight(self) -> list[int]:
        """Per stage, the most (microbatch, block) pairs whose F has run and whose last backward op (W if split,
        else B) has not: the stage inputs it must hold."""
        last, ops = op_kinds(self.kind)[-1], self.ops()
        peaks = []
        for s in range(self.num_stages):
            live, peak = 0, 0
            for op in ops:
                if op.stage == s and op.kind in (F, last):
                    live += 1 if op.kind == F else -1
                    peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def describe(self) -> str:
        """One line for the run header: schedule, S, M, ticks, the bubble counted on the table, stage inputs held."""
        s, m = self.num_stages, self.num_microbatches
        if self.kind == ScheduleKind.ZERO_BUBBLE:
            ops, formula = "a block's forward, input backward or weight backward each", "(S-1)/(3M+S-1) for M >= S"
        elif self.kind == ScheduleKind.INTERLEAVED_1F1B:
            ops, formula = (f"one of a stage's R={self.num_repeats} blocks' forward or backward each",
                            "(S-1)/(RM+S-1)")
        else:
            ops, formula = "a block's forward or backward each", "(S-1)/(M+S-1)"
        return (f"{self.kind} pipeline: S={s} stages, M={m} microbatches, {self.num_ticks} ticks ({ops}); "
                f"bubble {self.bubble:.1%} = {formula}; at most {max(self.peak_in_flight())} of the "
                f"{'R*M block' if self.num_repeats > 1 else 'M stage'} inputs held per stage")

    def render(self) -> str:
        """The table, one line per tick: 't   3 | F2 B0 .  F1' (op and microbatch per stage, then '.r' its
        repeat when a stage has R > 1 blocks; '.' idle)."""
        repeats = self.num_repeats > 1
        width = len(str(self.num_microbatches - 1)) + 1 + (len(str(self.num_repeats - 1)) + 1 if repeats else 0)
        lines = [f"{self.kind}: S={self.num_stages} stages, M={self.num_microbatches} microbatches, "
                 + (f"R={self.num_repeats} repeats, " if repeats else "")
                 + f"{self.num_ticks} ticks, bubble {self.bubble:.1%}"]
        for t, row in enumerate(self.grid()):
            cells = [f"{op.kind}{op.microbatch}" + (f".{op.repeat}" if repeats else "") if op else "." for op in row]
            lines.append((f"t {t:3d} | " + " ".join(c.ljust(width) for c in cells)).rstrip())
        return "\n".join(lines)


def check(schedule: OpSchedule) -> None:
    """Assert that `schedule`'s table runs every (microbatch, stage, op) once, one op per stage and tick, each
    after what it depends on (module docstring); raises AssertionError naming the first violation."""
    ops = schedule.ops()
    s_count = schedule.num_stages
    keys = [(op.kind, op.microbatch, op.block(s_count)) for op in ops]
    expected = {(k, m, v) for k in op_kinds(schedule.kind) for m in range(schedule.num_microbatches)
                for v in range(schedule.num_blocks)}
    assert len(keys) == len(set(keys)) and set(keys) == expected, "not every op exactly once"
    slots = [(op.tick, op.stage) for op in ops]
    assert len(slots) == len(set(slots)), "two ops on one stage at one tick"
    tick = dict(zip(keys, (op.tick for op in ops)))
    for (kind, m, v), t in tick.items():
        ready = _ready((kind, m, v), schedule.num_blocks, tick)
        assert ready is not None and t >= ready, (f"{kind}{m} on stage {v % s_count} (block {v}) at tick {t} "
                                                  f"before its inputs")
