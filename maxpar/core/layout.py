"""One resolved run layout: every sharding decision of a run, made once, before any device is touched.

`resolve_layout(config, mesh_shape, state)` is pure: from the config, the mesh degrees and the traced
(abstract) train state it works out which mesh axes shard every logical axis, the batch and its
blocks, the pipeline schedule, the expert axes and the state's shardings, and it runs every setup
check in one place, raising `ConfigError`s that name keys and values. The trainer binds the result to
real devices (`state_shardings(mesh)`, `process_block(mesh)`); the planner builds the same object on
an abstract mesh; the model is handed `layout.model` instead of inspecting the mesh while it is traced.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from maxpar.core.axes import ATTN_KV, ATTN_Q, BATCH_INPUT, CONTEXT_AXIS, RESIDUAL, STAGE_AXIS, Logical
from maxpar.core.config import (BLOCK_ATTENTION, CUDNN_ATTENTION, SPLASH_LANES, AxisRule, Config,
                                 ConfigError)
from maxpar.core.mesh import MeshShape
from maxpar.core.op_schedule import OpSchedule
from maxpar.core.schedule import EXPLICIT_BACKWARD, Schedule, ScheduleKind
from maxpar.core.sharding import (constrain, entry_axes, mesh_axes, mesh_shardings, mesh_specs,
                                  named_shardings, shard_optimizer_state, uneven_split, with_zero_axis)

Axes = tuple[str, ...]


# ---------------------------------------------------------------- the batch

@dataclasses.dataclass(frozen=True)
class BatchShape:
    """Rows per optimizer step and per microbatch for a device count."""

    global_rows: int
    microbatch_rows: int
    tokens_per_step: int


def batch_shape(config: Config, num_devices: int) -> BatchShape:
    """Global batch = per_device_batch_size x devices x gradient_accumulation_steps rows."""
    product = config.per_device_batch_size * num_devices
    micro = round(product)
    if abs(product - micro) > 1e-6 * max(product, 1.0) or micro < 1:  # tolerate float rounding of e.g. 512/8960
        raise ConfigError(f"per_device_batch_size={config.per_device_batch_size} x {num_devices} devices = {product} "
                          f"rows per microbatch; it must be a whole number >= 1")
    rows = micro * config.gradient_accumulation_steps
    return BatchShape(rows, micro, rows * config.max_target_length)


def split_microbatches(x: jax.Array, num: int) -> jax.Array:
    """[B, ...] -> [num, B/num, ...]: microbatch m is rows m, m + num, ... so that every device keeps its own
    rows (a batch-sharded row block splits into the same block of every microbatch). Gradient accumulation
    and the pipeline both cut the batch this way."""
    return x.reshape(x.shape[0] // num, num, *x.shape[1:]).swapaxes(0, 1)


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of `split_microbatches`."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


# ---------------------------------------------------------------- what the model is handed

@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The mesh the model is traced on, hashable (a Flax module attribute): (name, size) per axis in mesh order,
    and the axes an enclosing shard_map (the pipeline loop) made manual. Every shard_map and sharding constraint of
    the model is given `abstract()`, so that nothing reads axis sizes or types off an ambient mesh."""

    axes: tuple[tuple[str, int], ...]
    manual: Axes = ()

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.axes)

    def abstract(self) -> AbstractMesh:
        """This mesh for `jax.shard_map(mesh=...)` and `NamedSharding`s: the Auto axes of a `jax.sharding.Mesh`,
        Manual inside the pipeline loop. It names no device kind (the layout is resolved before any device): JAX
        matches it to the devices of the jitted step's arguments."""
        names = tuple(name for name, _ in self.axes)
        types = tuple(AxisType.Manual if name in self.manual else AxisType.Auto for name in names)
        return AbstractMesh(tuple(size for _, size in self.axes), names, types)


@dataclasses.dataclass(frozen=True)
class ExpertAxes:
    """Mesh axes of the MoE computation, resolved from the logical axis rules."""

    tokens: Axes                # split the rows (activation_batch)
    experts: Axes               # split the expert dim of the expert weights: expert parallelism
    hidden: Axes                # split the mlp dim but not the tokens: tensor parallelism, partial sums
    gate: tuple[Axes, ...]      # per dim of wi_gate / wi_up [exp, embed, mlp]
    down: tuple[Axes, ...]      # per dim of wo [exp, mlp, embed]
    mesh: MeshAxes
    pipelined: bool             # the layers run under the pipeline loop's vmap over the stages
    length: Axes = ()           # split each row's tokens (activation_length: context parallelism)

    @property
    def splitting(self) -> Axes:
        """Every axis that splits the tokens, the rows' and the sequence's: each device routes its own share."""
        return tuple(dict.fromkeys(self.tokens + self.length))

    def token_spec(self, whole_rows: bool = False) -> PartitionSpec:
        """[batch, length, ...] arrays split as the tokens are; whole_rows: every device holds its rows whole."""
        return PartitionSpec(self.live(self.tokens) or None, None if whole_rows else self.live(self.length) or None)

    def degree(self, axes: Axes) -> int:
        sizes = self.mesh.sizes
        return math.prod(sizes[a] for a in axes)

    def live(self, axes: Axes) -> Axes:
        sizes = self.mesh.sizes
        return tuple(a for a in axes if sizes[a] > 1)

    def gathered(self, dims: tuple[Axes, ...], logical: tuple[str, ...]) -> tuple[Axes, ...]:
        """Per weight dim, the axes to all-gather before use: all but the EP axes (exp) and TP axes (mlp)."""
        keep = {Logical.EXP: self.experts, Logical.MLP: self.hidden}
        return tuple(tuple(a for a in self.live(axes) if a not in keep.get(name, ())) for axes, name in zip(dims, logical))


