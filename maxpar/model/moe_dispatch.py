"""Moving routed tokens to their experts and back, on one device's share of the tokens.

Two dispatch modes, each a pure function of local arrays that `expert_parallel`
runs under `jax.shard_map` (or directly, without a mesh):

- dropless: the token copies are sorted by expert and computed with a grouped
  matmul (`jax.lax.ragged_dot`); nothing is ever dropped.
- capacity: each expert has a fixed buffer of `capacity` slots per row; the
  routing has already marked the overflow as dropped (`routing.capacity_slots`).

Expert parallelism (EP > 1): the expert weights are split over the mesh axes of
their `exp` dimension, which also split the tokens. Each device sends the token
copies routed to experts it does not hold to the device that holds them with an
all-to-all, computes its own experts, and sends the results back with a second
all-to-all. XLA:CPU has no ragged all-to-all, so the dropless exchange uses
fixed-size chunks: each device sends every peer a chunk of
`tokens x min(k, experts per device)` rows (the most any peer can receive from
it), of which only the routed rows are real. Capacity mode sends its buffers,
`capacity_factor x` the routed rows.

The mesh axes come resolved from the run layout (`maxpar.core.layout.ExpertAxes`); no
physical axis name is written here.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from maxpar.core.layout import EXPERT_DOWN, EXPERT_GATE, ExpertAxes
from maxpar.model import fp8 as fp8_matmuls
from maxpar.model.activations import swiglu
from maxpar.model.matmul import Einsum
from maxpar.pipeline.spmd import spread

Array = jax.Array
Axes = tuple[str, ...]
# fp8_scaling=delayed: the amax histories of wi_gate, wi_up and wo, each [experts, OPERANDS, length]; None: none
Histories = tuple[Array | None, Array | None, Array | None]


# ---------------------------------------------------------------- the experts' SwiGLU

@functools.partial(jax.tree_util.register_dataclass, data_fields=["group_sizes"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Grouped:
    """The fp8 products of a grouped matmul (maxpar.model.fp8.Contraction): rows sorted by expert [rows, emb] times
    the experts' weights [experts, emb, out], group g's `group_sizes[g]` rows with expert g's; rows past the groups
    give zeros. The weight gradient contracts each group's rows (a ragged contracting dim)."""

    group_sizes: Array

    def forward(self, x: Array, w: Array) -> Array:
        return jax.lax.ragged_dot(x, w, self.group_sizes, preferred_element_type=jnp.float32)

    def input_gradient(self, g: Array, w: Array) -> Array:
        dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                                 lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        return jax.lax.ragged_dot_general(g, w, self.group_sizes, dims, preferred_element_type=jnp.float32)

    def weight_gradient(self, x: Array, g: Array) -> Array:
        dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                 lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
        return jax.lax.ragged_dot_general(x, g, self.group_sizes, dims, preferred_element_type=jnp.float32)


def _product(dot: Callable[[Array, Array], Array], contraction: fp8_matmuls.Contraction, x: Array, w: Array,
             fp8_axes: Axes | None, history: Array | None = None, experts: Array | None = None) -> Array:
    """dot(x, w) in x's dtype; in fp8 unless fp8_axes is None (amaxes over `fp8_axes`): `contraction`'s products
    on fp8 operands (maxpar.model.fp8.fp8_product) with current global scales, or with `history` the per-expert
    delayed ones (x's rows' `experts`, None: x's leading dim)."""
    if fp8_axes is None:
        return dot(x, w)
    return fp8_matmuls.fp8_product(contraction, x, w, fp8_axes, history, experts).astype(x.dtype)


