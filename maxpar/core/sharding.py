"""Logical axes -> physical mesh axes, driven by `logical_axis_rules` data.

Model code names only logical axes (`maxpar.core.axes.Logical`); this module is the one place that turns
them into mesh axes (`mesh_axes`, used by `maxpar.core.layout` to resolve every decision once) and into
`NamedSharding`s for a mesh and rule set.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from maxpar.core.axes import BATCH_INPUT, ZERO_AXIS, unknown_logical
from maxpar.core.config import AxisRule

Axes = tuple[str, ...]


def entry_axes(entry: None | str | Sequence[str]) -> Axes:
    """The mesh axes of one PartitionSpec entry: None, an axis name, or a tuple of names."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _frozen(rules: Sequence[AxisRule]) -> tuple[AxisRule, ...]:
    return tuple((name, axes if isinstance(axes, str) or axes is None else tuple(axes)) for name, axes in rules)


@functools.lru_cache(maxsize=None)
def _to_mesh_axes(logical: tuple[str | None, ...] | None, rules: tuple[AxisRule, ...]) -> PartitionSpec | None:
    """flax's logical -> mesh PartitionSpec, which depends on the names and rules alone (not on the degrees), so it
    is computed once: the planner lays out the same tensors on hundreds of candidate meshes."""
    return nn.logical_to_mesh_axes(logical, list(rules))


def logical_to_mesh_axes(logical: Sequence[str | None] | None, rules: Sequence[AxisRule]) -> PartitionSpec | None:
    """The mesh PartitionSpec of an array with these logical axes (first applicable rule wins; a rule applies when
    all its mesh axes are still free for the array)."""
    return _to_mesh_axes(None if logical is None else tuple(logical), _frozen(rules))


def mesh_axes(logical: Sequence[str | None], rules: Sequence[AxisRule]) -> list[Axes]:
    """The mesh axes of each dim of an array with these logical axes (first applicable rule wins;
    a rule applies when all its mesh axes are still free for the array)."""
    spec = tuple(logical_to_mesh_axes(logical, rules))
    return [entry_axes(entry) for entry in spec + (None,) * (len(logical) - len(spec))]


def constrain(x: jax.Array, logical: Sequence[str | None], rules: Sequence[AxisRule],
              mesh: Mesh | AbstractMesh | None) -> jax.Array:
    """Sharding constraint by logical axes over `mesh` with `rules`, both given (as MaxText's
    `maybe_shard_with_logical`): nothing ambient is read while tracing, so no mesh or rules context is needed.
    mesh None (no mesh: one device) leaves `x` as it is. An unknown name is an error, never a silently
    unsharded dimension."""
    unknown = unknown_logical(logical)
    if unknown:
        raise ValueError(f"unknown logical axis name(s) {unknown}: define them in maxpar.core.axes.Logical")
    if mesh is None:
        return x
    spec = logical_to_mesh_axes(logical, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def logical_specs(boxed_tree: Any) -> Any:
    """Logical PartitionSpecs of a tree whose leaves carry `nn.Partitioned` metadata."""
    return nn.get_partition_spec(boxed_tree)


def mesh_specs(logical_spec_tree: Any, rules: Sequence[AxisRule]) -> Any:
    """Mesh PartitionSpecs for a tree of logical PartitionSpecs."""
    frozen = _frozen(rules)
    return jax.tree.map(lambda spec: _to_mesh_axes(tuple(spec), frozen), logical_spec_tree,
                        is_leaf=lambda s: isinstance(s, PartitionSpec))


def mesh_shardings(logical_spec_tree: Any, mesh: Mesh, rules: Sequence[AxisRule]) -> Any:
    """NamedShardings for a tree of logical PartitionSpecs."""
    return named_shardings(mesh_specs(logical_spec_tree, rules), mesh)


def named_shardings(spec_tree: Any, mesh: Mesh | AbstractMesh) -> Any:
    """NamedShardings over `mesh` for a tree of mesh PartitionSpecs: a sharding constraint that needs no ambient
    mesh."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), spec_tree,
                        is_leaf=lambda s: isinstance(s, PartitionSpec))


def batch_sharding(mesh: Mesh, rules: Sequence[AxisRule]) -> NamedSharding:
    """Sharding of [batch, length] input arrays."""
    return NamedSharding(mesh, logical_to_mesh_axes(BATCH_INPUT, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def shard_count(sharding: NamedSharding) -> int:
    """Into how many distinct pieces the sharding cuts an array."""
    axes = [a for entry in sharding.spec for a in entry_axes(entry)]
    return math.prod(sharding.mesh.shape[a] for a in axes)


def dim_axes(sharding: NamedSharding, ndim: int) -> list[Axes]:
    """The mesh axes that split each of an array's `ndim` dimensions (() where none does)."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return [entry_axes(entry) for entry in spec]


def dim_degree(sharding: NamedSharding, axes: Sequence[str]) -> int:
    return math.prod(sharding.mesh.shape[a] for a in axes)


class UnevenSplit(NamedTuple):
    """A leaf dimension its sharding does not divide: the leaf's index among the tree's leaves, its path and shape,
    which dimension, and the mesh axes splitting it with their total degree."""
    index: int
    path: Any
    shape: tuple[int, ...]
    dim: int
    axes: Axes
    degree: int

    @property
    def name(self) -> str:
        return jax.tree_util.keystr(self.path)


def uneven_split(abstract_tree: Any, shardings: Any) -> UnevenSplit | None:
    """The first sharded dimension that does not divide evenly, or None."""
    leaves = jax.tree_util.tree_leaves_with_path(abstract_tree)
    for index, ((path, leaf), sharding) in enumerate(zip(leaves, jax.tree_util.tree_leaves(shardings))):
        for dim, (size, axes) in enumerate(zip(leaf.shape, dim_axes(sharding, leaf.ndim))):
            degree = dim_degree(sharding, axes)
            if size % degree:
                return UnevenSplit(index, path, tuple(leaf.shape), dim, axes, degree)
    return None


def _spec_entry(axes: Sequence[str]) -> None | str | tuple[str, ...]:
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def with_zero_axis(shape: Sequence[int], sharding: NamedSharding, axis: str = ZERO_AXIS) -> NamedSharding:
    """ZeRO-1: `sharding` further split over the mesh axis `axis` on the first dimension that it divides.

    The axis goes last in that dimension's entry, so each new shard is a piece of an existing one (the
    gradient's reduce-scatter and the parameters' all-gather stay within the other axes' groups). Arrays
    the axis already splits, scalars, and arrays no dimension of which divides stay as they are.
    """
    degree = dict(sharding.mesh.shape).get(axis, 1)
    dims = dim_axes(sharding, len(shape))
    if degree == 1 or any(axis in axes for axes in dims):
        return sharding
    for index, (size, axes) in enumerate(zip(shape, dims)):
        if size % (dim_degree(sharding, axes) * degree) == 0:
            entries = [_spec_entry(a) for a in dims]
            entries[index] = _spec_entry((*axes, axis))
            return NamedSharding(sharding.mesh, PartitionSpec(*entries))
    return sharding


def shard_optimizer_state(abstract_state: Any, shardings: Any) -> Any:
    """The train state's shardings with every optimizer-state array split over the ZeRO axis too (ZeRO-1)."""
    opt = jax.tree.map(lambda leaf, sharding: with_zero_axis(leaf.shape, sharding), abstract_state.opt_state,
                       shardings.opt_state)
    return shardings.replace(opt_state=opt)