EXPERT_GATE = (Logical.EXP, Logical.EMBED, Logical.MLP)   # wi_gate, wi_up: [experts, emb, mlp]
EXPERT_DOWN = (Logical.EXP, Logical.MLP, Logical.EMBED)   # wo: [experts, mlp, emb]


def expert_axes(rules: Sequence[AxisRule], mesh: MeshAxes, pipelined: bool) -> ExpertAxes:
    gate = tuple(mesh_axes(EXPERT_GATE, rules))
    down = tuple(mesh_axes(EXPERT_DOWN, rules))
    tokens, length = mesh_axes((Logical.BATCH, Logical.LENGTH), rules)
    hidden = tuple(a for a in gate[2] if a not in tokens)
    # An axis that splits the sequence and the experts' mlp dim (TP-sequence) stays tensor-parallel: the dispatch
    # gathers the sequence over it. The others (context) split the tokens as the batch axes do.
    return ExpertAxes(tokens=tokens, experts=gate[0], hidden=hidden, gate=gate, down=down, mesh=mesh,
                      pipelined=pipelined, length=tuple(a for a in length if a not in hidden + tokens))


@dataclasses.dataclass(frozen=True)
class ContextLayout:
    """A block attention core (attention=blockwise or splash) on a mesh, which runs it per device under shard_map:
    the context degree C (1: none), q's and k/v's live mesh axes (axes of size 1 left out: shard_map would count
    them as varying), and how the C shards attend to each other:
    strategy (`all_gather` or `ring`), load balance (2C chunks, shard s holding chunks s and 2C-1-s), and the
    blockwise kernel's block size (capped at a shard's length where it runs; splash reads its sa_block_* keys)."""

    degree: int
    q_spec: PartitionSpec
    kv_spec: PartitionSpec
    mesh: MeshAxes
    strategy: str
    load_balance: bool
    block_size: int

    @property
    def balanced(self) -> bool:
        """Whether the sequence is reordered into load-balancing chunks (only across more than one shard)."""
        return self.degree > 1 and self.load_balance