def _swiglu_grouped(rows: Array, w_gate: Array, w_up: Array, w_down: Array, group_sizes: Array,
                    fp8_axes: Axes | None = None, histories: Histories = (None, None, None)) -> Array:
    """SwiGLU of rows sorted by expert: group g uses expert g's weights. Rows past the groups give zeros."""
    def dot(a, b):
        return jax.lax.ragged_dot(a, b, group_sizes)
    grouped = Grouped(group_sizes)
    experts = None
    if histories[0] is not None:  # each row's expert; past the groups: len(group_sizes)
        experts = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows.shape[0]), side="right")
    h_gate, h_up, h_down = histories
    gate = _product(dot, grouped, rows, w_gate, fp8_axes, h_gate, experts)
    up = _product(dot, grouped, rows, w_up, fp8_axes, h_up, experts)
    return _product(dot, grouped, swiglu(gate, up), w_down, fp8_axes, h_down, experts)


_UP, _DOWN = "xte,xem->xtm", "xtm,xme->xte"  # the capacity buffers [experts, slots, ...] through their experts


def _swiglu_batched(buffers: Array, w_gate: Array, w_up: Array, w_down: Array, fp8_axes: Axes | None = None,
                    histories: Histories = (None, None, None)) -> Array:
    """SwiGLU of per-expert buffers [experts, slots, emb]."""
    up_dot, down_dot = functools.partial(jnp.einsum, _UP), functools.partial(jnp.einsum, _DOWN)
    up, down = Einsum(_UP), Einsum(_DOWN)
    h_gate, h_up, h_down = histories
    gate = _product(up_dot, up, buffers, w_gate, fp8_axes, h_gate)
    hidden = swiglu(gate, _product(up_dot, up, buffers, w_up, fp8_axes, h_up))
    return _product(down_dot, down, hidden, w_down, fp8_axes, h_down)


def _all_to_all(x: Array, axes: Axes, split_axis: int, concat_axis: int) -> Array:
    return jax.lax.all_to_all(x, axes, split_axis, concat_axis, tiled=True) if axes else x


# ---------------------------------------------------------------- dropless

def dropless_local(x: Array, experts: Array, weights: Array, w_gate: Array, w_up: Array, w_down: Array, *,
                   num_experts: int, ep_axes: Axes = (), ep_size: int = 1, fp8_axes: Axes | None = None,
                   histories: Histories = (None, None, None)) -> Array:
    """Every token copy computed by its expert; x [T, emb], experts/weights [T, k] -> [T, emb] (float32).

    The copies are sorted by expert (so also by the device holding it), sent in
    fixed chunks over `ep_axes`, re-sorted by local expert on arrival, computed
    with grouped matmuls, and returned the same way. w_* hold this device's
    `num_experts / ep_size` experts.
    """
    tokens, k = experts.shape
    local_experts = num_experts // ep_size
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)        # copies sorted by expert
    rows = x[order // k]
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    if ep_size == 1:
        out = _swiglu_grouped(rows, w_gate, w_up, w_down, counts, fp8_axes, histories)
    else:
        chunk = tokens * min(k, local_experts)    # the most copies one device can send one peer
        device = flat[order] // local_experts
        per_device = counts.reshape(ep_size, local_experts)
        first = jnp.cumsum(per_device.sum(1)) - per_device.sum(1)
        offset = jnp.arange(tokens * k) - first[device]
        send = jnp.zeros((ep_size, chunk, x.shape[-1]), x.dtype).at[device, offset].set(rows)
        received = _all_to_all(send, ep_axes, 0, 0)                       # [sources, chunk, emb]
        received_counts = _all_to_all(per_device, ep_axes, 0, 0)          # [sources, local experts]
        ends = jnp.cumsum(received_counts, axis=1)
        expert_of = jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(chunk), side="right"))(ends).reshape(-1)
        arrival = jnp.argsort(expert_of, stable=True)                     # by local expert; padding last
        computed = _swiglu_grouped(received.reshape(-1, x.shape[-1])[arrival], w_gate, w_up, w_down,
                                   received_counts.sum(0), fp8_axes, histories)
        computed = jnp.where((expert_of[arrival] < local_experts)[:, None], computed, 0)
        results = jnp.zeros_like(computed).at[arrival].set(computed).reshape(ep_size, chunk, -1)
        out = _all_to_all(results, ep_axes, 0, 0)[device, offset]
    copies = jnp.zeros_like(out).at[order].set(out).reshape(tokens, k, -1)
    return jnp.einsum("tke,tk->te", copies.astype(jnp.float32), weights)


