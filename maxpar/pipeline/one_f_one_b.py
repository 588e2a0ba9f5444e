"""Pipeline schedules with an explicit backward (1F1B, zero-bubble) as one SPMD program: forward and backward mixed.

`maxpar.pipeline.spmd` pipelines the forward and lets autodiff derive the backward, which then runs after
every forward: gPipe's order, whatever the forward's. Here the backward is scheduled too. The op table of
`maxpar.core.op_schedule` says, per tick and stage, F (forward) or B (backward) of one microbatch, and one
`lax.scan` over the ticks runs it inside a `jax.shard_map` manual over the stages and the data-parallel
replicas (the other mesh axes, FSDP and tensor, left to the partitioner): each stage of a replica branches
(`lax.switch`) on its own op:
- F: the stage input (stage 0: the microbatch's embedded rows; later stages: what the previous stage sent)
  is kept in a slot of `acts` and the stage's block runs on it. On the last stage the loss head runs too,
  with its VJP: the loss sums, the head's gradient and the cotangent that starts the microbatch's backward.
- B: `jax.vjp` of the block at the kept input (the block's forward is recomputed: only stage inputs are
  kept, one per microbatch in flight, so a stage holds at most S of them, not M) applied to the cotangent
  the next stage sent; the weight gradient accumulates, the input's cotangent goes back.
- zero_bubble splits B: B is the VJP with respect to the stage input only (the cotangent goes back), W the
  VJP with respect to the stage weights at the same kept input and cotangent, which stay in their slots
  until W (each recomputes the block's forward).
- interleaved_1f1b gives each stage R blocks (circular's weights [R, L/R, ...]): an op names its block too, picks
  that block's weights and adds to that block's gradient; block 0 takes the embedded rows, the last the head.
After every tick two `ppermute`s move the F outputs one stage on and the B cotangents one stage back (with R
blocks around the ring: stage S - 1 feeds stage 0's next block); what arrives is written into the receiver's
slot for that (microbatch, block), which `program` assigns from the table.

What it runs is generic: `block_fn(block_params, x, *side) -> (y, stats)` (one stage's layers; stats: a tree of
the block's sums for one microbatch, `{}` for none) and `head_fn(head_params, y, *head_side) -> (objective, sums)`
(the loss of a microbatch: the gradient is taken of `objective`, `sums` are summed over microbatches as they
are). The blocks' stats are summed over microbatches too. With `block_objective(stats, totals) -> scalar` a block
adds its own part to the objective (an auxiliary loss), which may depend on `totals`, the step's sums of the
stats over every microbatch and replica: a forward-only pass of the same op table (its F ops, no head) computes
those before the first backward needs them, and B and W then take the VJP of (y, that part) with cotangent
(the next stage's, 1). It returns the objective's gradient with respect to the stage weights, the head's weights
and the embedded input x: the caller finishes the backward of whatever made x (the embedding) with the latter.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from maxpar.core.layout import merge_microbatches, split_microbatches
from maxpar.core.op_schedule import B, F, W, OpSchedule, op_kinds

Array = jax.Array


class Branch(enum.IntEnum):
    """The branch a device takes at a tick (`lax.switch`'s index, `Program.branch`): FORWARD_HEAD is the last
    block's F, with the loss head; BACKWARD is B unsplit, BACKWARD_INPUT and BACKWARD_WEIGHTS zero_bubble's B and W."""

    IDLE = 0
    FORWARD = 1
    FORWARD_HEAD = 2
    BACKWARD = 3
    BACKWARD_INPUT = 4
    BACKWARD_WEIGHTS = 5


IDLE, FORWARD, FORWARD_HEAD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHTS = Branch


class Program(NamedTuple):
    """The op table as arrays [ticks, S] for the scan, and the slots of the stores: a block input or cotangent
    keeps one slot from the tick it arrives to its last read, so a stage holds as many as are live at once."""

    branch: np.ndarray      # IDLE / FORWARD / FORWARD_HEAD (the last block's F) / BACKWARD[_INPUT|_WEIGHTS]
    microbatch: np.ndarray  # the op's microbatch (0 when idle)
    act_slots: int          # block inputs kept per stage
    cot_slots: int          # cotangents waiting per stage
    repeat: np.ndarray      # which of the stage's blocks the op runs (interleaved_1f1b; else 0)
    act_slot: np.ndarray    # the slot of the op's block input
    cot_slot: np.ndarray    # the slot of the op's cotangent
    act_recv: np.ndarray    # the slot of the block input that arrives after the tick (-1: none)
    cot_recv: np.ndarray    # the slot of the cotangent that arrives after the tick (-1: none)


def _slots(intervals: dict[Any, tuple[int, int]]) -> dict[Any, int]:
    """A slot per value (key: live from tick a to tick b inclusive) such that no two values live at one tick
    share one: the first free slot in order of arrival, which uses as many as are ever live at once."""
    free_at: list[int] = []  # per slot, the first tick it is free from
    slot = {}
    for key, (a, b) in sorted(intervals.items(), key=lambda item: item[1]):
        i = next((i for i, free in enumerate(free_at) if free <= a), len(free_at))
        free_at[i:i + 1] = [b + 1]
        slot[key] = i
    return slot


def program(schedule: OpSchedule) -> Program:
    """`schedule`'s table for the executor: per tick and stage the branch and microbatch, and how many slots
    the stores need so that a value is never overwritten while it is still to be read.

    A block's input is live from the tick it arrives (the tick after the previous block's F; block 0: its own
    F) to its last backward op (W if split, else B); a cotangent from the tick it arrives (after the next
    block's B; the last block: its own F, where the loss head makes it) to the same op. Blocks are stages but
    under interleaved_1f1b, where block v = r S + s is repeat r of stage s.
    """
    s_count, ticks = schedule.num_stages, schedule.num_ticks
    blocks = schedule.num_blocks
    split = W in op_kinds(schedule.kind)
    branch = np.full((ticks, s_count), IDLE, np.int32)
    micro, repeat = np.zeros((ticks, s_count), np.int32), np.zeros((ticks, s_count), np.int32)
    when = {(op.kind, op.microbatch, op.block(s_count)): op.tick for op in schedule.ops()}
    backward = {B: BACKWARD_INPUT if split else BACKWARD, W: BACKWARD_WEIGHTS}
    for (kind, m, v), t in when.items():
        s = v % s_count
        branch[t, s] = backward[kind] if kind in backward else (FORWARD_HEAD if v == blocks - 1 else FORWARD)
        micro[t, s], repeat[t, s] = m, v // s_count
    last = W if split else B
    act_slot, cot_slot = np.zeros_like(micro), np.zeros_like(micro)
    act_recv, cot_recv = np.full_like(micro, -1), np.full_like(micro, -1)
    counts = []
    for s in range(s_count):
        keys = [(m, v) for m in range(schedule.num_microbatches) for v in range(s, blocks, s_count)]
        acts = _slots({(m, v): (when[(F, m, v - 1)] + 1 if v else when[(F, m, v)], when[(last, m, v)])
                       for m, v in keys})
        cots = _slots({(m, v): (when[(B, m, v + 1)] + 1 if v < blocks - 1 else when[(F, m, v)], when[(last, m, v)])
                       for m, v in keys})
        for (m, v), i in acts.items():
            for kind in (F, *op_kinds(schedule.kind)[1:]):
                act_slot[when[(kind, m, v)], s] = i
            if v:
                act_recv[when[(F, m, v - 1)], s] = i
        for (m, v), i in cots.items():
            for kind in op_kinds(schedule.kind):
                cot_slot[when[(kind, m, v)], s] = i
            if v < blocks - 1:
                cot_recv[when[(B, m, v + 1)], s] = i
        counts.append((max(acts.values()) + 1, max(cots.values()) + 1))
    return Program(branch, micro, max(a for a, _ in counts), max(c for _, c in counts), repeat, act_slot, cot_slot,
                   act_recv, cot_recv)


class Grads(NamedTuple):
    sums: Any     # head_fn's sums over every microbatch and replica
    stage: Any    # gradient of the stage weights, leaves [L, ...] like `stage_params`
    head: Any     # gradient of the head's weights
    x: Array      # cotangent of the embedded input [B, ...]
    stats: Any    # block_fn's stats over every microbatch and replica, leaves like `stage_params`'s


class Placement(NamedTuple):
    """Shardings over the mesh axes the executor leaves automatic (FSDP, tensor), on its mesh with the manual
    axes Manual: so that the partitioner keeps the rows split and the gradients as split as the weights."""

    rows: NamedSharding  # a microbatch's stage input and cotangent [b, ...]
    weights: Any         # a stage's weights [L/S, ...] and their float32 gradients, a tree like them
    gathered: Any = None  # the stage weights gathered once before the ticks (None: used as they come)


def _pin(x: Array, sharding: NamedSharding | None, lead: int = 0) -> Array:
    """`x` constrained to `sharding` behind `lead` unsplit leading dims (no constraint without one)."""
    if sharding is None:
        return x
    spec = PartitionSpec(*(None,) * lead, *sharding.spec)
    return jax.lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, spec))


def one_f_one_b(block_fn: Callable[..., tuple[Array, Any]], head_fn: Callable[..., tuple[Array, Any]],
                stage_params: Any, head_params: Any, x: Array, side: Sequence[Array], head_side: Sequence[Array], *,
                schedule: OpSchedule, mesh: AbstractMesh, stage_axes: tuple[str, ...],
                batch_axes: tuple[str, ...], block_objective: Callable[[Any, Any], Array] | None = None,
                placement: Placement | None = None) -> Grads:
    """Run `schedule` (module docstring) over the stages of `stage_axes`, each replica of `batch_axes` on its rows.

    The shard_map is manual over `stage_axes` and `batch_axes` only: the other mesh axes stay automatic, and
    may split the weights and rows inside a stage (FSDP, tensor and expert parallelism) as `placement` and the blocks'
    own constraints say; `batch_axes` must shard no weight.
    stage_params: leaves [L, ...] split over the stages on L (stage s runs layers s L/S ...); with R blocks per
    stage (interleaved_1f1b) circular's [R, L/R, ...] split on L/R (block r S + s: stage s's slice of repeat r).
    x: [B, ...] the stage-0 input; side, head_side: per-row arrays [B, ...] the blocks and the head read.
    """
    prog = program(schedule)
    rows = PartitionSpec(batch_axes or None)
    per_stage = PartitionSpec(stage_axes)
    blocks = per_stage if schedule.num_repeats == 1 else PartitionSpec(None, stage_axes)  # weights, grads, stats
    stacked = PartitionSpec(stage_axes, batch_axes or None)
    run = jax.shard_map(
        lambda *a: _run(block_fn, head_fn, prog, schedule, stage_axes, batch_axes, *a,
                        block_objective=block_objective, placement=placement), mesh=mesh,
        in_specs=(blocks, PartitionSpec(), rows, tuple(rows for _ in side), tuple(rows for _ in head_side)),
        out_specs=(per_stage, blocks, per_stage, stacked, blocks), axis_names={*stage_axes, *batch_axes},
        check_vma=False)
    sums, stage_grads, head_grads, dx, stats = run(stage_params, head_params, x, tuple(side), tuple(head_side))
    last = lambda tree: jax.tree.map(lambda a: a[-1], tree)  # noqa: E731 - only the last stage has the head
    return Grads(sums=last(sums), stage=stage_grads, head=last(head_grads), x=dx[0], stats=stats)


def _zeros(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)


class Carry(NamedTuple):
    """What the scan over the ticks carries on one device (one stage of one replica)."""

    acts: Array      # [act_slots, b, ...] the block inputs kept for their backward ops
    cots: Array      # [cot_slots, b, ...] the cotangents waiting for their backward ops
    dx: Array        # [M, b, ...] the cotangent of each microbatch's stage-0 input
    grads: Any       # float32 gradient of the stage's weights
    head_grads: Any  # float32 gradient of the head's weights (the last stage's)
    sums: Any        # head_fn's sums so far
    stats: Any       # block_fn's stats so far
    send_act: Array  # the F output this stage sends on after the tick
    send_cot: Array  # the input cotangent this stage sends back after the tick


class OpArgs(NamedTuple):
    """One tick's operands for a branch, read from the program at (tick, stage)."""

    microbatch: Array
    repeat: Array    # which of the stage's blocks (0 but under interleaved_1f1b)
    act_slot: Array  # the slot of the block's input
    cot_slot: Array  # the slot of its cotangent