def live_spec(axes: Sequence[Axes], sizes: dict[str, int]) -> PartitionSpec:
    """A PartitionSpec of these per-dim mesh axes without the axes of size 1."""
    entries = []
    for dim_axes in axes:
        live = tuple(a for a in dim_axes if sizes.get(a, 1) > 1)
        entries.append(live if len(live) > 1 else (live[0] if live else None))
    return PartitionSpec(*entries)


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """What the model needs of the layout while it is traced (hashable: a Flax module attribute).

    mesh: the mesh axes every shard_map of the model runs over; pipeline: how the layers are pipelined over the
    stages (None: they run in order); experts: the MoE axes (None: dense); context: how the block attention core
    (blockwise, splash) splits over the mesh (None: another core, or one device); gather_lookup_table: whether the
    token lookup gathers the table's embed shards first (a vocab-sharded table: each shard looks up its own rows) or
    runs on them (the ids are gathered and the looked-up rows moved to their batch shards by an all-to-all, as MaxText's
    partitioned lookup does: no table gather and no reduction of its gradient over the axes that shard its embed
    dim).
    """

    rules: tuple[AxisRule, ...]
    mesh: MeshAxes
    pipeline: PipelineLayout | None = None
    experts: ExpertAxes | None = None
    context: ContextLayout | None = None
    gather_lookup_table: bool = True

    @property
    def pipelined(self) -> bool:
        return self.pipeline is not None

    @property
    def executor(self) -> ExecutorLayout | None:
        """The explicit-backward executor's layout (None: no pipeline, or gPipe/circular under autodiff)."""
        return self.pipeline.executor if self.pipeline else None

    @property
    def splits_sequence(self) -> bool:
        """Whether a mesh axis splits the rows' tokens (context parallelism, TP-sequence): the fp8 matmuls then keep
        [batch, length] as two dims instead of merging them into one GEMM dim, which would gather the sequence."""
        sizes = self.mesh.sizes
        lengths = mesh_axes((Logical.LENGTH, Logical.ATTN_LENGTH, Logical.MLP_LENGTH), self.rules)
        return any(sizes.get(axis, 1) > 1 for axes in lengths for axis in axes)

    def constrain(self, x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
        """`x` constrained to these logical axes by this layout's rules over its mesh (manual axes included)."""
        return constrain(x, logical, self.rules, self.mesh.abstract())

    def in_pipeline_loop(self, rules: Sequence[AxisRule], manual: Axes) -> ModelLayout:
        """The layout a pipeline stage's layers run under (`maxpar.pipeline.spmd`): the loop's rules, the mesh
        axes its shard_map made `manual`, the expert axes resolved from those rules, no pipeline."""
        mesh = dataclasses.replace(self.mesh, manual=tuple(manual))
        experts = expert_axes(rules, mesh, pipelined=True) if self.experts else None
        context = dataclasses.replace(self.context, mesh=mesh) if self.context else None
        return ModelLayout(rules=tuple(rules), mesh=mesh, experts=experts, context=context)


class FsdpGather(enum.StrEnum):
    """When the pipeline loop all-gathers the FSDP-sharded stage weights (`pipeline_fsdp_ag_*`)."""

    PER_ITERATION = "per_iteration"  # the partitioner gathers them in every iteration (the default)
    PER_REPEAT = "per_repeat"        # pipeline_fsdp_ag_per_repeat: one window of M iterations per repeat
    ONCE = "once"                    # pipeline_fsdp_ag_once: once per step, before the loop


def fsdp_gather(config: Config) -> FsdpGather:
    if config.pipeline_fsdp_ag_once:
        return FsdpGather.ONCE
    return FsdpGather.PER_REPEAT if config.pipeline_fsdp_ag_per_repeat else FsdpGather.PER_ITERATION


@dataclasses.dataclass(frozen=True)
class ExecutorLayout:
    """How the explicit-backward executor (`maxpar.pipeline.one_f_one_b`: 1f1b, zero_bubble,
    interleaved_1f1b) runs over the mesh, and the op table `ops` it runs.

    Its shard_map is manual over the stages and `batch_axes` (the leading batch axes that shard no stage weight:
    one replica per shard, gradients reduced once per step); the other axes (FSDP, tensor, expert) stay automatic, so
    the blocks and the head run under `inner`, whose rules name no manual axis (the MoE dispatch's own shard_map
    splits the tokens and experts over the expert axis there). `rows`: a microbatch's stage input and its cotangent
    [b, length, embed] there; `weights`: a stage's weights ([L/S, ...]; interleaved: [R, L/(S R), ...]) there,
    which their float32 gradients keep (FSDP stays memory-saving); `gathered` (pipeline_fsdp_ag_per_repeat) the same
    weights gathered over the batch axes before the ticks.
    """

    ops: OpSchedule
    batch_axes: Axes
    inner: ModelLayout
    rows: PartitionSpec
    weights: tuple[PartitionSpec, ...]
    gathered: tuple[PartitionSpec, ...] = ()


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """How the pipeline loop (`maxpar.pipeline.spmd`) runs over the mesh, resolved with the rest of the layout.

    stage_axes: the mesh axes of the stacked layers (the stages); loop_batch_axes: the batch's mesh axes inside
    the loop (the stages left out); manual: the leading batch axes that shard no stage weight, over which the loop
    runs per replica in a shard_map (gradients reduced once per step); inner: the layout a stage's layers run
    under; weight_tree with gathered_weights (ONCE: the stacked weights' specs without their batch axes) or
    gathered_blocks (PER_REPEAT: one repeat's blocks [S, L/(S R), ...], the stages still splitting S): the
    mesh specs the stage weights are gathered into, as tuples of leaves so that the layout stays hashable.
    """

    schedule: Schedule
    stage_axes: Axes
    loop_batch_axes: Axes
    manual: Axes
    inner: ModelLayout
    fsdp_gather: FsdpGather
    weight_tree: Any = None
    gathered_weights: tuple[PartitionSpec, ...] = ()
    gathered_blocks: tuple[PartitionSpec, ...] = ()
    executor: ExecutorLayout | None = None

    def executor_shardings(self, specs: tuple[PartitionSpec, ...]) -> Any:
        """`executor`'s per-stage weight `specs` (leaves) as the stage weights' tree of shardings inside it."""
        return named_shardings(jax.tree.unflatten(self.weight_tree, specs), self.executor.inner.mesh.abstract())

    def gathered_weight_specs(self) -> Any:
        """The stacked weights' mesh specs once gathered before the loop (FsdpGather.ONCE), else None."""
        return jax.tree.unflatten(self.weight_tree, self.gathered_weights) if self.gathered_weights else None

    def gathered_block_specs(self) -> Any:
        """One repeat's blocks' mesh specs once gathered per window (FsdpGather.PER_REPEAT), else None."""
        return jax.tree.unflatten(self.weight_tree, self.gathered_blocks) if self.gathered_blocks else None


def is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def spec_axes(spec: PartitionSpec | None) -> set[str]:
    return {a for entry in spec or () for a in entry_axes(entry)}


def without_axes(spec: PartitionSpec, dropped: set[str]) -> PartitionSpec:
    """`spec` with the mesh axes in `dropped` removed (those dimensions gathered over them)."""
    def keep(entry):
        kept = tuple(a for a in entry_axes(entry) if a not in dropped)
        return kept or None
    return PartitionSpec(*(keep(e) for e in spec))


def strip_rules(rules: Sequence[AxisRule], dropped: set[str]) -> list[AxisRule]:
    """Rules that no longer name `dropped` mesh axes (inside shard_map those axes are manual)."""
    return [(name, tuple(a for a in axes if a not in dropped)) for name, axes in rules]


def manual_batch_axes(batch_axes: Sequence[str], weight_axes: set[str]) -> tuple[str, ...]:
    """The leading batch mesh axes that shard no stage weight: each replica there runs the loop on its own rows.

    A prefix, so that the shard_map's row blocks are the batch's existing blocks (no resharding).
    """
    manual = []
    for axis in batch_axes:
        if axis in weight_axes:
            break
        manual.append(axis)
    return tuple(manual)


def gathered_block_spec(spec: PartitionSpec, schedule: Schedule, stage_axes: Axes, batch_axes: set[str]
                        ) -> PartitionSpec:
    """The mesh spec of one repeat's blocks [S, L/(S R), ...] of a stacked leaf with mesh spec `spec`, gathered
    over the batch axes (FSDP): the stages keep splitting S, the rest of the leaf loses its batch axes."""
    lead = 1 if schedule.num_repeats == 1 else 2
    rest = without_axes(PartitionSpec(*tuple(spec)[lead:]), batch_axes)
    return PartitionSpec(stage_axes or None, None, *rest)


def loop_batch_axes(rules: Sequence[AxisRule], row_axes: Axes) -> Axes:
    """The batch's mesh axes inside the pipeline loop: those of the rows (`row_axes`) but the stages'."""
    stage_axes = mesh_axes((Logical.LAYERS,), rules)[0]
    return tuple(a for a in row_axes if a not in stage_axes)


def pipeline_layout(config: Config, schedule: Schedule, outer: ModelLayout, row_axes: Axes, stack_specs: Any
                    ) -> PipelineLayout:
    """The pipeline loop's axes, rules and stage-weight specs for a run whose layers run under `outer`.

    stack_specs: the logical PartitionSpecs of the stacked layer unit's parameters (`TracedState.stack_specs`).
    """
    rules, sizes = outer.rules, outer.mesh.sizes
    stage_axes = mesh_axes((Logical.LAYERS,), rules)[0]
    batch_axes = loop_batch_axes(rules, row_axes)
    gather = fsdp_gather(config)
    weight_specs = mesh_specs(stack_specs, rules)
    if gather == FsdpGather.ONCE:
        weight_specs = jax.tree.map(lambda s: without_axes(s, set(batch_axes)), weight_specs, is_leaf=is_spec)
    weight_axes = set().union(*(spec_axes(s) for s in jax.tree.leaves(weight_specs, is_leaf=is_spec)))
    manual = manual_batch_axes(batch_axes, weight_axes)
    if math.prod(sizes[a] for a in manual) == 1:
        manual = ()
    # Inside the loop the stages are the explicit leading dimension (logical `layers`): no other
    # activation dimension may use their mesh axes (outside, the batch may be split over them too).
    inner_rules = [(name, axes) if name == Logical.LAYERS else (name, tuple(a for a in axes if a not in stage_axes))
                   for name, axes in strip_rules(rules, set(manual))]
    leaves, tree = jax.tree.flatten(weight_specs, is_leaf=is_spec)
    blocks = ()
    if gather == FsdpGather.PER_REPEAT:
        blocks = tuple(gathered_block_spec(s, schedule, stage_axes, set(batch_axes)) for s in leaves)
    executor = None
    if schedule.explicit_backward:
        hidden = set(manual) | set(stage_axes)
        step_rules = strip_rules(rules, hidden)
        executor = ExecutorLayout(
            ops=OpSchedule(schedule.kind, schedule.num_stages, schedule.num_microbatches, schedule.num_repeats),
            batch_axes=manual, inner=outer.in_pipeline_loop(step_rules, (*stage_axes, *manual)),
            rows=PartitionSpec(*(axes or None for axes in mesh_axes(RESIDUAL, step_rules))),
            weights=tuple(without_axes(s, hidden) for s in leaves),
            gathered=tuple(without_axes(s, hidden | set(batch_axes)) for s in leaves)
            if gather == FsdpGather.PER_REPEAT else ())
    return PipelineLayout(schedule=schedule, stage_axes=stage_axes, loop_batch_axes=batch_axes, manual=manual,
                          inner=outer.in_pipeline_loop(inner_rules, manual), fsdp_gather=gather, weight_tree=tree,
                          gathered_weights=tuple(leaves) if gather == FsdpGather.ONCE else (), gathered_blocks=blocks,
                          executor=executor)


# ---------------------------------------------------------------- the run layout

@dataclasses.dataclass(frozen=True, eq=False)
class TracedState:
    """The abstract train state of a config (traced once, no devices): shapes and logical specs. Hashed by identity:
    what is derived from it alone is computed once (the planner lays it out on many meshes)."""

    abstract: Any     # ShapeDtypeStructs of the TrainState
    specs: Any        # logical PartitionSpecs of the TrainState
    stack_specs: Any  # logical PartitionSpecs of the scanned layer stack's parameters, which a pipeline splits into
                      # stages (None: scan_layers=false)


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """Every sharding decision of a run on a mesh of `mesh` degrees."""

    config: Config
    mesh: MeshShape
    batch: BatchShape | None        # None only when resolved with check_batch=False and the batch is fractional
    input_axes: tuple[Axes, Axes]   # mesh axes of the [rows, length] input arrays
    residual_axes: tuple[Axes, Axes, Axes]
    model: ModelLayout
    state: TracedState
    state_specs: Any                # mesh PartitionSpecs of the TrainState
    update_specs: Any = None        # ZeRO-1 (shard_optimizer_over_data): the gradients' and updates' specs

    @property
    def rules(self) -> tuple[AxisRule, ...]:
        return self.model.rules

    @property
    def schedule(self) -> Schedule | None:
        """The pipeline schedule (None: the layers run in order); the loop's axes are `model.pipeline`'s."""
        return self.model.pipeline.schedule if self.model.pipeline else None

    @property
    def ops(self) -> OpSchedule | None:
        """The op table of an explicit-backward schedule (None: no pipeline, or autodiff runs its backward)."""
        return self.model.executor.ops if self.model.executor else None

    @property
    def pipelined(self) -> bool:
        return self.model.pipelined

    @property
    def abstract_mesh(self) -> AbstractMesh:
        return AbstractMesh(self.mesh.shape, self.mesh.axis_names)

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(zip(self.mesh.axis_names, self.mesh.shape))

    @property
    def rows_degree(self) -> int:
        """How many shards the mesh splits the batch rows into: a row count must be a multiple of it (the MoE
        dispatch's shard_map needs an even split)."""
        return math.prod(self.axis_sizes[a] for a in self.input_axes[0])

    def state_shardings(self, mesh: Mesh | AbstractMesh) -> Any:
        """NamedShardings of the train state on `mesh` (real devices, or the abstract mesh)."""
        return jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.state_specs,
                            is_leaf=lambda x: isinstance(x, PartitionSpec))

    def input_sharding(self, mesh: Mesh | AbstractMesh) -> NamedSharding:
        """Sharding of the [rows, length] input arrays."""
        return NamedSharding(mesh, PartitionSpec(*(axes or None for axes in self.input_axes)))

    def process_block(self, mesh: Mesh) -> tuple[int, int]:
        """(index, count) of this process's contiguous block of batch rows on the real `mesh`.

        The data pipeline produces block `index` of `count` equal blocks; this checks that the mesh
        gives each process such a block.
        """
        global_rows = self.batch.global_rows
        owned = set()
        shape = (global_rows, self.config.max_target_length)
        for index in self.input_sharding(mesh).addressable_devices_indices_map(shape).values():
            owned.update(range(global_rows)[index[0]])
        count = global_rows // len(owned)
        first = min(owned)
        if len(owned) * count != global_rows or owned != set(range(first, first + len(owned))) or first % len(owned):
            raise ConfigError("this process's devices do not hold one contiguous block of the batch; put the "
                              "cross-process (DCN) degree on the data or fsdp axis, outermost in mesh_axes")
        return first // len(owned), count


