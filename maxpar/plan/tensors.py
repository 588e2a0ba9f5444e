"""The planner's view of a run layout: every train-state tensor with its mesh axes, and the activations'.

The planner must reason about exactly the shardings the trainer would use, so it takes the trainer's
own run layout (`maxpar.core.layout.resolve_layout` on an abstract mesh: no devices needed; a mesh the
trainer would reject is rejected with the same message). The model is traced once
(`train_step.trace_state`) and re-laid out cheaply for every candidate mesh (`build_layout`), which
`--recommend` relies on.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable

import jax
import numpy as np

from maxpar.core.axes import Logical
from maxpar.core.config import Config
from maxpar.core.layout import RunLayout, TracedState, is_spec, resolve_layout
from maxpar.core.mesh import MeshShape
from maxpar.core.op_schedule import OpSchedule
from maxpar.core.schedule import Schedule
from maxpar.core.sharding import entry_axes
from maxpar.model import stack
from maxpar.model.roles import Block, ParamRole, declared_axes, param_role, path_keys


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One leaf of the train state with its per-dimension mesh axes."""

    path: str
    group: str                          # params (trained) | frozen (LoRA's base, DPO's reference) | optimizer | step
    role: ParamRole | None              # what a parameter is for (maxpar.model.roles); None for other leaves
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...]
    mesh_axes: tuple[tuple[str, ...], ...]
    layered: bool                       # one slice per decoder layer (scanned stack or layers_i); not a pipelined
                                        # run's dense prefix, which runs whole before the loop

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    @property
    def block(self) -> Block | None:
        return self.role.block if self.role else None

    @property
    def name(self) -> str:
        """The parameter's path as reports print it, e.g. decoder/layers/attention/query."""
        return self.path.replace(".params", "").replace("['", "").replace("']", "/").rstrip("/")

    @property
    def axes(self) -> frozenset[str]:
        return frozenset(a for dim in self.mesh_axes for a in dim)

    def dim_axes(self, logical_name: str) -> tuple[str, ...]:
        """Mesh axes of the dimension with this logical name (empty if absent or unsharded)."""
        return self.mesh_axes[self.logical.index(logical_name)] if logical_name in self.logical else ()


@dataclasses.dataclass(frozen=True)
class Layout:
    """A run layout (config on a mesh: degrees per axis and level) with its state tensors listed."""

    run: RunLayout
    tensors: tuple[Tensor, ...]

    @property
    def config(self) -> Config:
        return self.run.config

    @property
    def mesh(self) -> MeshShape:
        return self.run.mesh

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes sharding the batch (activation_batch)."""
        return self.run.input_axes[0]

    @property
    def length_axes(self) -> tuple[str, ...]:
        """Mesh axes sharding the sequence of input rows."""
        return self.run.input_axes[1]

    @property
    def residual_axes(self) -> tuple[tuple[str, ...], ...]:
        """Per dim of [batch, length, embed] activations."""
        return self.run.residual_axes

    def degree(self, axis: str) -> int:
        return self.mesh.degree(axis)

    def group_degree(self, axes: Iterable[str]) -> int:
        """How many shards these axes together split a dimension into."""
        return math.prod(self.degree(a) for a in axes)

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
    def schedule(self) -> Schedule | None:
        """The pipeline schedule the trainer would run on this mesh (None: one stage)."""
        return self.run.schedule

    @property
    def ops(self) -> OpSchedule | None:
        """The explicit-backward schedule's op table (None: no stages, or gPipe/circular under autodiff)."""
        return self.run.ops

    @property
    def lookup_on_shards(self) -> bool:
        """The token lookup runs on the table's embed shards (`maxpar.core.layout.ModelLayout.gather_lookup_table`)."""
        return not self.run.model.gather_lookup_table

    @property
    def table_gathered(self) -> bool:
        """The token table is gathered once per step: for the lookup, or for the logits it is tied to."""
        return not self.lookup_on_shards or self.config.logits_via_embedding

    def weight_batch_axes(self, tensor: Tensor) -> tuple[str, ...]:
        """The batch axes whose shards use `tensor` on different rows (its gradient sums over them, FSDP
        gathers over those that shard it): all of them, but a pipeline's stages for its stacked layers,
        which every stage runs on all rows of its data-parallel shard. The context axes count too: their
        shards see other tokens of the same rows (context parallelism acts like FSDP on the weights)."""
        axes = self.batch_axes + tuple(a for a in self.context_axes if a not in self.batch_axes)
        if tensor.layered and self.run.pipelined:
            return tuple(a for a in axes if a not in self.stage_axes)
        return axes

    @property
    def context_axes(self) -> tuple[str, ...]:
        """The mesh axes context parallelism splits the sequence over (none without it): the length axes of
        the block attention core's q (blockwise, splash)."""
        context = self.run.model.context
        return entry_axes(context.q_spec[1]) if context and context.degree > 1 else ()

    @property
    def context_degree(self) -> int:
        """How many shards context parallelism splits the sequence into (1: none)."""
        return self.run.model.context.degree if self.run.model.context else 1

    @property
    def stage_axes(self) -> tuple[str, ...]:
        """The mesh axes of a pipeline's stages (none without a pipeline)."""
        return tuple(self.run.model.pipeline.stage_axes) if self.run.pipelined else ()

    @property
    def pipeline_manual_axes(self) -> tuple[str, ...]:
        """The batch axes a pipelined step runs per replica (maxpar.pipeline.spmd): reduced once per step."""
        return tuple(self.run.model.pipeline.manual) if self.run.pipelined else ()

    def params(self, block: Block | None = None) -> list[Tensor]:
        """The weights the model runs with: the trained ones, and under LoRA the frozen base they adapt."""
        groups = ("params", "frozen") if self.config.lora_rank else ("params",)
        return [t for t in self.tensors if t.group in groups and (block is None or t.block == block)]

    def trained(self) -> list[Tensor]:
        """The weights with gradients and optimizer state (under LoRA its adapters only)."""
        return [t for t in self.tensors if t.group == "params"]

    def reference(self) -> list[Tensor]:
        """DPO's reference model without LoRA: a frozen copy of the weights (none otherwise)."""
        return [] if self.config.lora_rank else [t for t in self.tensors if t.group == "frozen"]

    def param(self, role: ParamRole) -> Tensor | None:
        """The (first) parameter with this role, if the model has one."""
        return next((t for t in self.params() if t.role == role), None)


