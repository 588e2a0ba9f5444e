"""Pipeline schedules with explicit backward passes: tables of (tick, stage, microbatch, op), op in F | B.

`maxpar.core.schedule` describes the forward-only loop whose backward JAX derives by autodiff (gPipe,
circular): autodiff of a scanned forward runs every backward after every forward, so it cannot express
1F1B. Here the backward is part of the schedule: at each tick every stage runs at most one op on one
microbatch — F (its block's forward) or B (its backward: the cotangents of its input and of its weights) —
and an executor (`maxpar.pipeline.one_f_one_b`) runs the table as it is. One op takes one tick (the
executor's tick costs a backward, which re-runs the forward), and the bubble is counted in ticks.

The tables are built by one list-scheduler: each stage has a fixed *order* of ops (the schedule's policy:
gPipe all F then all B; 1F1B S - s - 1 warm-up forwards then alternating), and runs its next op at the
first tick its inputs are ready:
  F(m, s)  after F(m, s - 1) (its input arrives the tick after);
  B(m, s)  after F(m, s) on the same stage, and after B(m, s + 1) (its cotangent arrives the tick after);
           the last stage's B starts from the loss head's cotangent, computed with its F.
`check` asserts these on any table, so the tests and the executor read one definition.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

F, B = "F", "B"
KINDS = ("gpipe", "1f1b")


class Op(NamedTuple):
    tick: int
    stage: int
    microbatch: int
    kind: str  # F | B


def stage_order(kind: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order in which `stage` runs its ops under schedule `kind`: [(op, microbatch), ...].

    1F1B keeps at most S - s microbatches in flight on stage s (F done, B not yet): that bounds the
    activations a stage holds by S, not M (Narayanan et al., PipeDream-Flush; Megatron-LM's schedule).
    """
    m_all = range(microbatches)
    if kind == "gpipe":
        return [(F, m) for m in m_all] + [(B, m) for m in m_all]
    warmup = min(stages - stage - 1, microbatches)
    order = [(F, m) for m in range(warmup)]
    for m in range(microbatches):  # steady state: F(m + warmup), B(m); the cool-down has no F left
        if m + warmup < microbatches:
            order.append((F, m + warmup))
        order.append((B, m))
    return order


def _ready(op: tuple[str, int], stage: int, stages: int, done: dict[tuple[str, int, int], int]) -> int | None:
    """The first tick `op` of `stage` may run at, given the ticks of the ops `done` so far; None: not yet."""
    kind, m = op
    needs = {F: [(F, m, stage - 1)] if stage else [],
             B: [(F, m, stage)] + ([(B, m, stage + 1)] if stage < stages - 1 else [])}[kind]
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
        orders = [stage_order(self.kind, s, s_count, m_count) for s in range(s_count)]
        position, free = [0] * s_count, [0] * s_count
        done: dict[tuple[str, int, int], int] = {}
        table: list[Op] = []
        while any(position[s] < len(orders[s]) for s in range(s_count)):
            progressed = False
            for s in range(s_count):
                while position[s] < len(orders[s]):
                    op = orders[s][position[s]]
                    tick = _ready(op, s, s_count, done)
                    if tick is None:
                        break
                    tick = max(tick, free[s])
                    done[(op[0], op[1], s)] = tick
                    table.append(Op(tick, s, op[1], op[0]))
                    free[s], position[s], progressed = tick + 1, position[s] + 1, True
            if not progressed:
                raise AssertionError(f"{self.kind}: the stage orders deadlock")
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
        """Per stage, the most microbatches whose F has run and whose B has not: the stage inputs it must hold."""
        peaks = []
        for s in range(self.num_stages):
            live, peak = 0, 0
            for op in self.ops():
                if op.stage == s and op.kind in (F, B):
                    live += 1 if op.kind == F else -1
                    peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def describe(self) -> str:
        """One line for the run header: schedule, S, M, ticks, the bubble counted on the table, stage inputs held."""
        s, m = self.num_stages, self.num_microbatches
        return (f"{self.kind} pipeline: S={s} stages, M={m} microbatches, {self.num_ticks} ticks (a block's forward "
                f"or backward each); bubble {self.bubble:.1%} = (S-1)/(M+S-1); at most "
                f"{max(self.peak_in_flight())} of the M stage inputs held per stage")

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
    expected = {(k, m, s) for k in (F, B) for m in range(schedule.num_microbatches)
                for s in range(schedule.num_stages)}
    assert len(keys) == len(set(keys)) and set(keys) == expected, "not every op exactly once"
    slots = [(op.tick, op.stage) for op in ops]
    assert len(slots) == len(set(slots)), "two ops on one stage at one tick"
    tick = dict(zip(keys, (op.tick for op in ops)))
    for (kind, m, s), t in tick.items():
        ready = _ready((kind, m), s, schedule.num_stages, tick)
        assert ready is not None and t >= ready, f"{kind}{m} on stage {s} at tick {t} before its inputs"