def resolve_layout(config: Config, mesh: MeshShape, state: TracedState, *, check_batch: bool = True) -> RunLayout:
    """The run layout of `config` on a mesh of these degrees; every setup check, in one place.

    check_batch=False (the planner) keeps going when the batch cannot be built or sharded (a plan may
    use a fractional per_device_batch_size); the trainer always checks it.
    """
    rules = config.axis_rules
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    num_devices = math.prod(mesh.shape)
    input_axes = tuple(mesh_axes(BATCH_INPUT, rules))
    schedule = pipeline_schedule(config, sizes, rules)
    batch = None
    try:
        batch = batch_shape(config, num_devices)
    except ConfigError:
        if check_batch:
            raise
    if check_batch:
        check_batch_split(config, batch, input_axes, sizes)
    if schedule is not None and check_batch:
        check_pipeline_batch(schedule, batch.microbatch_rows,
                             math.prod(sizes[a] for a in loop_batch_axes(rules, input_axes[0])))
    traced_mesh = MeshAxes(tuple(sizes.items()))
    context = context_layout(config, rules, traced_mesh)
    experts = None
    if config.num_experts > 1:
        experts = expert_axes(rules, traced_mesh, pipelined=schedule is not None)
        check_expert_layout(config, experts)
    check_attention_sharding(config, rules, sizes)
    abstract_mesh = AbstractMesh(mesh.shape, mesh.axis_names)
    shardings = mesh_shardings(state.specs, abstract_mesh, rules)
    check_splits(config, state, shardings)
    update_specs = None
    if config.shard_optimizer_over_data:  # ZeRO-1: the moments, gradients and updates also split over data
        shardings = shard_optimizer_state(state.abstract, shardings)
        update_specs = jax.tree.map(lambda leaf, s: with_zero_axis(leaf.shape, s).spec, state.abstract.params,
                                    shardings.params)
    model = ModelLayout(rules=rules, mesh=traced_mesh, experts=experts, context=context,
                        gather_lookup_table=gathers_lookup_table(rules, sizes, input_axes[0], schedule is not None))
    if schedule is not None:
        model = dataclasses.replace(model, pipeline=pipeline_layout(config, schedule, model, input_axes[0],
                                                                    state.stack_specs))
    return RunLayout(config=config, mesh=mesh, batch=batch, input_axes=input_axes,
                     residual_axes=tuple(mesh_axes(RESIDUAL, rules)), model=model, state=state,
                     state_specs=jax.tree.map(lambda s: s.spec, shardings), update_specs=update_specs)