def _declared_role(path: tuple, logical: tuple[str | None, ...]) -> ParamRole:
    """A parameter's role, checked against the logical axes the model declares for it (`maxpar.model.roles`)."""
    keys = path_keys(path)
    role, declared = param_role(keys), declared_axes(keys)
    per_layer = tuple(n for n in logical if n not in (Logical.LAYERS, Logical.DENSE_LAYERS, Logical.REPEATS))
    if role is None or per_layer != declared:
        raise ValueError(f"parameter {'/'.join(keys)} with logical axes {per_layer} is not declared in "
                         f"maxpar.model.roles (declared: {declared}); the planner reads parameters by role")
    return role


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """What the planner reads of one train-state leaf that no mesh changes."""
    path: str
    group: str
    role: ParamRole | None
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...]
    unrolled: bool  # in an unrolled layer unit (scan_layers=false): one slice per layer


@functools.lru_cache(maxsize=8)
def _leaves(state: TracedState) -> tuple[_Leaf, ...]:
    """The train state's leaves, once per traced state: `--recommend` lays them out on hundreds of meshes."""
    leaves = []
    for (path, leaf), logical in zip(jax.tree_util.tree_leaves_with_path(state.abstract),
                                     jax.tree_util.tree_leaves(state.specs, is_leaf=is_spec)):
        name = jax.tree_util.keystr(path)
        group = ("params" if name.startswith(".params") else "frozen" if name.startswith(".frozen")
                 else "optimizer" if name.startswith(".opt_state") else "step")
        logical_names = tuple(logical) + (None,) * (len(leaf.shape) - len(logical))
        role = _declared_role(path[1:], logical_names) if group in ("params", "frozen") else None
        leaves.append(_Leaf(name, group, role, tuple(leaf.shape), str(leaf.dtype), logical_names,
                            stack.in_unrolled_unit(path)))
    return tuple(leaves)


def build_layout(config: Config, mesh: MeshShape, state: TracedState) -> Layout:
    """The run layout of the traced state on an abstract mesh of these degrees (ConfigError if it cannot run);
    the batch may be one the trainer would refuse (`predict.plan_batch` says so)."""
    run = resolve_layout(config, mesh, state, check_batch=False)
    tensors = []
    for leaf, spec in zip(_leaves(state), jax.tree_util.tree_leaves(run.state_specs, is_leaf=is_spec)):
        padded = tuple(spec) + (None,) * (len(leaf.shape) - len(spec))
        tensors.append(Tensor(path=leaf.path, group=leaf.group, role=leaf.role, shape=leaf.shape, dtype=leaf.dtype,
                              logical=leaf.logical, mesh_axes=tuple(entry_axes(e) for e in padded),
                              layered=Logical.LAYERS in leaf.logical or leaf.unrolled
                              or (Logical.DENSE_LAYERS in leaf.logical and not run.pipelined)))
    return Layout(run=run, tensors=tuple(tensors))
