"""Pipeline schedules with an explicit backward (1F1B, zero-bubble) as one SPMD program: forward and backward mixed.

`maxpar.pipeline.spmd` pipelines the forward and lets autodiff derive the backward, which then runs after
every forward: gPipe's order, whatever the forward's. Here the backward is scheduled too. The op table of
`maxpar.core.op_schedule` says, per tick and stage, F (forward) or B (backward) of one microbatch, and one
`lax.scan` over the ticks runs it inside a `jax.shard_map` manual over every mesh axis: each device is one
stage of one data-parallel replica and branches (`lax.switch`) on its own op:
- F: the stage input (stage 0: the microbatch's embedded rows; later stages: what the previous stage sent)
  is kept in a slot of `acts` and the stage's block runs on it. On the last stage the loss head runs too,
  with its VJP: the loss sums, the head's gradient and the cotangent that starts the microbatch's backward.
- B: `jax.vjp` of the block at the kept input (the block's forward is recomputed: only stage inputs are
  kept, one per microbatch in flight, so a stage holds at most S of them, not M) applied to the cotangent
  the next stage sent; the weight gradient accumulates, the input's cotangent goes back.
- zero_bubble splits B: B is the VJP with respect to the stage input only (the cotangent goes back), W the
  VJP with respect to the stage weights at the same kept input and cotangent, which stay in their slots
  until W (each recomputes the block's forward).
After every tick two `ppermute`s move the F outputs one stage on and the B cotangents one stage back; what
arrives is written into the receiver's slot for that microbatch (which slot: `slot_counts`, from the table).

What it runs is generic: `block_fn(block_params, x, *side) -> y` (one stage's layers) and
`head_fn(head_params, y, *head_side) -> (objective, sums)` (the loss of a microbatch: the gradient is taken of
`objective`, `sums` are summed over microbatches as they are). It returns the objective's gradient with respect
to the stage weights, the head's weights and the embedded input x: the caller finishes the backward of
whatever made x (the embedding) with the latter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, PartitionSpec

from maxpar.core.layout import merge_microbatches, split_microbatches
from maxpar.core.op_schedule import B, F, W, OpSchedule, op_kinds

Array = jax.Array
# The branch each device takes at a tick: BACKWARD is B unsplit, BACKWARD_INPUT and BACKWARD_WEIGHTS B and W.
IDLE, FORWARD, FORWARD_HEAD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHTS = range(6)


class Program(NamedTuple):
    """The op table as arrays [ticks, S] for the scan, and the slot counts of the stores."""

    branch: np.ndarray      # IDLE / FORWARD / FORWARD_HEAD (the last stage's F) / BACKWARD[_INPUT|_WEIGHTS]
    microbatch: np.ndarray  # the op's microbatch (0 when idle)
    act_slots: int          # stage inputs kept per stage: microbatch m in slot m % act_slots
    cot_slots: int          # cotangents waiting per stage: microbatch m in slot m % cot_slots


def _fewest_slots(intervals: Sequence[tuple[int, int, int]]) -> int:
    """The least K such that values (microbatch m, live from tick a to tick b inclusive) kept in slot m % K
    never overwrite one another on one stage."""
    for k in range(1, len(intervals) + 1):
        by_slot: dict[int, list[tuple[int, int]]] = {}
        for m, a, b in intervals:
            by_slot.setdefault(m % k, []).append((a, b))
        if all(x[1] < y[0] for spans in by_slot.values() for x, y in zip(sorted(spans), sorted(spans)[1:])):
            return k
    return max(len(intervals), 1)


def program(schedule: OpSchedule) -> Program:
    """`schedule`'s table for the executor: per tick and stage the branch and microbatch, and how many slots
    the stores need so that a value is never overwritten while it is still to be read.

    A stage input is live from the tick it arrives (the tick after the previous stage's F; stage 0: its own F)
    to its last backward op (W if split, else B); a cotangent from the tick it arrives (after the next stage's
    B; the last stage: its own F, where the loss head makes it) to the same op.
    """
    s_count, ticks = schedule.num_stages, schedule.num_ticks
    split = W in op_kinds(schedule.kind)
    branch = np.full((ticks, s_count), IDLE, np.int32)
    micro = np.zeros((ticks, s_count), np.int32)
    when = {(op.kind, op.microbatch, op.stage): op.tick for op in schedule.ops()}
    backward = {B: BACKWARD_INPUT if split else BACKWARD, W: BACKWARD_WEIGHTS}
    for (kind, m, s), t in when.items():
        branch[t, s] = backward[kind] if kind in backward else (FORWARD_HEAD if s == s_count - 1 else FORWARD)
        micro[t, s] = m
    last = W if split else B
    acts, cots = [], []
    for s in range(s_count):
        ms = range(schedule.num_microbatches)
        acts.append(_fewest_slots([(m, when[(F, m, s - 1)] + 1 if s else when[(F, m, s)], when[(last, m, s)])
                                   for m in ms]))
        cots.append(_fewest_slots([(m, when[(B, m, s + 1)] + 1 if s < s_count - 1 else when[(F, m, s)],
                                    when[(last, m, s)]) for m in ms]))
    return Program(branch, micro, max(acts), max(cots))


class Grads(NamedTuple):
    sums: Any     # head_fn's sums over every microbatch and replica
    stage: Any    # gradient of the stage weights, leaves [L, ...] like `stage_params`
    head: Any     # gradient of the head's weights
    x: Array      # cotangent of the embedded input [B, ...]


def one_f_one_b(block_fn: Callable[..., Array], head_fn: Callable[..., tuple[Array, Any]], stage_params: Any,
                head_params: Any, x: Array, side: Sequence[Array], head_side: Sequence[Array], *,
                schedule: OpSchedule, mesh: AbstractMesh, stage_axes: tuple[str, ...],
                batch_axes: tuple[str, ...]) -> Grads:
    """Run `schedule` (module docstring) over the stages of `stage_axes`, each replica of `batch_axes` on its rows.

    stage_params: leaves [L, ...] split over the stages on L (stage s runs layers s L/S ...); every other mesh
    axis must leave them and `head_params` whole (no FSDP or tensor parallelism inside the stages).
    x: [B, ...] the stage-0 input; side, head_side: per-row arrays [B, ...] the blocks and the head read.
    """
    prog = program(schedule)
    rows = PartitionSpec(batch_axes or None)
    per_stage = PartitionSpec(stage_axes)
    stacked = PartitionSpec(stage_axes, batch_axes or None)
    run = jax.shard_map(
        lambda *a: _run(block_fn, head_fn, prog, schedule, stage_axes, batch_axes, *a), mesh=mesh,
        in_specs=(per_stage, PartitionSpec(), rows, tuple(rows for _ in side), tuple(rows for _ in head_side)),
        out_specs=(per_stage, per_stage, per_stage, stacked), check_vma=False)
    sums, stage_grads, head_grads, dx = run(stage_params, head_params, x, tuple(side), tuple(head_side))
    last = lambda tree: jax.tree.map(lambda a: a[-1], tree)  # noqa: E731 - only the last stage has the head
    return Grads(sums=last(sums), stage=stage_grads, head=last(head_grads), x=dx[0])


def _zeros(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)


def _run(block_fn: Callable[..., Array], head_fn: Callable[..., tuple[Array, Any]], prog: Program,
         schedule: OpSchedule, stage_axes: tuple[str, ...], batch_axes: tuple[str, ...], params: Any,
         head_params: Any, x: Array, side: tuple[Array, ...], head_side: tuple[Array, ...]) -> tuple:
    """One device's part: stage `axis_index(stage_axes)` of its replica, over every tick."""
    s_count, m_count = schedule.num_stages, schedule.num_microbatches
    stage = jax.lax.axis_index(stage_axes)
    micro_x = split_microbatches(x, m_count)
    micro_side = [split_microbatches(a, m_count) for a in side]
    micro_head = [split_microbatches(a, m_count) for a in head_side]
    take = lambda arrays, m: [a[m] for a in arrays]  # noqa: E731
    one = micro_x[0]
    sums_shape = jax.eval_shape(lambda: head_fn(head_params, block_fn(params, one, *take(micro_side, 0)),
                                                *take(micro_head, 0))[1])

    def forward(carry, m, head: bool):
        acts, cots, dx, grads, head_grads, sums, _, send_cot = carry
        slot = m % prog.act_slots
        inputs = jnp.where(stage == 0, micro_x[m], acts[slot])
        acts = acts.at[slot].set(inputs)
        y = block_fn(params, inputs, *take(micro_side, m))
        if head:
            _, pull, new_sums = jax.vjp(lambda hp, y: head_fn(hp, y, *take(micro_head, m)), head_params, y,
                                        has_aux=True)
            d_head, dy = pull(jnp.ones((), jnp.float32))
            head_grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), head_grads, d_head)
            sums = jax.tree.map(jnp.add, sums, new_sums)
            cots = cots.at[m % prog.cot_slots].set(dy.astype(cots.dtype))
        return acts, cots, dx, grads, head_grads, sums, y.astype(one.dtype), send_cot

    def backward(carry, m, inputs: bool, weights: bool):
        """B unsplit (both), zero_bubble's B (inputs: the cotangent sent back) or W (weights)."""
        acts, cots, dx, grads, head_grads, sums, send_act, send_cot = carry
        block = lambda p, a: block_fn(p, a, *take(micro_side, m))  # noqa: E731
        act, cot = acts[m % prog.act_slots], cots[m % prog.cot_slots]
        if inputs and weights:
            d_params, d_x = jax.vjp(block, params, act)[1](cot)
        elif inputs:
            (d_x,) = jax.vjp(lambda a: block(params, a), act)[1](cot)
        else:
            (d_params,) = jax.vjp(lambda p: block(p, act), params)[1](cot)
        if weights:
            grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads, d_params)
        if inputs:
            dx = dx.at[m].set(jnp.where(stage == 0, d_x, dx[m]))
            send_cot = d_x.astype(one.dtype)
        return acts, cots, dx, grads, head_grads, sums, send_act, send_cot

    idle = lambda c, m: c  # noqa: E731 - also the branches the schedule never takes: XLA compiles each branch
    split = W in op_kinds(schedule.kind)
    branches = [idle, lambda c, m: forward(c, m, False), lambda c, m: forward(c, m, True),
                idle if split else (lambda c, m: backward(c, m, True, True)),
                (lambda c, m: backward(c, m, True, False)) if split else idle,
                (lambda c, m: backward(c, m, False, True)) if split else idle]
    forward_perm = [(i, i + 1) for i in range(s_count - 1)]
    backward_perm = [(i + 1, i) for i in range(s_count - 1)]
    branch_rows, micro_rows = jnp.asarray(prog.branch), jnp.asarray(prog.microbatch)

    def tick(carry, t):
        carry = jax.lax.switch(branch_rows[t, stage], branches, carry, micro_rows[t, stage])
        acts, cots, dx, grads, head_grads, sums, send_act, send_cot = carry
        got_act = jax.lax.ppermute(send_act, stage_axes, forward_perm)
        got_cot = jax.lax.ppermute(send_cot, stage_axes, backward_perm)
        # What arrived: the previous stage's F output, the next stage's B cotangent (if they ran one).
        prev, nxt = jnp.maximum(stage - 1, 0), jnp.minimum(stage + 1, s_count - 1)
        act_in = (stage > 0) & (branch_rows[t, prev] == FORWARD)
        cot_in = (stage < s_count - 1) & jnp.isin(branch_rows[t, nxt], jnp.array([BACKWARD, BACKWARD_INPUT]))
        a_slot, c_slot = micro_rows[t, prev] % prog.act_slots, micro_rows[t, nxt] % prog.cot_slots
        acts = acts.at[a_slot].set(jnp.where(act_in, got_act, acts[a_slot]))
        cots = cots.at[c_slot].set(jnp.where(cot_in, got_cot, cots[c_slot]))
        return (acts, cots, dx, grads, head_grads, sums, send_act, send_cot), None

    blank = jnp.zeros_like(one)
    carry = (jnp.zeros((prog.act_slots, *one.shape), one.dtype), jnp.zeros((prog.cot_slots, *one.shape), one.dtype),
             jnp.zeros_like(micro_x), _zeros(params), _zeros(head_params), _zeros(sums_shape), blank, blank)
    carry, _ = jax.lax.scan(tick, carry, jnp.arange(schedule.num_ticks))
    _, _, dx, grads, head_grads, sums, _, _ = carry
    if batch_axes:  # each replica ran its own rows: the weights' gradients and the sums add up over them
        grads, head_grads, sums = jax.lax.psum((grads, head_grads, sums), batch_axes)
    cast = lambda tree, like: jax.tree.map(lambda g, p: g.astype(p.dtype), tree, like)  # noqa: E731
    expand = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731 - a leading stage dim for out_specs
    return (expand(sums), cast(grads, params), expand(cast(head_grads, head_params)),
            merge_microbatches(dx)[None])