# The config keys that size a weight's logical axis: what a message names when a degree does not divide it.
SIZE_KEYS = {Logical.EMBED: ("emb_dim",), Logical.MLP_EMBED: ("emb_dim",), Logical.HEADS: ("num_query_heads",),
             Logical.KV_HEADS: ("num_kv_heads",), Logical.VOCAB: ("vocab_size",), Logical.EXP: ("num_experts",),
             Logical.MLP: ("mlp_dim", "moe_mlp_dim"), Logical.LORA: ("q_lora_rank", "kv_lora_rank"),
             Logical.HEAD_DIM: ("head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
             Logical.LAYERS: ("num_decoder_layers",), Logical.DENSE_LAYERS: ("first_num_dense_layers",),
             Logical.REPEATS: ("num_pipeline_repeats",)}


def size_keys(config: Config, logical: str | None, size: int) -> tuple[str, ...]:
    """The config keys that may size a dimension of this logical axis: those of this size, else all of them."""
    keys = SIZE_KEYS.get(logical, ())
    return tuple(key for key in keys if getattr(config, key) == size) or keys


def check_splits(config: Config, state: TracedState, shardings: Any) -> None:
    """Every sharded dimension of the train state divides evenly by its mesh axes' degree; else a ConfigError naming
    the model key behind the dimension (its logical axis tells which), the parameter and the mesh axes."""
    split = uneven_split(state.abstract, shardings)
    if split is None:
        return
    logical = tuple(jax.tree_util.tree_leaves(state.specs, is_leaf=is_spec)[split.index])
    name = logical[split.dim] if split.dim < len(logical) else None
    size = split.shape[split.dim]
    keys = size_keys(config, name, size)
    what = f"{keys[0]}={size}" if len(keys) == 1 else f"{' / '.join(keys) or 'a dimension'} of {size}"
    raise ConfigError(
        f"{what} cannot be split {split.degree} ways: parameter {split.name} of shape {split.shape} splits that "
        f"dimension ({name or 'unnamed'}) over mesh axes {split.axes} of total degree {split.degree}. Choose "
        f"ici_/dcn_*_parallelism degrees whose product over {split.axes} divides {size}"
        + (f", or another {' / '.join(keys)}" if keys else "") + " (or other logical_axis_rules).")


def gathers_lookup_table(rules: Sequence[AxisRule], sizes: dict[str, int], row_axes: Axes, pipelined: bool) -> bool:
    """Whether the token lookup gathers the table's embed shards first (`ModelLayout.gather_lookup_table`): unless
    the table's vocab dim is whole and every axis splitting its embed dim also splits the batch rows (FSDP, not
    context: the partitioner gathers a context-split table anyway). A pipelined run always gathers it: there the
    partitioner does not turn the embed-split rows into batch-split ones with an all-to-all."""
    vocab, embed = ([a for a in axes if sizes[a] > 1] for axes in mesh_axes((Logical.VOCAB, Logical.EMBED), rules))
    return pipelined or bool(vocab) or not set(embed) <= set(row_axes)


# ---------------------------------------------------------------- the checks

def check_batch_split(config: Config, batch: BatchShape, input_axes: tuple[Axes, Axes], sizes: dict[str, int]) -> None:
    """A microbatch [rows, length] must split evenly over the mesh axes that shard its rows and its sequence."""
    rows_axes, length_axes = input_axes
    rows_degree = math.prod(sizes[a] for a in rows_axes)
    length_degree = math.prod(sizes[a] for a in length_axes)
    if batch.microbatch_rows % rows_degree:
        raise ConfigError(f"per_device_batch_size={config.per_device_batch_size} gives {batch.microbatch_rows} rows "
                          f"per microbatch, which the batch-sharding mesh axes {rows_axes} (degree {rows_degree}) "
                          f"cannot split evenly; use a per_device_batch_size that makes it a multiple of {rows_degree}")
    if config.max_target_length % length_degree:
        raise ConfigError(f"max_target_length={config.max_target_length} cannot be split evenly over the "
                          f"sequence-sharding mesh axes {length_axes} (degree {length_degree}); use a multiple of "
                          f"{length_degree}")


# Keys that only a pipelined run may set, with their values for a run without stages.
PIPELINE_ONLY_KEYS = {"num_pipeline_repeats": 1, "num_pipeline_microbatches": -1, "pipeline_fsdp_ag_once": False,
                      "pipeline_fsdp_ag_per_repeat": False, "pipeline_schedule": "auto"}


def check_pipeline(config: Config, stages: int) -> None:
    """Pipeline keys against each other and the number of stages S of the mesh."""
    layers, repeats, micro = config.num_stack_layers, config.num_pipeline_repeats, config.num_pipeline_microbatches
    stage_keys = f"ici_stage_parallelism={config.ici_stage_parallelism} x dcn_stage_parallelism=" \
                 f"{config.dcn_stage_parallelism} = {stages} stage(s)"
    if stages == 1:
        extra = [f"{key}={getattr(config, key)}" for key, unstaged in PIPELINE_ONLY_KEYS.items()
                 if getattr(config, key) != unstaged]
        if extra:
            raise ConfigError(f"{', '.join(extra)} need(s) pipeline stages, but {stage_keys}; set "
                              f"ici_stage_parallelism (or dcn_stage_parallelism) > 1, or drop these keys")
        return
    if not config.scan_layers:
        raise ConfigError(f"{stage_keys} needs scan_layers=true: the pipeline runs the scanned layer stack "
                          f"(scan_layers=false is not supported with pipelining)")
    delayed_fp8 = config.quantization == "fp8" and config.fp8_scaling == "delayed"
    if delayed_fp8 and config.pipeline_schedule in EXPLICIT_BACKWARD:
        # Its explicit backward (maxpar.pipeline.one_f_one_b) returns no amax observations; gpipe/circular do.
        raise ConfigError(f"fp8_scaling=delayed with pipeline_schedule={config.pipeline_schedule}: the explicit-"
                          f"backward schedules do not report amaxes yet; use pipeline_schedule=gpipe or circular, "
                          f"or fp8_scaling=current")
    stacked = f"num_decoder_layers={config.num_decoder_layers}" + (
        f" - first_num_dense_layers={config.first_num_dense_layers} = {layers} pipelined layers"
        if config.first_num_dense_layers else "")
    if stages > layers:
        raise ConfigError(f"{stage_keys} exceeds {stacked}: every stage needs at least one layer")
    if layers % (stages * repeats):
        raise ConfigError(f"{stacked} must be divisible by stages x num_pipeline_repeats = "
                          f"{stages} x {repeats} = {stages * repeats} ({stage_keys})")
    if repeats > 1 and micro != -1 and micro < stages:
        raise ConfigError(f"num_pipeline_repeats={repeats} (circular) needs num_pipeline_microbatches >= the "
                          f"{stages} stages, got {micro}: a microbatch leaving the last stage must find stage 0 "
                          f"free (the seed recommends 2 x stages)")
    if config.pipeline_schedule == "interleaved_1f1b" and (stages if micro == -1 else micro) % stages:
        raise ConfigError(f"pipeline_schedule=interleaved_1f1b needs num_pipeline_microbatches={micro} to be a "
                          f"multiple of the {stages} stages (its microbatches go through in groups of S); use "
                          f"{stages * (micro // stages)} or {stages * (micro // stages + 1)}")


def pipeline_schedule(config: Config, sizes: dict[str, int], rules: Sequence[AxisRule]) -> Schedule | None:
    """The pipeline schedule on a mesh of these axis sizes, or None when it has one stage (layers run in order)."""
    stages = int(sizes.get(STAGE_AXIS, 1))
    check_pipeline(config, stages)
    if stages == 1:
        return None
    staged = mesh_axes((Logical.LAYERS,), rules)[0]
    if staged != (STAGE_AXIS,):
        raise ConfigError(f"{stages} pipeline stages, but logical_axis_rules map the stacked `{Logical.LAYERS}` axis "
                          f"to {list(staged) or 'no mesh axis'}; pipelining needs the rule "
                          f"[{Logical.LAYERS}, [{STAGE_AXIS}]] (the stages split the layer stack)")
    micro = config.num_pipeline_microbatches
    return Schedule(num_stages=stages, num_microbatches=stages if micro == -1 else micro,
                    num_repeats=config.num_pipeline_repeats, num_layers=config.num_stack_layers,
                    kind=ScheduleKind.resolve(config.pipeline_schedule, config.num_pipeline_repeats))


def check_pipeline_batch(schedule: Schedule, microbatch_rows: int, loop_shards: int) -> None:
    """The rows a step pipelines must split into M microbatches that stay on their devices.

    loop_shards: the batch's pieces inside the loop, where every stage sees all rows of its data-parallel
    shard (that the rows split over all batch axes, stages included, `check_batch_split` checks).
    """
    m = schedule.num_microbatches
    key = f"num_pipeline_microbatches={m}" + (" (-1: the number of stages)" if m == schedule.num_stages else "")
    if microbatch_rows % m:
        raise ConfigError(f"{key} must divide the {microbatch_rows} rows of a step (per_device_batch_size x devices, "
                          f"per gradient-accumulation microbatch)")
    if (microbatch_rows // loop_shards) % m:
        raise ConfigError(f"{key} must divide the {microbatch_rows // loop_shards} rows that each of the "
                          f"{loop_shards} data-parallel shards (mesh axes of activation_batch but the stages) runs "
                          f"through the pipeline, so that every pipeline microbatch stays on its devices; raise "
                          f"per_device_batch_size or change num_pipeline_microbatches")


def check_expert_layout(config: Config, axes: ExpertAxes) -> None:
    """A MoE config against the mesh: the experts split evenly, and only over axes that split the tokens."""
    sizes = axes.mesh.sizes
    ep = axes.degree(axes.experts)
    if config.num_experts % ep:
        degrees = ", ".join(f"{a}={sizes[a]}" for a in axes.experts)
        raise ConfigError(f"num_experts={config.num_experts} is not divisible by the expert-parallel degree {ep} "
                          f"(mesh axes {degrees} split the experts; ici_expert_parallelism x dcn_expert_parallelism): "
                          f"use an EP degree that divides {config.num_experts}")
    stray = [a for a in axes.live(axes.experts) if a not in axes.splitting]
    if stray:
        raise ConfigError(f"logical_axis_rules: the experts are split over {stray}, which does not split the "
                          f"tokens (activation_batch -> {list(axes.tokens)}, activation_length -> "
                          f"{list(axes.length)}); expert parallelism exchanges tokens over the axes that split both")
    for name, dims, logical in (("wi_gate/wi_up", axes.gate, EXPERT_GATE), ("wo", axes.down, EXPERT_DOWN)):
        for dim_axes, dim in zip(axes.gathered(dims, logical), logical):
            stray = [a for a in dim_axes if a not in axes.splitting]
            if stray:
                raise ConfigError(f"logical_axis_rules: the {dim} dim of the expert weights {name} is split over "
                                  f"{stray}, which neither splits the tokens (FSDP, context) nor is a tensor-parallel "
                                  f"mlp axis; map {dim} to batch axes or leave it unsplit")


def check_attention_sharding(config: Config, rules: Sequence[AxisRule], sizes: dict[str, int]) -> None:
    """cuDNN flash attention refuses q/k/v sharded along the sequence or head_dim."""
    if config.attention not in CUDNN_ATTENTION:
        return
    for logical in (ATTN_Q, ATTN_KV):
        for dim, axes in zip(logical, mesh_axes(logical, rules)):
            live = [a for a in axes if sizes.get(a, 1) > 1]
            if live and dim in (Logical.ATTN_LENGTH, Logical.HEAD_DIM_ACT):
                raise ConfigError(f"attention={config.attention}: cuDNN flash attention cannot shard {dim} (here over "
                                  f"{', '.join(live)}); change logical_axis_rules or the mesh, or use "
                                  f"attention=dot_product")


def context_layout(config: Config, rules: Sequence[AxisRule], mesh: MeshAxes) -> ContextLayout | None:
    """How the block attention core (blockwise, splash) runs on this mesh (every context check here), or None (another
    core, one device)."""
    sizes = mesh.sizes
    degree = sizes.get(CONTEXT_AXIS, 1)
    check_context(config, degree, sizes.get(STAGE_AXIS, 1))
    if config.attention not in BLOCK_ATTENTION or math.prod(sizes.values()) == 1:
        return None
    q_axes, kv_axes = mesh_axes(ATTN_Q, rules), mesh_axes(ATTN_KV, rules)
    residual_length = mesh_axes(RESIDUAL, rules)[1]
    if degree > 1 and CONTEXT_AXIS not in residual_length:
        raise ConfigError(f"context parallelism (context degree {degree}) splits the residual stream's sequence "
                          f"({Logical.LENGTH}) over `{CONTEXT_AXIS}`, but logical_axis_rules map it to "
                          f"{list(residual_length) or 'nothing'} (e.g. configs/tp_sequence.yml's rule); TP-sequence "
                          f"with context parallelism is not supported yet")
    length_axes = tuple(a for a in q_axes[1] if sizes.get(a, 1) > 1)
    if length_axes not in ((), (CONTEXT_AXIS,)) or tuple(a for a in kv_axes[1] if sizes.get(a, 1) > 1) != length_axes:
        raise ConfigError(f"attention={config.attention}: the rules shard the attention length ({ATTN_Q[1]}) over "
                          f"{list(q_axes[1]) or 'nothing'} and the keys' over {list(kv_axes[1]) or 'nothing'}; "
                          f"{config.attention} attention splits the sequence over the `{CONTEXT_AXIS}` axis only "
                          f"(logical_axis_rules)")
    return ContextLayout(degree=degree, q_spec=live_spec(q_axes, sizes), kv_spec=live_spec(kv_axes, sizes), mesh=mesh,
                         strategy=config.context_parallel_strategy, load_balance=config.context_parallel_load_balance,
                         block_size=config.attention_block_size)


def check_context(config: Config, degree: int, stages: int) -> None:
    """Context parallelism and the block attention cores against the other keys and the mesh's context degree.

    The sequence is split into `degree` shards (2 x degree chunks with load balance) and every
    shard into blocks of attention_block_size (blockwise) or sa_block_q (splash), capped at the shard.
    """
    length = config.max_target_length
    degree_keys = f"ici_context_parallelism={config.ici_context_parallelism} x dcn_context_parallelism=" \
                  f"{config.dcn_context_parallelism} = {degree}"
    if degree > 1:
        if config.attention not in BLOCK_ATTENTION:
            raise ConfigError(f"attention={config.attention} with {degree_keys} (context_parallel_strategy="
                              f"{config.context_parallel_strategy}): context parallelism runs attention=blockwise "
                              f"or splash only (they take the global query/key offsets of each shard); set "
                              f"attention=blockwise (or splash on TPU)")
        if config.attention == "splash" and config.context_parallel_strategy == "ring":
            raise ConfigError(f"attention=splash with {degree_keys} and context_parallel_strategy=ring: the splash "
                              f"kernel cannot carry its softmax state from hop to hop (its log-sum-exp output has "
                              f"no gradient); use context_parallel_strategy=all_gather, or attention=blockwise")
        chunks = 2 * degree if config.context_parallel_load_balance else degree
        if length % chunks:
            why = (f"context_parallel_load_balance=true cuts it into 2 x {degree} = {chunks} chunks"
                   if config.context_parallel_load_balance else f"it is split into {degree} shards")
            raise ConfigError(f"max_target_length={length} with {degree_keys}: {why}, so it must be a multiple of "
                              f"{chunks}")
        if stages > 1:
            raise ConfigError(f"{degree_keys} with ici_stage_parallelism={config.ici_stage_parallelism}, "
                              f"dcn_stage_parallelism={config.dcn_stage_parallelism}: context parallelism with "
                              f"pipeline stages is not supported yet; use stage degree 1")
    if config.attention in BLOCK_ATTENTION and stages > 1:
        raise ConfigError(f"attention={config.attention} with ici_stage_parallelism={config.ici_stage_parallelism}, "
                          f"dcn_stage_parallelism={config.dcn_stage_parallelism}: the block attention cores do not "
                          f"run inside pipeline stages yet (their shard_map cannot nest in the pipeline loop's); use "
                          f"attention=dot_product with pipeline stages")
    if config.attention == "blockwise":
        local = length // degree
        block = min(config.attention_block_size, local)
        if local % block:
            raise ConfigError(f"attention_block_size={config.attention_block_size} does not divide the "
                              f"{local} tokens each context shard holds (max_target_length={length} / context "
                              f"degree {degree}); use a divisor of {local}")
    if config.attention == "splash":
        check_splash_blocks(config, degree)


def check_splash_blocks(config: Config, degree: int) -> None:
    """The splash kernel's blocks, capped at the queries a context shard holds and at the (gathered) keys, must
    divide them and be multiples of SPLASH_LANES."""
    length = config.max_target_length
    shard = f"max_target_length={length} / context degree {degree}" if degree > 1 else f"max_target_length={length}"
    for key, tokens, what in (("sa_block_q", length // degree, f"queries ({shard})"),
                              ("sa_block_kv", length, f"keys (max_target_length={length})")):
        value = getattr(config, key)
        block = min(value, tokens)
        if tokens % block or block % SPLASH_LANES:
            raise ConfigError(f"{key}={value}: the splash kernel cuts the {tokens} {what} into blocks of "
                              f"min({key}, {tokens}) = {block}, which must divide them and be a multiple of "
                              f"{SPLASH_LANES}; use a max_target_length that is a multiple of {SPLASH_LANES * degree} "
                              f"and a {key} that divides its shard")


def check_devices(config: Config, devices: Sequence[jax.Device]) -> None:
    """What only the real devices can tell: splash attention needs TPUs, cuDNN flash attention NVIDIA GPUs of enough
    capability."""
    platforms = sorted({d.platform for d in devices})
    if config.attention == "splash" and platforms != ["tpu"]:
        raise ConfigError(f"attention=splash: the Pallas splash attention kernel needs TPU devices, these are "
                          f"{', '.join(platforms)}; use attention=dot_product or attention=blockwise here")
    if config.attention not in CUDNN_ATTENTION:
        return
    if platforms != ["gpu"]:
        raise ConfigError(f"attention={config.attention}: cuDNN flash attention needs GPU devices, these are "
                          f"{', '.join(platforms)}; use attention=dot_product or attention=xla here")
    capability = getattr(devices[0], "compute_capability", "")
    major = int(str(capability).split(".")[0]) if capability else 0
    if major and major < 9 and config.head_dim > 128:
        raise ConfigError(f"attention={config.attention} with head_dim={config.head_dim}: cuDNN flash attention "
                          f"supports head_dim <= 128 on compute capability {capability} (256 from Hopper, 9.0)")
