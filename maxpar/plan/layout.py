"""Where every array of a run lives: the train state's shardings and the activations' mesh axes.

The planner must reason about exactly the shardings the trainer would use, so
it builds them with the trainer's own pieces (`init_state`, `logical_specs`,
`mesh_shardings`, `check_divisible`, `batch_sharding`) on a
`jax.sharding.AbstractMesh`: no devices are needed, and a mesh the trainer
would reject (a dimension that does not divide) is rejected here with the same
message. The model is traced once (`abstract_model_state`) and re-sharded
cheaply for every candidate mesh (`build_layout`), which `--recommend` relies on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AbstractMesh

from maxpar.config import Config
from maxpar.mesh import MeshShape
from maxpar.model import Transformer
from maxpar.model.layers import RESIDUAL
from maxpar.optimizer import make_optimizer
from maxpar.pipeline.layout import STAGE_AXIS, resolve_schedule
from maxpar.pipeline.schedule import Schedule
from maxpar.sharding import batch_sharding, check_divisible, dim_axes, entry_axes, logical_specs, mesh_shardings
from maxpar.train_step import init_state

ROLES = ("attention", "mlp", "experts", "norm", "embedding", "output")
EXPERT_WEIGHTS = ("['wi_gate']", "['wi_up']", "['wo']")


@dataclasses.dataclass(frozen=True)
class ModelState:
    """The abstract train state of a config, traced once: its logical specs and shapes."""

    specs: Any      # logical PartitionSpecs of the TrainState
    abstract: Any   # ShapeDtypeStructs of the TrainState


def abstract_model_state(config: Config) -> ModelState:
    """Trace the trainer's `init_state` abstractly (no devices, no memory)."""
    boxed = jax.eval_shape(partial(init_state, Transformer(config), make_optimizer(config), config),
                           jax.random.key(0))
    return ModelState(specs=logical_specs(boxed), abstract=nn.unbox(boxed))


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One leaf of the train state with its per-dimension mesh axes."""

    path: str
    group: str                          # params | optimizer | step
    role: str                           # attention | mlp | norm | embedding | output | other
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...]
    mesh_axes: tuple[tuple[str, ...], ...]
    layered: bool                       # one slice per decoder layer (scanned stack or layers_i)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    @property
    def axes(self) -> frozenset[str]:
        return frozenset(a for dim in self.mesh_axes for a in dim)

    def dim_axes(self, logical_name: str) -> tuple[str, ...]:
        """Mesh axes of the dimension with this logical name (empty if absent or unsharded)."""
        return self.mesh_axes[self.logical.index(logical_name)] if logical_name in self.logical else ()


@dataclasses.dataclass(frozen=True)
class Layout:
    """A config on a mesh: degrees per axis and level, state tensors, activation shardings."""

    config: Config
    mesh: MeshShape
    tensors: tuple[Tensor, ...]
    batch_axes: tuple[str, ...]         # mesh axes sharding the batch (activation_batch)
    length_axes: tuple[str, ...]        # mesh axes sharding the sequence of input rows
    residual_axes: tuple[tuple[str, ...], ...]  # per dim of [batch, length, embed] activations

    def degree(self, axis: str) -> int:
        return self.mesh.degree(axis)

    def ici(self, axis: str) -> int:
        return self.mesh.ici[self.mesh.axis_names.index(axis)]

    def dcn(self, axis: str) -> int:
        return self.mesh.dcn[self.mesh.axis_names.index(axis)]

    def live(self, axes: Iterable[str]) -> tuple[str, ...]:
        """The axes among `axes` with degree > 1, in mesh order."""
        wanted = set(axes)
        return tuple(a for a in self.mesh.axis_names if a in wanted and self.degree(a) > 1)

    def shards(self, tensor: Tensor) -> int:
        return math.prod(self.degree(a) for a in tensor.axes)

    def local_bytes(self, tensor: Tensor) -> float:
        return tensor.nbytes / self.shards(tensor)

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.shape)

    @property
    def batch_degree(self) -> int:
        return math.prod(self.degree(a) for a in self.batch_axes)

    @property
    def pipeline(self) -> Schedule | None:
        """The pipeline schedule the trainer would run on this mesh (None: one stage)."""
        return resolve_schedule(self.config, dict(zip(self.mesh.axis_names, self.mesh.shape)), self.config.axis_rules)

    def weight_batch_axes(self, tensor: Tensor) -> tuple[str, ...]:
        """The batch axes whose shards use `tensor` on different rows (its gradient sums over them, FSDP
        gathers over those that shard it): all of them, but a pipeline's stages for its stacked layers,
        which every stage runs on all rows of its data-parallel shard. The `context` axis counts too: its
        shards see other tokens of the same rows (context parallelism acts like FSDP on the weights)."""
        axes = self.batch_axes + tuple(a for a in ("context",) if a in self.mesh.axis_names and a not in self.batch_axes)
        if tensor.layered and self.mesh.degree(STAGE_AXIS) > 1:
            return tuple(a for a in axes if a != STAGE_AXIS)
        return axes

    def params(self, role: str | None = None) -> list[Tensor]:
        return [t for t in self.tensors if t.group == "params" and (role is None or t.role == role)]

    def param(self, name: str) -> Tensor | None:
        """The parameter whose path ends with `name` (e.g. "['query']"), if the model has one."""
        found = [t for t in self.params() if t.path.endswith(name)]
        return found[0] if found else None


def _role(path: str) -> str:
    if "token_embedding" in path:
        return "embedding"
    if "['output']" in path:
        return "output"
    if "['scale']" in path:
        return "norm"
    if "['moe']" in path:  # the router is an ordinary (FSDP) weight; the experts are split over `exp`
        return "experts" if path.endswith(EXPERT_WEIGHTS) else "mlp"
    if "['attention']" in path:
        return "attention"
    if "['mlp']" in path:
        return "mlp"
    return "other"



def build_layout(config: Config, mesh: MeshShape, state: ModelState) -> Layout:
    """Shard the traced state on an abstract mesh of these degrees (ConfigError if it cannot split)."""
    abstract_mesh = AbstractMesh(mesh.shape, mesh.axis_names)
    shardings = mesh_shardings(state.specs, abstract_mesh, config.axis_rules)
    check_divisible(state.abstract, shardings)
    leaves = jax.tree_util.tree_leaves_with_path(state.abstract)
    spec_leaves = jax.tree_util.tree_leaves(state.specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    tensors = []
    for (path, leaf), sharding, logical in zip(leaves, jax.tree_util.tree_leaves(shardings), spec_leaves):
        name = jax.tree_util.keystr(path)
        group = "params" if name.startswith(".params") else "optimizer" if name.startswith(".opt_state") else "step"
        mesh_axes = tuple(dim_axes(sharding, len(leaf.shape)))
        logical_names = tuple(logical) + (None,) * (len(leaf.shape) - len(logical))
        tensors.append(Tensor(path=name, group=group, role=_role(name), shape=tuple(leaf.shape),
                              dtype=str(leaf.dtype), logical=logical_names, mesh_axes=mesh_axes,
                              layered="layers" in logical_names or "['layers_" in name))
    spec = batch_sharding(abstract_mesh, config.axis_rules).spec
    residual = nn.logical_to_mesh_axes(RESIDUAL, list(config.axis_rules))
    return Layout(config=config, mesh=mesh, tensors=tuple(tensors),
                  batch_axes=entry_axes(spec[0]) if len(spec) > 0 else (),
                  length_axes=entry_axes(spec[1]) if len(spec) > 1 else (),
                  residual_axes=tuple(entry_axes(residual[i]) if i < len(residual) else () for i in range(3)))
