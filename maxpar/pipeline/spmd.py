"""The pipeline as one SPMD program: a loop of M x R + S - 1 iterations over all stages at once.

What it pipelines is generic: `stage_fn(block_params, block_histories, x, *side) -> (x, stats)` runs one
block of layers (stats: a tree of per-block sums, e.g. the MoE layers' balance-loss sums and drop counts,
added up over the iterations where the stage is active and returned per block; `{}` for none) (the model passes its scanned layer unit applied to stacked
params), and `params` is that unit's stacked parameter tree, leaves
[L, ...] (gPipe) or [R, L / R, ...] (circular; `maxpar.model.stack`).
Which block each stage runs at each iteration comes from
`maxpar.core.schedule.stage_task`, evaluated on the array of stage indices.

Layout, per iteration:
- `state` [S, b, T, E] holds each stage's input, sharded over the stages (the
  logical `layers` axis). `jax.vmap(stage_fn, spmd_axis_name=stage)` runs every
  stage on its own block and microbatch; the stage weights are the stacked
  params reshaped [R, S, L/(S R), ...] with S sharded like the layer stack, so
  every device only touches its own stage's layers.
- `jnp.roll` by one along S moves each output to the next stage: a
  collective-permute (the last stage's output wraps around to stage 0).
- `buffer` [S, M, b, T, E] is stage 0's store of microbatches: it starts as the
  inputs, and each result that comes round from the last stage is written into
  its microbatch's slot, where stage 0 picks it up for the next repeat (circular)
  and where the final outputs end up. Only row 0 is read.

Gradients: the weights are loop-invariant, so their gradient accumulates over the
iterations of the backward loop. To reduce it across data-parallel replicas once per
step rather than once per iteration, the loop runs inside `jax.shard_map` manual
over the batch mesh axes that shard no stage weight: each replica accumulates its
own gradient, and the transpose of the shard_map's replicated weight input sums them
once, after the loop (which axes, the stage weights' specs and the gather mode are resolved with the run
layout: `maxpar.core.layout.PipelineLayout`). FSDP-sharded weights are gathered inside the loop by the
partitioner (per iteration, gradients reduce-scattered per iteration), or, with
`FsdpGather.ONCE`, all-gathered before the loop so their batch axes become manual too
(one gather and one reduction per step; the gathered stage weights stay in memory
for the whole loop). Between the two, `FsdpGather.PER_REPEAT` (the MaxText guide's mode 2)
runs the loop as windows of M iterations, one per repeat, and gathers at the start
of each window the blocks its stages run in it: a stage s switches repeat s
iterations into a window, so every window but the first and the last holds two
repeats' blocks (this one and the previous). The gather is rematerialized, so the
backward pass gathers again rather than keeping the gathered blocks alive.

Histories (fp8 amax histories, `maxpar.model.fp8`) are per-layer state stacked [L, ...] that a block reads and
whose cotangent is what the block observed. Observations combine by max, not by the sum that autodiff gives a
value used many times: the loop carries the histories and forks them per iteration (`_fork`: the backward takes
the max of the two branches' cotangents), an idle stage's read is cut from the gradient, and each data replica
gets its own copy (`spread`: the backward takes the max over the copies), so each layer reports the max over its
microbatches and replicas, as one device does over its whole batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from maxpar.core.axes import Logical
from maxpar.core.layout import ModelLayout, merge_microbatches, split_microbatches
from maxpar.core.schedule import Schedule, Task, stage_task
from maxpar.core.sharding import named_shardings

STAGED = Logical.LAYERS  # the stages are the stacked layers' axis, and the loop's activations follow it

Array = jax.Array
StageFn = Callable[..., Array]


def pipeline(stage_fn: StageFn, params: Any, x: Array, side: Sequence[Array], *, layout: ModelLayout,
             x_axes: Sequence[str], side_axes: Sequence[str], histories: Any = None) -> tuple[Array, Any]:
    """Run `stage_fn` over every layer block, pipelined per `layout.pipeline`; same result as applying the
    blocks in order. `stage_fn(params, histories, x, *side, layout)` gets the model layout the loop runs under
    (`PipelineLayout.inner`: its rules, and the mesh axes its shard_map made manual).

    Returns (x, stats): stats' leaves [R, S, ...], block (r, s)'s sums over every microbatch (and data replica).

    params: the stacked unit's parameters (their specs, manual axes and gather mode are the layout's).
    x: [B, ...] activations with logical axes `x_axes`; side: per-row inputs every block reads
    (e.g. positions), [B, ...] with logical axes `side_axes`. Every constraint and shard_map names its mesh
    (`layout.mesh`; `inner.mesh` inside the loop), so nothing ambient is needed while it is traced.
    histories: per-layer state stacked [L, ...] whose cotangents combine by max (module docstring); {} or None: none.
    """
    histories = {} if histories is None else histories
    pipe = layout.pipeline
    manual, inner = pipe.manual, pipe.inner
    gathered = pipe.gathered_weight_specs()
    if gathered is not None:
        params = jax.lax.with_sharding_constraint(params, named_shardings(gathered, layout.mesh.abstract()))
    block_specs = pipe.gathered_block_specs()
    block_shardings = None if block_specs is None else named_shardings(block_specs, inner.mesh.abstract())

    def loop(params: Any, histories: Any, x: Array, *side: Array) -> tuple[Array, Any]:
        x, stats = _loop(partial(stage_fn, layout=inner), params, histories, x, side, pipe.schedule,
                         pipe.stage_axes, inner, x_axes, side_axes, block_shardings)
        return x, (jax.lax.psum(stats, manual) if manual else stats)  # each replica summed its own rows

    if not manual:
        return loop(params, histories, x, *side)
    rows = PartitionSpec(manual)

    def per_replica(params: Any, copies: Any, x: Array, *side: Array) -> tuple[Array, Any]:
        return loop(params, jax.tree.map(lambda copy: copy[0], copies), x, *side)

    sharded = jax.shard_map(per_replica, mesh=layout.mesh.abstract(),
                            in_specs=(PartitionSpec(), rows, rows, *(rows for _ in side)),
                            out_specs=(rows, PartitionSpec()), axis_names=set(manual), check_vma=False)
    replicas = math.prod(layout.mesh.sizes[axis] for axis in manual)
    return sharded(params, spread(histories, replicas), x, *side)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def spread(tree: Any, copies: int) -> Any:
    """`copies` copies of every leaf along a new leading axis; the backward takes the max over the copies (for
    histories a shard_map hands each shard, whose observations its transpose would add; the MoE experts' too)."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (copies, *a.shape)), tree)


spread.defvjp(lambda tree, copies: (spread(tree, copies), None),
             lambda copies, _, cotangent: (jax.tree.map(lambda c: jnp.max(c, axis=0), cotangent),))


@jax.custom_vjp
def _fork(tree: Any) -> tuple[Any, Any]:
    """(tree, tree); the backward takes the elementwise max of the two cotangents instead of their sum."""
    return tree, tree


_fork.defvjp(lambda tree: (_fork(tree), None), lambda _, cotangents: (jax.tree.map(jnp.maximum, *cotangents),))


def _blocks(params: Any, schedule: Schedule, lead: int | None = None) -> Any:
    """Stacked leaves [L, ...] or [R, L/R, ...] (`lead`: their stacked dims, 1 or 2; None: 2 when circular, as the
    parameters) -> [R, S, L/(S R), ...]: block (r, s) runs on stage s in repeat r."""
    r, s, n = schedule.num_repeats, schedule.num_stages, schedule.layers_per_block
    lead = (1 if r == 1 else 2) if lead is None else lead
    return jax.tree.map(lambda p: p.reshape(r, s, n, *p.shape[lead:]), params)


class LoopCarry(NamedTuple):
    """What the scan over the iterations carries."""

    state: Array   # [S, b, ...] each stage's output of the last iteration, rolled one stage on
    buffer: Array  # [S, M, b, ...] per microbatch: its input to stage 0's next repeat; in the end, the output
    stats: Any     # leaves [R, S, ...]: each block's sums so far
    kept: Any      # the histories' blocks, read by every iteration (their cotangents combine by max: `_fork`)


def per_stage(mask: Array, a: Array, b: Array) -> Array:
    """`a` on the stages where `mask` [S] holds, `b` elsewhere."""
    return jnp.where(mask.reshape(-1, *([1] * (a.ndim - 1))), a, b)


@dataclasses.dataclass(frozen=True)
class Loop:
    """The pipeline loop's fixed parts: the stages' function (vmapped over the stage axis), the schedule, the
    microbatched per-row inputs and the layout `inner` whose rules constrain every activation."""

    run_stages: Callable[..., tuple[Array, Any]]
    schedule: Schedule
    stage_axes: tuple[str, ...]
    inner: ModelLayout
    x_axes: tuple[str, ...]
    side_axes: tuple[str, ...]
    micro_side: list[Array]  # [M, b, ...] each

    def pick(self, tree: Any, task: Task) -> Any:
        """Each stage's block of this iteration: leaves [R, S, ...] -> [S, ...]."""
        if self.schedule.num_repeats == 1:
            return jax.tree.map(lambda p: p[0], tree)
        pick_repeat = jax.vmap(lambda block, r: jax.tree.map(lambda p: p[r], block), in_axes=(1, 0),
                               spmd_axis_name=self.stage_axes)
        return pick_repeat(tree, task.repeat)

    def iteration(self, carry: LoopCarry, t: Array, weights_of: Callable[[Task], Any]) -> tuple[LoopCarry, None]:
        """Iteration t: every stage runs its task on what it was handed (stage 0: a fresh microbatch or one back
        from the last stage), adds its block's stats, and passes its output on."""
        s_count, m_count, r_count = (self.schedule.num_stages, self.schedule.num_microbatches,
                                     self.schedule.num_repeats)
        stages = jnp.arange(s_count)
        task, first = stage_task(t, stages, m_count, r_count), stage_task(t, 0, m_count, r_count)
        fresh = jax.lax.dynamic_index_in_dim(carry.buffer, first.microbatch, axis=1, keepdims=False)
        inputs = per_stage(stages == 0, fresh, carry.state)
        # Tie the weights to this iteration, so that FSDP gathers them here, every iteration, even where
        # they are loop-invariant (gPipe): whether XLA would hoist the gather otherwise depends on dtype
        # and remat. Gathering once before the loop is what pipeline_fsdp_ag_once asks for.
        weights, inputs = jax.lax.optimization_barrier((weights_of(task), inputs))
        side_now = [self.inner.constrain(a[task.microbatch], (STAGED, *self.side_axes)) for a in self.micro_side]
        kept, read = _fork(carry.kept)
        read = jax.tree.map(lambda h: per_stage(task.active, h, jax.lax.stop_gradient(h)), self.pick(read, task))
        outputs, block_stats = self.run_stages(weights, read, inputs, *side_now)
        outputs = self.inner.constrain(outputs, (STAGED, *self.x_axes))
        # Block (repeat, stage) of each active stage adds this iteration's sums; idle stages add nothing.
        slot = ((jnp.arange(r_count)[:, None] == task.repeat[None, :]) & task.active[None, :]).astype(jnp.float32)
        stats = jax.tree.map(lambda acc, new: acc + slot.reshape(*slot.shape, *([1] * (new.ndim - 1))) * new[None],
                             carry.stats, block_stats)
        passed = jnp.roll(outputs, 1, axis=0)  # stage s -> s + 1; the last stage -> stage 0
        last = stage_task(t, s_count - 1, m_count, r_count)
        held = jax.lax.dynamic_index_in_dim(carry.buffer, last.microbatch, axis=1, keepdims=False)
        buffer = jax.lax.dynamic_update_index_in_dim(carry.buffer, jnp.where(last.active, passed, held),
                                                     last.microbatch, axis=1)
        return LoopCarry(passed, buffer, stats, kept), None

    def iterations(self, weights_of: Callable[[Task], Any]) -> Callable[[LoopCarry, Array], tuple[LoopCarry, None]]:
        return partial(self.iteration, weights_of=weights_of)


def _loop(stage_fn: StageFn, params: Any, histories: Any, x: Array, side: Sequence[Array], schedule: Schedule,
          stage_axes: tuple[str, ...], inner: ModelLayout, x_axes: Sequence[str], side_axes: Sequence[str],
          block_shardings: Any = None) -> tuple[Array, Any]:
    """The M x R + S - 1 iterations, constrained by `inner`: rules that name no manual axis, over the loop's mesh.
    Returns (the blocks' output [B, ...], the stats [R, S, ...]).

    block_shardings: gather each repeat's blocks once per window (`FsdpGather.PER_REPEAT`) into these shardings.
    """
    s_count, m_count, r_count = schedule.num_stages, schedule.num_microbatches, schedule.num_repeats
    blocks = _blocks(params, schedule)
    micro_x = inner.constrain(split_microbatches(x, m_count), (None, *x_axes))
    loop = Loop(jax.vmap(stage_fn, spmd_axis_name=stage_axes), schedule, stage_axes, inner, tuple(x_axes),
                tuple(side_axes), [inner.constrain(split_microbatches(a, m_count), (None, *side_axes)) for a in side])
    state = inner.constrain(jnp.zeros((s_count, *micro_x.shape[1:]), x.dtype), (STAGED, *x_axes))
    history_blocks = _blocks(histories, schedule, lead=1)
    task0 = stage_task(0, jnp.arange(s_count), m_count, r_count)
    first_side = [jnp.broadcast_to(inner.constrain(a[0], side_axes), (s_count, *a.shape[1:])) for a in loop.micro_side]
    stats_shape = jax.eval_shape(lambda: loop.run_stages(loop.pick(blocks, task0), loop.pick(history_blocks, task0),
                                                         state, *first_side)[1])
    carry = LoopCarry(state=state,
                      buffer=inner.constrain(jnp.broadcast_to(micro_x, (s_count, *micro_x.shape)),
                                             (STAGED, None, *x_axes)),
                      stats=jax.tree.map(lambda leaf: jnp.zeros((r_count, *leaf.shape), jnp.float32), stats_shape),
                      kept=history_blocks)
    if block_shardings is None:
        carry, _ = jax.lax.scan(loop.iterations(partial(loop.pick, blocks)), carry, jnp.arange(schedule.num_iterations))
    else:
        # FsdpGather.PER_REPEAT: window w runs iterations [w M, (w + 1) M) (the last one the S - 1 after them), in
        # which stage s runs repeat w - 1 for its first s iterations and repeat w after (repeats past R - 1: idle).
        # Each window is rematerialized: the backward pass gathers its blocks and re-runs its forward again, so only
        # one window's gathered blocks (and activations) are alive at a time.
        for window in range(r_count + 1):
            needed = tuple(sorted({min(max(window - 1, 0), r_count - 1), min(window, r_count - 1)}))
            length = m_count if window < r_count else s_count - 1
            if length:
                carry = _window(loop, blocks, carry, block_shardings, needed, window * m_count, length)
    return inner.constrain(merge_microbatches(carry.buffer[0]), tuple(x_axes)), carry.stats


def _window(loop: Loop, blocks: Any, carry: LoopCarry, block_shardings: Any, repeats: tuple[int, ...], start: int,
            length: int) -> LoopCarry:
    """`length` pipeline iterations from `start` with the blocks of `repeats` gathered once for all of them."""
    @jax.checkpoint
    def run(blocks: Any, carry: LoopCarry) -> LoopCarry:
        gathered = [jax.lax.with_sharding_constraint(jax.tree.map(lambda p, r=r: p[r], blocks), block_shardings)
                    for r in repeats]

        def weights_of(task: Task) -> Any:  # a stage still on the earlier repeat takes the earlier block
            if len(gathered) == 1:
                return gathered[0]
            return jax.tree.map(lambda later, earlier: per_stage(task.repeat == repeats[-1], later, earlier),
                                gathered[-1], gathered[0])

        carry, _ = jax.lax.scan(loop.iterations(weights_of), carry, start + jnp.arange(length))
        return carry
    return run(blocks, carry)
