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
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

F, B, W = "F", "B", "W"
KINDS = ("gpipe", "1f1b", "zero_bubble")


class Op(NamedTuple):
    tick: int
    stage: int
    microbatch: int
    kind: str  # F | B | W


def op_kinds(kind: str) -> tuple[str, ...]:
    """The ops of schedule `kind`: a split backward (B, W) for zero_bubble, one B for the others."""
    return (F, B, W) if kind == "zero_bubble" else (F, B)


def stage_order(kind: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order in which `stage` runs its ops under schedule `kind`: [(op, microbatch), ...].

    1F1B keeps at most S - s microbatches in flight on stage s (F done, B not yet): that bounds the
    activations a stage holds by S, not M (Narayanan et al., PipeDream-Flush; Megatron-LM's schedule).
    ZB-H1 keeps 1F1B's F and B order and defers stage s's W by s microbatches (to the end of the order in
    the cool-down): s + S - s = S in flight on every stage, 1F1B's peak, and the deferred W fill the ticks
    1F1B's stages idle in the cool-down, so the bubble is S - 1 ticks of 3 M + S - 1 instead of 3 (S - 1).
    """
    m_all = range(microbatches)
    if kind == "gpipe":
        return [(F, m) for m in m_all] + [(B, m) for m in m_all]
    warmup = min(stages - stage - 1, microbatches)
    order = [(F, m) for m in range(warmup)]
    deferred: list[int] = []
    for m in range(microbatches):  # steady state: F(m + warmup), B(m); the cool-down has no F left
        if m + warmup < microbatches:
            order.append((F, m + warmup))
        order.append((B, m))
        if kind == "zero_bubble":
            deferred.append(m)
            if len(deferred) > stage and m + warmup < microbatches - 1:
                order.append((W, deferred.pop(0)))
    return order + [(W, m) for m in deferred]


def _ready(op: tuple[str, int], stage: int, stages: int, done: dict[tuple[str, int, int], int]) -> int | None:
    """The first tick `op` of `stage` may run at, given the ticks of the ops `done` so far; None: not yet."""
    kind, m = op
    needs = {F: [(F, m, stage - 1)] if stage else [],
             B: [(F, m, stage)] + ([(B, m, stage + 1)] if stage < stages - 1 else []),
             W: [(B, m, stage)]}[kind]
    if any(n not in done for n in needs):
        return None
    return max((done[n] + 1 for n in needs), default=0)


@dataclasses.dataclass(frozen=True)
class OpSchedule:
    """The op table of schedule `kind` for S stages and M microbatches (one block of L / S layers per stage)."""

    kind: str
    num_stages: int
    num_microbatches: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown schedule {self.kind!r}; valid: {', '.join(KINDS)}")
        if min(self.num_stages, self.num_microbatches) < 1:
            raise ValueError(f"no schedule for {self.num_stages} stages, {self.num_microbatches} microbatches")

    def ops(self) -> list[Op]:
        """Every op with its tick, by list-scheduling each stage's order (module docstring), sorted by tick."""
        s_count, m_count = self.num_stages, self.num_microbatches
        pending = [stage_order(self.kind, s, s_count, m_count) for s in range(s_count)]
        done: dict[tuple[str, int, int], int] = {}
        table: list[Op] = []
        tick = 0
        while any(pending):
            ran = []
            for s in range(s_count):
                runnable = (i for i, op in enumerate(pending[s]) if (i == 0 or op[0] == W)
                            and (ready := _ready(op, s, s_count, done)) is not None and ready <= tick)
                i = next(runnable, None)
                if i is not None:
                    kind, m = pending[s].pop(i)
                    ran.append(((kind, m, s), Op(tick, s, m, kind)))
            if not ran and tick > max(done.values(), default=0) + 1:
                raise AssertionError(f"{self.kind}: the stage orders deadlock")
            for key, op in ran:  # what ran at this tick is ready for others from the next one
                done[key] = tick
                table.append(op)
            tick += 1
        return sorted(table, key=lambda op: (op.tick, op.stage))

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
        """Per stage, the most microbatches whose F has run and whose last backward op (W if split, else B) has
        not: the stage inputs it must hold."""
        last = op_kinds(self.kind)[-1]
        peaks = []
        for s in range(self.num_stages):
            live, peak = 0, 0
            for op in self.ops():
                if op.stage == s and op.kind in (F, last):
                    live += 1 if op.kind == F else -1
                    peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def describe(self) -> str:
        """One line for the run header: schedule, S, M, ticks, the bubble counted on the table, stage inputs held."""
        s, m = self.num_stages, self.num_microbatches
        if self.kind == "zero_bubble":
            ops, formula = "a block's forward, input backward or weight backward each", "(S-1)/(3M+S-1) for M >= S"
        else:
            ops, formula = "a block's forward or backward each", "(S-1)/(M+S-1)"
        return (f"{self.kind} pipeline: S={s} stages, M={m} microbatches, {self.num_ticks} ticks ({ops}); "
                f"bubble {self.bubble:.1%} = {formula}; at most {max(self.peak_in_flight())} of the M stage inputs "
                f"held per stage")

    def render(self) -> str:
        """The table, one line per tick: 't   3 | F2 B0 .  F1' (op and microbatch per stage; '.' idle)."""
        width = len(str(self.num_microbatches - 1)) + 1
        lines = [f"{self.kind}: S={self.num_stages} stages, M={self.num_microbatches} microbatches, "
                 f"{self.num_ticks} ticks, bubble {self.bubble:.1%}"]
        for t, row in enumerate(self.grid()):
            cells = [f"{op.kind}{op.microbatch}" if op else "." for op in row]
            lines.append((f"t {t:3d} | " + " ".join(c.ljust(width) for c in cells)).rstrip())
        return "\n".join(lines)


def check(schedule: OpSchedule) -> None:
    """Assert that `schedule`'s table runs every (microbatch, stage, op) once, one op per stage and tick, each
    after what it depends on (module docstring); raises AssertionError naming the first violation."""
    ops = schedule.ops()
    keys = [(op.kind, op.microbatch, op.stage) for op in ops]
    expected = {(k, m, s) for k in op_kinds(schedule.kind) for m in range(schedule.num_microbatches)
                for s in range(schedule.num_stages)}
    assert len(keys) == len(set(keys)) and set(keys) == expected, "not every op exactly once"
    slots = [(op.tick, op.stage) for op in ops]
    assert len(slots) == len(set(slots)), "two ops on one stage at one tick"
    tick = dict(zip(keys, (op.tick for op in ops)))
    for (kind, m, s), t in tick.items():
        ready = _ready((kind, m), s, schedule.num_stages, tick)
        assert ready is not None and t >= ready, f"{kind}{m} on stage {s} at tick {t} before its inputs"