@dataclasses.dataclass(frozen=True)
class StageWork:
    """What one device's ops run on: the block and head functions, the stage's weights and the microbatched inputs
    (stage 0's rows and the per-row side arrays), and how results stay placed (`Placement`)."""

    block_fn: Callable[..., tuple[Array, Any]]
    head_fn: Callable[..., tuple[Array, Any]]
    params: Any
    head_params: Any
    micro_x: Array          # [M, b, ...]
    micro_side: list[Array]
    micro_head: list[Array]
    stage: Array            # this device's stage index
    num_repeats: int
    placement: Placement | None
    block_objective: Callable[[Any, Any], Array] | None

    def pick(self, tree: Any, r: Array) -> Any:
        """The weights (gradient, stats) of the stage's block r: leaves [R, ...] when it has R of them."""
        return tree if self.num_repeats == 1 else jax.tree.map(lambda a: a[r], tree)

    def add_at(self, total: Any, part: Any, r: Array) -> Any:
        add = ((lambda a, g: a + g.astype(jnp.float32)) if self.num_repeats == 1
               else (lambda a, g: a.at[r].add(g.astype(jnp.float32))))
        return jax.tree.map(add, total, part)

    def rows(self, x: Array, lead: int = 0) -> Array:
        return _pin(x, self.placement and self.placement.rows, lead)

    def pin_grads(self, grads: Any) -> Any:
        return grads if self.placement is None else jax.lax.with_sharding_constraint(grads, self.placement.weights)

    def side(self, m: Array) -> list[Array]:
        return [a[m] for a in self.micro_side]

    def head_side(self, m: Array) -> list[Array]:
        return [a[m] for a in self.micro_head]

    def objective_block(self, p: Any, a: Array, m: Array, totals: Any) -> tuple[Array, Array]:
        """(y, the block's part of the objective): what B and W differentiate, with cotangent (cot, 1)."""
        y, stats = self.block_fn(p, a, *self.side(m))
        part = jnp.zeros((), jnp.float32) if totals is None else self.block_objective(stats, totals)
        return y, part.astype(jnp.float32)

    def forward(self, carry: Carry, op: OpArgs, head: bool) -> Carry:
        """F of microbatch m on the stage's block r (the last block's: with the loss head and its VJP)."""
        m, r = op.microbatch, op.repeat
        inputs = jnp.where((self.stage == 0) & (r == 0), self.micro_x[m], carry.acts[op.act_slot])
        y, stats = self.block_fn(self.pick(self.params, r), inputs, *self.side(m))
        carry = carry._replace(acts=carry.acts.at[op.act_slot].set(inputs),
                               stats=self.add_at(carry.stats, stats, r), send_act=y.astype(carry.send_act.dtype))
        if not head:
            return carry
        _, pull, sums = jax.vjp(lambda hp, y: self.head_fn(hp, y, *self.head_side(m)), self.head_params, y,
                                has_aux=True)
        d_head, dy = pull(jnp.ones((), jnp.float32))
        return carry._replace(head_grads=jax.tree.map(lambda a, g: a + g.astype(jnp.float32), carry.head_grads,
                                                      d_head),
                              sums=jax.tree.map(jnp.add, carry.sums, sums),
                              cots=carry.cots.at[op.cot_slot].set(dy.astype(carry.cots.dtype)))

    def backward(self, carry: Carry, op: OpArgs, inputs: bool, weights: bool, totals: Any) -> Carry:
        """B unsplit (inputs and weights), zero_bubble's B (inputs: the cotangent sent back) or its W (weights)."""
        m, r = op.microbatch, op.repeat
        block = partial(self.objective_block, m=m, totals=None if totals is None else self.pick(totals, r))
        mine, act = self.pick(self.params, r), carry.acts[op.act_slot]
        cot = (carry.cots[op.cot_slot], jnp.ones((), jnp.float32))
        if inputs and weights:
            d_params, d_x = jax.vjp(block, mine, act)[1](cot)
        elif inputs:
            (d_x,) = jax.vjp(lambda a: block(mine, a), act)[1](cot)
        else:
            (d_params,) = jax.vjp(lambda p: block(p, act), mine)[1](cot)
        if weights:
            carry = carry._replace(grads=self.pin_grads(self.add_at(carry.grads, d_params, r)))
        if inputs:
            first = (self.stage == 0) & (r == 0)
            carry = carry._replace(dx=carry.dx.at[m].set(jnp.where(first, d_x, carry.dx[m])),
                                   send_cot=d_x.astype(carry.send_cot.dtype))
        return carry

    def branches(self, split: bool, totals: Any, forward_only: bool) -> list[Callable[[Carry, OpArgs], Carry]]:
        """The branch of each `Branch`, in its order; forward_only: F without the head, the backward ops idle
        (the pass that sums the stats). A branch the schedule never takes is idle too (XLA compiles each)."""
        idle = lambda carry, op: carry  # noqa: E731
        table = {Branch.IDLE: idle, Branch.FORWARD: partial(self.forward, head=False),
                 Branch.FORWARD_HEAD: partial(self.forward, head=not forward_only),
                 Branch.BACKWARD: partial(self.backward, inputs=True, weights=True, totals=totals),
                 Branch.BACKWARD_INPUT: partial(self.backward, inputs=True, weights=False, totals=totals),
                 Branch.BACKWARD_WEIGHTS: partial(self.backward, inputs=False, weights=True, totals=totals)}
        taken = {Branch.IDLE, Branch.FORWARD, Branch.FORWARD_HEAD}
        if not forward_only:
            taken |= {Branch.BACKWARD_INPUT, Branch.BACKWARD_WEIGHTS} if split else {Branch.BACKWARD}
        return [table[b] if b in taken else idle for b in Branch]

    def start(self, prog: Program, sums_shape: Any, stats_shape: Any) -> Carry:
        one = self.micro_x[0]
        blank = self.rows(jnp.zeros_like(one))
        return Carry(acts=self.rows(jnp.zeros((prog.act_slots, *one.shape), one.dtype), lead=1),
                     cots=self.rows(jnp.zeros((prog.cot_slots, *one.shape), one.dtype), lead=1),
                     dx=self.rows(jnp.zeros_like(self.micro_x), lead=1), grads=self.pin_grads(_zeros(self.params)),
                     head_grads=_zeros(self.head_params), sums=_zeros(sums_shape), stats=_zeros(stats_shape),
                     send_act=blank, send_cot=blank)