# ---------------------------------------------------------------- capacity

def capacity_local(x: Array, experts: Array, slots: Array, weights: Array, w_gate: Array, w_up: Array,
                   w_down: Array, *, num_experts: int, capacity: int, ep_axes: Axes = (), ep_size: int = 1,
                   fp8_axes: Axes | None = None, histories: Histories = (None, None, None)) -> Array:
    """Fixed per-expert buffers of `capacity` slots per row; x [B, L, emb], experts/slots/weights [B, L, k].

    A dropped copy has slot == capacity: it is written nowhere and reads back
    zero (its weight is zero as well). With EP the buffers of the experts on
    another device are sent there whole (all-to-all) and come back the same way.
    A context shard holds L/C tokens of each row, at most one copy each per expert: where that is less than the
    row's capacity, its kept copies are packed into buffers of L/C slots (the same copies kept, the same results).
    """
    rows, length = x.shape[:2]
    if length < capacity:
        slots, capacity = _packed_slots(experts, slots < capacity, num_experts), length
    row_index = jnp.broadcast_to(jnp.arange(rows)[:, None, None], experts.shape)
    copies = jnp.broadcast_to(x[:, :, None, :], (*experts.shape, x.shape[-1]))
    buffers = jnp.zeros((num_experts, rows, capacity, x.shape[-1]), x.dtype)
    buffers = buffers.at[experts, row_index, slots].set(copies, mode="drop").reshape(num_experts, -1, x.shape[-1])
    buffers = _all_to_all(buffers, ep_axes, 0, 1)          # [local experts, sources x rows x capacity, emb]
    out = _all_to_all(_swiglu_batched(buffers, w_gate, w_up, w_down, fp8_axes, histories), ep_axes, 1, 0)
    out = out.reshape(num_experts, rows, capacity, -1)
    gathered = out.at[experts, row_index, slots].get(mode="fill", fill_value=0)
    return jnp.einsum("blke,blk->ble", gathered.astype(jnp.float32), weights)


def _packed_slots(experts: Array, kept: Array, num_experts: int) -> Array:
    """Each kept copy's rank among the kept copies of its row and expert on this device [B, L, k]; dropped: L."""
    batch, length, k = experts.shape
    onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32) * kept[..., None].astype(jnp.int32)
    flat = onehot.reshape(batch, length * k, num_experts)
    rank = (jnp.cumsum(flat, axis=1) - flat).reshape(onehot.shape)
    return jnp.where(kept, jnp.sum(rank * onehot, axis=-1), length).astype(jnp.int32)


# ---------------------------------------------------------------- running it on the mesh

def on_token_shards(fn: Callable[..., Any], axes: ExpertAxes | None, *arrays: Array,
                    whole: tuple[Array, ...] = (), whole_rows: bool = False) -> Any:
    """fn(*whole, *arrays) applied to each device's tokens: for per-token (per-row) work such as routing.

    The partitioner would all-gather top_k's operand across the batch shards;
    under shard_map each device routes its own tokens, with no collective.
    `whole`: arrays every device takes in full (the routing bias). whole_rows: fn needs every token of its
    rows (capacity slots), so a sequence split over context is gathered first.
    axes None: no mesh (one device, or a reference), fn runs on the whole arrays.
    """
    if axes is None:
        return fn(*whole, *arrays)
    spec = axes.token_spec(whole_rows)
    in_specs = (*(PartitionSpec() for _ in whole), *(spec for _ in arrays))
    return jax.shard_map(fn, mesh=axes.mesh.abstract(), in_specs=in_specs, out_specs=spec)(*whole, *arrays)


