"""ZeRO-1 (shard_optimizer_over_data): the weights' gradient collectives (`maxpar.plan.weight_comms`) rewritten
for an optimizer state split over `data`, and the updated parameters' all-gather."""

from __future__ import annotations

import dataclasses

from maxpar.plan.comms import BACKWARD, Comm, hierarchical
from maxpar.plan.tensors import Layout, Tensor


def zero_comms(layout: Layout, comms: list[Comm]) -> list[Comm]:
    """`comms` under shard_optimizer_over_data (ZeRO-1): each replica updates only its data shard of a
    parameter, so the gradient is reduce-scattered over `data` instead of all-reduced (the same bytes as
    DP's all-reduce, with the updated parameters' all-gather), as the partitioner emits it:

    - a gradient all-reduced over `data` alone becomes a reduce-scatter;
    - a top-level weight's FSDP reduce-scatter and its `data` all-reduce become one reduce-scatter over
      both (its whole gradient is summed over every batch axis at once);
    - a gradient summed over `data` and other axes together (norm scales, the token table's lookup) stays
      an all-reduce, sliced after;
    - every parameter whose moments `data` splits is all-gathered over it once per step, in its dtype.
    """
    if not layout.config.shard_optimizer_over_data:
        return comms
    params = {t.name: t for t in layout.params()}
    zero_axes = {name: _zero_axes(layout, t) for name, t in params.items()}
    return _zero_gradients(layout, comms, params, zero_axes) + _updated_parameter_gathers(layout, params, zero_axes)


def _zero_gradients(layout: Layout, comms: list[Comm], params: dict[str, Tensor],
                    zero_axes: dict[str, tuple[str, ...]]) -> list[Comm]:
    """`comms` with the gradient reductions over `data` rewritten as `zero_comms` says."""
    out: list[Comm] = []
    merged: set[str] = set()
    for c in comms:
        t = params.get(c.tensor)
        zero = zero_axes.get(c.tensor, ())
        if not zero or c.phase != BACKWARD or c.collective not in ("all-reduce", "reduce-scatter"):
            out.append(c)
        elif c.pattern == "DP gradient all-reduce" and set(c.axes) <= set(zero):
            if t.layered or not _has(comms, c.tensor, "FSDP gradient reduce-scatter"):
                out.append(dataclasses.replace(c, pattern="ZeRO-1 gradient reduce-scatter",
                                               collective="reduce-scatter"))
            # else: merged into the top-level weight's reduce-scatter below
        elif c.pattern == "FSDP gradient reduce-scatter" and not t.layered and c.tensor not in merged:
            merged.add(c.tensor)
            out += _merged_reduce_scatter(layout, c, comms, zero)
        else:
            out.append(c)
    return out


def _updated_parameter_gathers(layout: Layout, params: dict[str, Tensor],
                               zero_axes: dict[str, tuple[str, ...]]) -> list[Comm]:
    """Each replica updated its `data` shard of the parameters whose moments `data` splits: gathered once per step."""
    out: list[Comm] = []
    for name, t in params.items():
        if zero_axes[name]:
            shard = layout.local_bytes(t) / layout.group_degree(zero_axes[name])
            out += hierarchical(layout, "ZeRO-1 updated-parameter all-gather", zero_axes[name], "all-gather", shard,
                                count=1, phase=BACKWARD, dtype=t.dtype, scales=False, tensor=name)
    return out


def _has(comms: list[Comm], tensor: str, pattern: str) -> bool:
    return any(o.tensor == tensor and o.pattern == pattern for o in comms)


def _merged_reduce_scatter(layout: Layout, fsdp: Comm, comms: list[Comm], zero: tuple[str, ...]) -> list[Comm]:
    """A top-level weight's FSDP reduce-scatter with its ZeRO-1 `data` all-reduce folded in: one reduce-scatter
    over both (the weight unchanged when nothing is folded)."""
    dp = [o for o in comms if o.tensor == fsdp.tensor and o.pattern == "DP gradient all-reduce"
          and set(o.axes) <= set(zero)]
    if not dp:
        return [fsdp]
    axes = layout.live(fsdp.axes + tuple(a for o in dp for a in o.axes))
    return hierarchical(layout, "FSDP + ZeRO-1 gradient reduce-scatter", axes, "reduce-scatter", fsdp.operand_bytes,
                        count=fsdp.count, phase=fsdp.phase, dtype=fsdp.dtype, scales=False, tensor=fsdp.tensor)


def _zero_axes(layout: Layout, tensor: Tensor) -> tuple[str, ...]:
    """The axes ZeRO-1 adds to this parameter's optimizer state (shard_optimizer_over_data): its moments'
    shardings, read from the layout, minus the parameter's own."""
    if not layout.config.shard_optimizer_over_data:
        return ()
    suffix = tensor.path.removeprefix(".params")
    moments = [o for o in layout.tensors if o.group == "optimizer" and o.path.endswith(suffix)
               and o.shape == tensor.shape]
    return layout.live(set().union(*(o.axes for o in moments)) - tensor.axes) if moments else ()