def _tick(work: StageWork, prog: Program, stage_axes: tuple[str, ...], ring: bool,
          branches: list[Callable[[Carry, OpArgs], Carry]], carry: Carry, t: Array, cotangents: bool = True
          ) -> tuple[Carry, None]:
    """Tick t: the stage's op, then the F outputs one stage on and the B cotangents one stage back (ring: with R
    blocks per stage, stage S - 1 feeds stage 0's next block); what arrives goes to the slot `prog` gives it. The
    forward-only pass moves no cotangents (what it writes to their slots is never read)."""
    s_count, at = prog.branch.shape[1], (t, work.stage)
    op = OpArgs(*(jnp.asarray(a)[at] for a in (prog.microbatch, prog.repeat, prog.act_slot, prog.cot_slot)))
    carry = jax.lax.switch(jnp.asarray(prog.branch)[at], branches, carry, op)
    hops = s_count if ring else s_count - 1
    got_act = jax.lax.ppermute(carry.send_act, stage_axes, [(i, (i + 1) % s_count) for i in range(hops)])
    got_cot = (jax.lax.ppermute(carry.send_cot, stage_axes, [((i + 1) % s_count, i) for i in range(hops)])
               if cotangents else carry.send_cot)

    def receive(store: Array, slot: Array, got: Array) -> Array:
        kept = jnp.maximum(slot, 0)
        return work.rows(store.at[kept].set(jnp.where(slot >= 0, got, store[kept])), lead=1)
    return carry._replace(acts=receive(carry.acts, jnp.asarray(prog.act_recv)[at], got_act),
                          cots=receive(carry.cots, jnp.asarray(prog.cot_recv)[at], got_cot),
                          dx=work.rows(carry.dx, lead=1)), None