def expert_parallel(local: Callable[..., Array], axes: ExpertAxes | None, x: Array, per_token: tuple[Array, ...],
                    w_gate: Array, w_up: Array, w_down: Array, *, flat_tokens: bool, fp8: bool = False,
                    histories: Histories = (None, None, None), **static) -> Array:
    """Run a dispatch function on every device's tokens with its experts; [B, L, emb] in x's dtype.

    With axes None (model.init, a single-device reference) it runs on the whole
    arrays. With the layout's axes: tokens split over the `activation_batch` axes and
    the rows' sequence over the `activation_length` ones (context),
    expert weights over `exp` (EP) and `mlp` (TP), their other dims all-gathered
    here (FSDP; the gradient is reduce-scattered back), TP partial sums added.
    fp8: the experts' matmuls in fp8, each amax a max over the mesh axes that split its tensor; with `histories`
    (fp8_scaling=delayed) per expert, each expert's amaxes a max over the axes that split its tokens or weights
    but not the experts: every device gets a copy of its experts' histories (`spread`: their observations
    combine by max, where the shard_map's transpose would add them).
    """
    emb = x.shape[-1]
    delayed = histories[0] is not None

    def run(x, per_token, w_gate, w_up, w_down, **axes):
        length = x.shape[1]  # this device's share of a row under context parallelism
        if flat_tokens:
            x = x.reshape(-1, emb)
            per_token = tuple(a.reshape(-1, a.shape[-1]) for a in per_token)
        y = local(x, *per_token, w_gate, w_up, w_down, **static, **axes)
        return y.reshape(-1, length, emb).astype(x.dtype)

    if axes is None:
        return run(x, per_token, w_gate, w_up, w_down, fp8_axes=() if fp8 else None, histories=histories)
    # Axes of size 1 are left out: they split nothing, and shard_map would count them as varying.
    token_spec = axes.token_spec()
    gate_spec = PartitionSpec(*(axes.live(a) or None for a in axes.gate))
    down_spec = PartitionSpec(*(axes.live(a) or None for a in axes.down))

    def gather(w: Array, dims: tuple[Axes, ...], logical: tuple[str, ...]) -> Array:
        # Varying over the token axes first, so that the transpose reduce-scatters before it all-reduces.
        spread = tuple(a for a in axes.live(axes.splitting) if not any(a in d for d in dims))
        w = jax.lax.pcast(w, spread, to="varying") if spread else w
        for dim, gathered in enumerate(axes.gathered(dims, logical)):
            if gathered:
                w = jax.lax.all_gather(w, gathered, axis=dim, tiled=True)
        return w

    ep, hidden = axes.live(axes.experts), axes.live(axes.hidden)
    split = axes.live(tuple(dict.fromkeys(axes.splitting + axes.experts + axes.hidden)))
    copies = tuple(a for a in split if a not in ep)  # what splits an expert's tokens or weights

    def body(x, per_token, w_gate, w_up, w_down, histories):
        w_gate, w_up = gather(w_gate, axes.gate, EXPERT_GATE), gather(w_up, axes.gate, EXPERT_GATE)
        w_down = gather(w_down, axes.down, EXPERT_DOWN)
        if hidden:  # TP: one all-reduce of the input gradient in the backward pass, not one per use
            x = jax.lax.pcast(x, hidden, to="varying")
        fp8_axes = None if not fp8 else copies if delayed else split
        y = run(x, per_token, w_gate, w_up, w_down, ep_axes=ep, ep_size=axes.degree(ep), fp8_axes=fp8_axes,
                histories=tuple(h[0] for h in histories) if delayed else histories)
        return jax.lax.psum(y, hidden) if hidden else y

    # Inside a pipeline stage (maxpar.pipeline.spmd) this runs under jax.vmap(spmd_axis_name=stage), whose
    # batching makes every output vary over the stages too, which the varying-axes check does not know of:
    # there (and only there) the check is off; the specs themselves stay right.
    history_spec = PartitionSpec(copies or None, ep or None) if delayed else PartitionSpec()
    sharded = jax.shard_map(body, mesh=axes.mesh.abstract(), in_specs=(token_spec, tuple(token_spec for _ in per_token),
                                                                       gate_spec, gate_spec, down_spec, history_spec),
                            out_specs=token_spec, check_vma=not axes.pipelined)
    return sharded(x, per_token, w_gate, w_up, w_down,
                   spread(histories, axes.degree(copies)) if delayed else histories)
