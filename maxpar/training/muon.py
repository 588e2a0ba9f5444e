"""Muon: the hidden matrices' update is their momentum orthogonalized by a Newton-Schulz iteration.

Muon (Jordan et al., 2024; Liu et al., "Muon is Scalable for LLM Training", 2025) replaces the update of a
projection's weight W [fan_in, fan_out] by the nearest semi-orthogonal matrix to its Nesterov momentum M: U V^T
where M = U S V^T, approximated by five iterations of X <- a X + (b A + c A^2) X, A = X X^T, on X = M / |M|_F
(Jordan's coefficients, which push every singular value into about [0.7, 1.2] fast rather than exactly to 1).
Every direction of the matrix then moves at the same rate, whatever the gradient's spectrum.

Which parameters: the projections inside the attention, MLP and expert blocks (`MUON_ROLES`: q, k, v, out, the
MLA projections, gate/up/down, shared experts, each expert separately, the MTP projection). The embedding table,
the output head, the norm scales, the router and the routing bias keep AdamW (`maxpar.training.optimizer`).

Which matrix: maxpar's weights are often einsum kernels of more than two dims, e.g. the query [embed, heads,
head_dim]; the parameter's role (`maxpar.model.roles.Projection`) says which dims are rows and which columns, so the
query is one [embed, heads x head_dim] matrix and an expert's gate [experts, embed, mlp] is `experts` matrices.
A layer stack's leading dims index one matrix per layer.

Shape scaling: the orthogonalized matrix has RMS about 1/sqrt(max(fan_in, fan_out)). With muon_consistent_rms > 0
(default 0.2, Liu et al.) it is multiplied by muon_consistent_rms x sqrt(max(fan_in, fan_out)), so its RMS matches
a typical AdamW update's and Muon shares AdamW's learning rate and weight decay. muon_consistent_rms = 0 scales it
by sqrt(max(1, fan_out / fan_in)) instead (Jordan's), which wants a learning rate about 10x AdamW's.

Sharding: the iteration needs each matrix whole (|M|_F and X X^T span it). `Orthogonalization.GATHERED` gathers
each layer's matrix onto the devices that split it (the layer and expert dims stay split) and orthogonalizes it
there, the same on each; `SPREAD` (the one maxpar uses) gathers each matrix onto one group of those devices and
spreads the layers (and experts) over the groups, so that each matrix is computed once per group of devices;
`DISTRIBUTED` leaves the matrices split as the parameters are and lets the partitioner split the iteration's
matmuls (collectives in each). All three compute the whole matrix's update; end_to_end/muon_sharding.py measures
them (docs/optimizers.md).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from maxpar.core.sharding import entry_axes
from maxpar.model.roles import ParamRole, param_role

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic: a steep slope at 0, singular values into ~[0.7, 1.2]
NS_STEPS = 5
NS_EPSILON = 1e-7

MUON_ROLES = frozenset({
    ParamRole.QUERY, ParamRole.KEY, ParamRole.VALUE, ParamRole.ATTENTION_OUT,
    ParamRole.QUERY_A, ParamRole.QUERY_B, ParamRole.KEY_VALUE_A, ParamRole.KEY_VALUE_B,
    ParamRole.MLP_GATE, ParamRole.MLP_UP, ParamRole.MLP_DOWN,
    ParamRole.SHARED_GATE, ParamRole.SHARED_UP, ParamRole.SHARED_DOWN,
    ParamRole.EXPERT_GATE, ParamRole.EXPERT_UP, ParamRole.EXPERT_DOWN,
    ParamRole.MTP_PROJECTION,
})

ParamPath = tuple[str, ...]


def dict_keys(key_path: Any) -> ParamPath:
    """A parameter's path in its tree of dicts, whatever wraps its leaf (a logical-axes box, an optimizer's mask)."""
    return tuple(str(key.key) for key in key_path if isinstance(key, jax.tree_util.DictKey))


def is_muon_parameter(path: ParamPath) -> bool:
    return param_role(path) in MUON_ROLES


@dataclasses.dataclass(frozen=True)
class MatrixView:
    """A parameter of shape `shape` as a stack of matrices: its first `batch` dims index them (the layer stack's
    dims, then the role's own, e.g. experts), the next `fan_in` dims flatten into the rows, the rest the columns."""

    shape: tuple[int, ...]
    batch: int
    fan_in: int

    @classmethod
    def of(cls, path: ParamPath, shape: tuple[int, ...]) -> MatrixView:
        role = param_role(path)
        stacked = len(shape) - len(role.axes)  # the layer stack's leading dims
        return cls(tuple(shape), stacked + role.projection.batch, role.projection.inputs)

    @property
    def rows(self) -> int:
        return math.prod(self.shape[self.batch:self.batch + self.fan_in])

    @property
    def columns(self) -> int:
        return math.prod(self.shape[self.batch + self.fan_in:])

    @property
    def count(self) -> int:
        """How many matrices."""
        return math.prod(self.shape[:self.batch])

    def matrices(self, x: jax.Array) -> jax.Array:
        """[*batch dims, rows, columns]: a reshape, since rows and columns are each contiguous dims."""
        return x.reshape(self.shape[:self.batch] + (self.rows, self.columns))

    def shape_scale(self, consistent_rms: float) -> float:
        """What multiplies the orthogonalized matrix (the module docstring's shape scaling)."""
        if consistent_rms > 0:
            return consistent_rms * math.sqrt(max(self.rows, self.columns))
        return math.sqrt(max(1.0, self.columns / self.rows))


def newton_schulz(x: jax.Array, steps: int = NS_STEPS) -> jax.Array:
    """The orthogonalization of each matrix in x [..., m, n] (float32): Jordan's quintic iteration on x / |x|_F,
    on the wide orientation (m <= n: the Gram matrix X X^T is the smaller one)."""
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    x = x / (jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True)) + NS_EPSILON)
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = jnp.einsum("...ik,...jk->...ij", x, x)
        x = a * x + jnp.einsum("...ij,...jk->...ik", b * gram + c * jnp.einsum("...ij,...jk->...ik", gram, gram), x)
    return jnp.swapaxes(x, -1, -2) if tall else x