def _run(block_fn: Callable[..., tuple[Array, Any]], head_fn: Callable[..., tuple[Array, Any]], prog: Program,
         schedule: OpSchedule, stage_axes: tuple[str, ...], batch_axes: tuple[str, ...], params: Any,
         head_params: Any, x: Array, side: tuple[Array, ...], head_side: tuple[Array, ...], *,
         block_objective: Callable[[Any, Any], Array] | None = None, placement: Placement | None = None) -> tuple:
    """One device's part: stage `axis_index(stage_axes)` of its replica, over every tick (with a
    `block_objective`, first over the F ops alone: the step's totals of the blocks' stats)."""
    m_count, repeats = schedule.num_microbatches, schedule.num_repeats
    if placement is not None and placement.gathered is not None:
        params = jax.lax.with_sharding_constraint(params, placement.gathered)
    micro = partial(split_microbatches, num=m_count)
    work = StageWork(block_fn, head_fn, params, head_params,
                     micro_x=_pin(micro(x), placement and placement.rows, lead=1),
                     micro_side=[micro(a) for a in side], micro_head=[micro(a) for a in head_side],
                     stage=jax.lax.axis_index(stage_axes), num_repeats=repeats, placement=placement,
                     block_objective=block_objective)
    one = work.micro_x[0]
    y_shape, stats_shape = jax.eval_shape(lambda: block_fn(work.pick(params, 0), one, *work.side(0)))
    if repeats > 1:
        stats_shape = jax.tree.map(lambda a: jax.ShapeDtypeStruct((repeats, *a.shape), a.dtype), stats_shape)
    sums_shape = jax.eval_shape(lambda: head_fn(head_params, jnp.zeros(y_shape.shape, y_shape.dtype),
                                                *work.head_side(0))[1])
    carry = work.start(prog, sums_shape, stats_shape)
    split, tick = W in op_kinds(schedule.kind), partial(_tick, work, prog, stage_axes, repeats > 1)
    # each replica ran its own rows: the weights' gradients and the sums add up over them
    total = (lambda tree: jax.lax.psum(tree, batch_axes)) if batch_axes else (lambda tree: tree)  # noqa: E731
    totals = None
    if block_objective is not None:  # the F ops alone, over the ticks that hold one
        forward_ticks = np.flatnonzero(np.isin(prog.branch, (Branch.FORWARD, Branch.FORWARD_HEAD)).any(axis=1))
        first, _ = jax.lax.scan(partial(tick, work.branches(split, None, True), cotangents=False), carry,
                                jnp.asarray(forward_ticks))
        totals = total(first.stats)
    carry, _ = jax.lax.scan(partial(tick, work.branches(split, totals, False)), carry, jnp.arange(schedule.num_ticks))
    grads, head_grads, sums, stats = total((carry.grads, carry.head_grads, carry.sums, carry.stats))
    cast = lambda tree, like: jax.tree.map(lambda g, p: g.astype(p.dtype), tree, like)  # noqa: E731
    expand = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731 - a leading stage dim for out_specs
    return (expand(sums), cast(grads, params), expand(cast(head_grads, head_params)),
            merge_microbatches(carry.dx)[None], stats)
