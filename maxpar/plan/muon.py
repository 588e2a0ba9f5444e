"""Muon (opt_type=muon) as the planner sees it: which parameters it orthogonalizes, through which shardings, and
the FLOPs and working memory that costs per device (the collectives: `maxpar.plan.muon_comms`).

Read from the optimizer's own plan (`maxpar.training.muon.MuonSharding.to_whole` on the run layout's update
specs), so the planner counts the reshardings the step pins. Each device runs the Newton-Schulz iteration on the
whole matrices it then holds: `newton_schulz_flops` over the split of the layer (and expert) dims.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec

from maxpar.core.sharding import entry_axes
from maxpar.plan.tensors import Layout, Tensor
from maxpar.training.muon import MatrixView, is_muon_parameter, newton_schulz_flops
from maxpar.training.optimizer import muon_sharding

MOMENTUM_BYTES = 4  # the update is computed in float32 (`maxpar.training.optimizer.state_in_dtype`)


@dataclasses.dataclass(frozen=True)
class Orthogonalized:
    """One Muon parameter: its matrices (with the zero matrices that pad its layer dim, if any) and the specs its
    update passes through to have them whole."""

    tensor: Tensor
    view: MatrixView
    start: PartitionSpec
    steps: tuple[PartitionSpec, ...]

    @property
    def size(self) -> int:
        """Elements of its update once padded."""
        return self.view.count * self.view.rows * self.view.columns


def muon_parameters(layout: Layout) -> list[Orthogonalized]:
    """Every parameter Muon orthogonalizes in this layout (none under AdamW)."""
    if layout.config.opt_type != "muon":
        return []
    sharding = muon_sharding(layout.run)
    out = []
    for t in layout.params():
        path = tuple(t.name.split("/"))
        if is_muon_parameter(path):
            view = MatrixView.of(path, t.shape)
            plan = sharding.to_whole(path, view)
            out.append(Orthogonalized(t, plan.view(view), sharding.specs[path], plan.steps))
    return out


def axes_of(spec: PartitionSpec) -> list[str]:
    return [axis for entry in spec for axis in entry_axes(entry)]


def local_bytes(layout: Layout, p: Orthogonalized, spec: PartitionSpec) -> float:
    """Bytes of one device's piece of the (padded) float32 update under `spec`."""
    return p.size * MOMENTUM_BYTES / layout.group_degree(layout.live(axes_of(spec)))


def muon_flops(layout: Layout) -> float:
    """Newton-Schulz FLOPs per device per step: each device orthogonalizes the matrices it holds whole."""
    total = 0.0
    for p in muon_parameters(layout):
        whole = p.steps[-1]
        split = layout.group_degree(layout.live(axes_of(PartitionSpec(*tuple(whole)[:p.view.batch]))))
        total += newton_schulz_flops(p.view) / split
    return total


def muon_working_bytes(layout: Layout) -> float:
    """The largest parameter's whole matrices on one device, float32, about four times (the momentum, its Gram
    matrix and square, the next iterate): the optimizer's working set after the backward pass."""
    sizes = [local_bytes(layout, p, PartitionSpec(*tuple(p.steps[-1])[:p.view.batch])) * 4
             for p in muon_parameters(layout)]
    return max(sizes, default=0.0)