class Orthogonalization(enum.StrEnum):
    """How a sharded matrix is orthogonalized (the module docstring's Sharding)."""

    GATHERED = "gathered"        # each matrix whole on every device that held a piece of it
    SPREAD = "spread"            # each matrix whole on one group of them: the matrices spread over the others
    DISTRIBUTED = "distributed"  # the matrices left split; the partitioner splits the iteration's matmuls


CHOSEN = Orthogonalization.SPREAD  # the measured choice (docs/optimizers.md, end_to_end/muon_sharding.py)


@dataclasses.dataclass(frozen=True)
class MuonSharding:
    """Where the run's updates live: the mesh and each parameter's update PartitionSpec (the parameters' own, or
    ZeRO-1's), by parameter path; `how` the matrices are orthogonalized."""

    mesh: AbstractMesh
    specs: Mapping[ParamPath, PartitionSpec]
    how: Orthogonalization = CHOSEN

    def pin(self, x: jax.Array, spec: PartitionSpec) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def to_whole(self, path: ParamPath, view: MatrixView) -> Resharding:
        """How the parameter's update goes from its own spec to one where each matrix is whole on the devices that
        orthogonalize it. `SPREAD` moves each mesh axis that splits a matrix onto a batch dim it divides (the
        layers first; one all-to-all each); an axis that divides none goes onto the leading (layer) dim padded with
        zero matrices until it does, when that dim is not split already. Then both ways gather the matrix axes
        left (dim by dim)."""
        sizes = dict(self.mesh.shape)
        spec = tuple(self.specs[path])
        entries = [list(entry_axes(e)) for e in spec + (None,) * (len(view.shape) - len(spec))]
        shape = list(view.shape)
        steps = []
        if self.how == Orthogonalization.SPREAD and view.batch:
            paddable = all(sizes[a] == 1 for a in entries[0])  # padding a split dim would move its shards
            for padding in (False, True):  # where the axes divide first, then onto the padded layer dim
                for source in range(view.batch, len(view.shape)):
                    for axis in [a for a in reversed(entries[source]) if sizes[a] > 1]:  # minor first
                        degree = [math.prod(sizes[a] for a in entries[d]) * sizes[axis] for d in range(view.batch)]
                        target = next((d for d in range(view.batch) if shape[d] % degree[d] == 0), None)
                        if target is None and padding and paddable:
                            target, shape[0] = 0, -(-shape[0] // degree[0]) * degree[0]
                        if target is not None:
                            entries[source].remove(axis)
                            entries[target].append(axis)
                            steps.append(_spec(entries))
        steps.append(_spec(entries[:view.batch] + [[]] * (len(view.shape) - view.batch)))
        return Resharding(padded=shape[0] if view.batch else 0, steps=tuple(steps))


@dataclasses.dataclass(frozen=True)
class Resharding:
    """`MuonSharding.to_whole` of one parameter: the size its leading (layer) dim is padded to with zero matrices
    (its own size: none), then the parameter-shaped specs its update passes through; the last one has each matrix
    whole."""

    padded: int
    steps: tuple[PartitionSpec, ...]

    def view(self, view: MatrixView) -> MatrixView:
        """The matrices once padded."""
        return dataclasses.replace(view, shape=(self.padded, *view.shape[1:])) if view.batch else view


def _spec(entries: list[list[str]]) -> PartitionSpec:
    return PartitionSpec(*(entry[0] if len(entry) == 1 else tuple(entry) if entry else None for entry in entries))


def orthogonalize(path: ParamPath, x: jax.Array, consistent_rms: float, sharding: MuonSharding | None) -> jax.Array:
    """The scaled, orthogonalized update of the Muon parameter at `path` from its (Nesterov) momentum `x`."""
    view = MatrixView.of(path, x.shape)
    scale = view.shape_scale(consistent_rms)
    if sharding is None or sharding.how == Orthogonalization.DISTRIBUTED:
        return (scale * newton_schulz(view.matrices(x))).reshape(x.shape)
    own = sharding.specs[path]
    plan = sharding.to_whole(path, view)
    padded = plan.view(view)
    x = sharding.pin(x, own)  # keeps the momentum's arithmetic where the momentum lives
    if padded.shape != view.shape:  # zero matrices, which orthogonalize to zero
        x = sharding.pin(jnp.pad(x, [(0, padded.shape[0] - view.shape[0])] + [(0, 0)] * (x.ndim - 1)), own)
    for spec in plan.steps:
        x = sharding.pin(x, spec)
    whole = PartitionSpec(*tuple(plan.steps[-1])[:view.batch], None, None)  # whole matrices, no collective
    out = jax.shard_map(newton_schulz, mesh=sharding.mesh, in_specs=whole, out_specs=whole)(padded.matrices(x))
    out = (scale * out).reshape(padded.shape)
    for spec in [*reversed(plan.steps[:-1]), own]:
        out = sharding.pin(out, spec)
    return sharding.pin(out[:view.shape[0]], own) if padded.shape != view.shape else out


class MuonState(NamedTuple):
    momentum: Any  # per Muon parameter, its shape: the gradients' exponential moving average


def scale_by_muon(beta: float, consistent_rms: float, sharding: MuonSharding | None = None
                  ) -> optax.GradientTransformation:
    """Muon's direction for the parameters it is given (others masked out): M <- beta M + (1 - beta) G, then the
    scaled orthogonalization of the Nesterov step (1 - beta) G + beta M (Jordan's). No bias correction: the
    orthogonalization discards the scale. The learning rate and weight decay are applied after it."""

    def init(params: Any) -> MuonState:
        return MuonState(momentum=jax.tree.map(jnp.zeros_like, params))

    def update(updates: Any, state: MuonState, params: Any = None) -> tuple[Any, MuonState]:
        del params
        momentum = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g, state.momentum, updates)
        nesterov = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g, momentum, updates)
        directions = jax.tree_util.tree_map_with_path(
            lambda path, x: orthogonalize(dict_keys(path), x, consistent_rms, sharding), nesterov)
        return directions, MuonState(momentum=momentum)

    return optax.GradientTransformation(init, update)


def newton_schulz_flops(view: MatrixView, steps: int = NS_STEPS) -> float:
    """Matmul FLOPs of orthogonalizing all of a parameter's matrices: per step, on the wide orientation m <= n,
    X X^T (2 m^2 n), A^2 (2 m^3) and (bA + cA^2) X (2 m^2 n)."""
    m, n = sorted((view.rows, view.columns))
    return view.count * steps * (4 * m * m * n + 2 * m ** 3)
