"""Muon's collectives (opt_type=muon): the reshardings of each hidden matrix's update (`maxpar.plan.muon`).

Under the chosen way (spread), each mesh axis that moves from a matrix dim onto the layer (or expert) dim is one
all-to-all there and one back; the matrix axes left are gathered once, dim by dim (the way back is a slice).
The moved arrays are the float32 momenta.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec

from maxpar.core.sharding import entry_axes
from maxpar.plan.comms import BACKWARD, Comm, hierarchical
from maxpar.plan.tensors import Layout
from maxpar.plan.muon import local_bytes, muon_parameters


def muon_comms(layout: Layout) -> list[Comm]:
    """The reshardings of every Muon parameter's update, per step (in the backward phase's network time, as the
    other updates' collectives)."""
    comms: list[Comm] = []
    for p in muon_parameters(layout):
        specs = (p.start, *p.steps)
        for before, after in zip(specs[:-2], specs[1:-1]):  # one axis onto a batch dim: an all-to-all, and one back
            comms += hierarchical(layout, "Muon spread all-to-all", (_moved_axis(before, after),), "all-to-all",
                                  local_bytes(layout, p, before), count=2, phase=BACKWARD, dtype="float32",
                                  scales=False, tensor=p.tensor.name)
        before = specs[-2]
        operand = local_bytes(layout, p, before)
        for entry in reversed(tuple(before)[p.view.batch:]):  # dim by dim, the last first, as the partitioner does
            axes = layout.live(list(entry_axes(entry)))
            comms += hierarchical(layout, "Muon matrix all-gather", axes, "all-gather", operand, count=1,
                                  phase=BACKWARD, dtype="float32", scales=False, tensor=p.tensor.name)
            operand *= layout.group_degree(axes)
    return comms


def _moved_axis(before: PartitionSpec, after: PartitionSpec) -> str:
    """The one axis a spread step moves from a matrix dim to a batch dim."""
    for old, new in zip(before, tuple(after)):
        gone = set(entry_axes(old)) - set(entry_axes(new))
        if gone:
            return gone.pop()
    raise ValueError(f"no axis moves from {before} to {after}")
