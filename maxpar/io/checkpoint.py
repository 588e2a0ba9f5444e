"""Orbax checkpoints: full training state, every process's data position, and the config.

Layout: RUN_DIR/checkpoints/STEP/ is one Orbax step directory, written under a
temporary name and renamed when complete (so a save killed half-way is never
listed), holding the items

    params/     parameters                 } canonical layout, below; any mesh
    opt_state/  optimizer state (AdamW)    } restores them with its own shardings
    meta/       JSON: step, layout, global batch rows, process count
    data/       Grain iterator state, one process_I-of-N.json per process
    config/     JSON: the resolved config that wrote the checkpoint

Canonical layout: the decoder's layers stacked on a leading axis, as `maxpar.model.stack` defines
it; every save converts the run's layer layout (stacked, unrolled or circular) to it and every
restore back, so the files depend on neither the mesh nor the layer layout.

Why the care on restore: a run is resumed after crashes, preemptions and
config edits. The newest checkpoint is validated by restoring it; if it cannot
be read the previous one is used, with a warning, and the unusable one is moved
aside (never deleted). A checkpoint that is readable but belongs to a
different model, dataset or batch layout is refused with the differing keys,
because falling back would not help and silently training on would be wrong.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import grain.checkpoint
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxpar.core import storage
from maxpar.core.config import MODEL_KEYS, Config, ConfigError, model_config
from maxpar.core.layout import RunLayout
from maxpar.host import distributed
from maxpar.io import logs
from maxpar.io.data.pipeline import mixture_differences, position_keys
from maxpar.model import lora, stack
from maxpar.training.train_step import TrainState

LAYOUT = "maxpar/stacked-layers/v1"
ARRAY_ITEMS = ("params", "opt_state")
HISTORIES = "fp8_meta"  # fp8_scaling=delayed: the amax histories (TrainState.fp8_meta), an item of their own

Warn = Callable[[str], None]


class CheckpointError(RuntimeError):
    """A checkpoint was required but none could be read; the trainer prints it and exits with status 1."""


class IncompatibleCheckpoint(ConfigError):
    """A readable checkpoint that does not fit this config (model, data or batch layout): never a fallback."""


def warn_stderr(message: str) -> None:
    print(f"maxpar: warning: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- manager and save

def make_manager(run_dir: epath.PathLike, config: Config) -> ocp.CheckpointManager:
    """The run's own manager: async per config, keeps `max_checkpoints_to_keep`, deletes in the background.

    Leftover temporary directories of saves that were killed are removed on start; they never
    held a complete checkpoint.
    """
    logs.tensorstore_credentials(run_dir)  # its C++ lines into the library log, not among the run's
    options = ocp.CheckpointManagerOptions(
        max_to_keep=config.max_checkpoints_to_keep or None,
        enable_async_checkpointing=config.async_checkpointing,
        enable_background_delete=True,
        cleanup_tmp_directories=True,
        create=True,
    )
    return ocp.CheckpointManager(storage.absolute(storage.path(run_dir) / "checkpoints"), options=options,
                                 item_handlers=_handlers())


def read_only_manager(directory: epath.PathLike) -> ocp.CheckpointManager:
    """A manager that only reads `directory`, in this process alone: never writes or deletes there, and its
    restores end in no barrier with the other processes (Orbax's own do), so a process whose read fails never
    leaves its peers waiting in that barrier while it waits in `load_everywhere`'s agreement."""
    logs.tensorstore_credentials(directory)
    me = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={me},
                                               barrier_sync_key_prefix=f"maxpar_read_{me}")
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, enable_async_checkpointing=False,
                                           multiprocessing_options=alone)
    return ocp.CheckpointManager(storage.absolute(directory), options=options, item_handlers=_handlers())


def _handlers() -> dict[str, Any]:
    return {
        "params": ocp.StandardCheckpointHandler(),
        "opt_state": ocp.StandardCheckpointHandler(),
        HISTORIES: ocp.StandardCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
        "data": grain.checkpoint.CheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(),
    }


def checkpoint_meta(step: int, global_rows: int) -> dict[str, Any]:
    """What a restore must know besides the config: the step, the array layout and the data layout."""
    return {"step": int(step), "layout": LAYOUT, "global_batch_rows": int(global_rows),
            "process_count": jax.process_count()}


def save(manager: ocp.CheckpointManager, step: int, state: Any, data_iterator: Any, config: Config,
         global_rows: int) -> None:
    """Start a save (async if configured) of everything needed to resume after `step`.

    The data iterator state is captured before this returns; arrays are copied off the device
    before it returns too, so the caller may donate `state` to the next step.
    """
    model = model_config(config)
    manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(stack.to_canonical(state.params, model)),
        opt_state=ocp.args.StandardSave(stack.to_canonical(state.opt_state, model)),
        **({HISTORIES: ocp.args.StandardSave(stack.to_canonical(state.fp8_meta, model))} if state.fp8_meta else {}),
        meta=ocp.args.JsonSave(checkpoint_meta(step, global_rows)),
        data=grain.checkpoint.CheckpointSave(data_iterator),
        config=ocp.args.JsonSave(config.to_dict()),
    ))


# ---------------------------------------------------------------- saving through storage outages

class SaveFailed(storage.StorageError):
    """A checkpoint save failed on every attempt; the trainer prints it and exits with status 74."""


def retry_policy(config: Config) -> storage.RetryPolicy:
    return storage.RetryPolicy(config.save_attempts, config.save_retry_delay_s, config.save_retry_max_delay_s)


def bound_tensorstore_retries(policy: storage.RetryPolicy) -> None:
    """Give TensorStore's own retries of a GCS request the policy's attempts and delays.

    By default TensorStore retries a request 32 times, up to 32 s apart: a save into a bucket that stays
    unreachable would hang for a quarter of an hour before maxpar's policy got a say. Orbax builds every
    TensorStore context from these module defaults and has no option for them.
    """
    from orbax.checkpoint._src.serialization import tensorstore_utils
    retries = {"max_retries": policy.attempts, "initial_delay": f"{policy.base_delay_s}s",
               "max_delay": f"{policy.max_delay_s}s"}
    for context in (tensorstore_utils._BASE_TS_CONTEXT, tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT):
        context["gcs_request_retries"] = retries


class Saver:
    """The run's checkpoint saves, kept going through short storage outages by a `RetryPolicy`.

    An async save fails in Orbax's background thread, which shows only at the next save or at the end, when its
    state is gone: the save that finds it (of the newer state) is then written synchronously under the policy,
    as is every save whose state the caller gives up next (`wait`: the last step's, a preemption's). A step whose
    save failed is never restored: Orbax lists a step only once complete (on gs:// it writes commit_success.txt
    last; on a local disk it renames a temporary directory), removes leftovers when a run starts, and before a
    retry the listing is reread and the step's leftover removed here.
    """

    def __init__(self, manager: ocp.CheckpointManager, policy: storage.RetryPolicy, warn: Warn = warn_stderr,
                 sleep: Callable[[float], None] = time.sleep):
        self.manager, self.policy, self.warn, self.sleep = manager, policy, warn, sleep
        self.directory = epath.Path(manager.directory)
        self._in_flight: int | None = None  # an async save not yet seen to complete
        self._damaged = False  # a save failed: Orbax's listing and the step's directory need cleaning first
        self._complete = manager.latest_step()  # the newest step known complete: what this run resumed from, or None

    @classmethod
    def of(cls, manager: ocp.CheckpointManager, config: Config, warn: Warn = warn_stderr) -> Saver:
        """The run's saver under the config's policy, which then also bounds TensorStore's own retries."""
        policy = retry_policy(config)
        bound_tensorstore_retries(policy)
        return cls(manager, policy, warn)

    def save(self, step: int, state: Any, data_iterator: Any, config: Config, global_rows: int,
             wait: bool = False) -> None:
        """Save `step` (see `save`), retried while the policy allows; `wait`: return once it is complete.
        Raises SaveFailed when every attempt failed."""
        failed = self._wait_for_in_flight()
        if failed is not None:
            self.warn(f"checkpoint step {failed[0]} to {self.directory} failed ({failed[1]}); it is never "
                      f"restored; writing step {step} now, synchronously")
            wait = True
        what = f"checkpoint step {step} to {self.directory}"
        try:
            self.policy.run(lambda: self._attempt(step, state, data_iterator, config, global_rows, wait), what,
                            self.warn, self.sleep)
        except storage.StorageError as e:
            newest = "none (a rerun starts over)" if self._complete is None else f"step {self._complete}"
            raise SaveFailed(f"{e}. The newest complete checkpoint is {newest}; rerun the same command once the "
                             f"storage is reachable to resume from it") from e
        if wait:
            self._complete = step
        else:
            self._in_flight = step

    def newest_complete(self) -> int | None:
        """The newest step known complete, without waiting: not a save still being written (an async save that has
        finished counts), None before any. What a stop at once (a second Ctrl-C) leaves to resume from."""
        if self._in_flight is not None and not self.manager.is_saving_in_progress():
            return self._in_flight
        return self._complete

    def _wait_for_in_flight(self) -> tuple[int, str] | None:
        """(step, why) when the async save in flight failed; None when it completed or there was none."""
        step, self._in_flight = self._in_flight, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # the background save's own error, whatever the library raised
            self._damaged = True
            return step, storage.describe_error(e)
        if step is not None:
            self._complete = step
        return None

    def _attempt(self, step: int, state: Any, data_iterator: Any, config: Config, global_rows: int,
                 wait: bool) -> None:
        storage.check_server(self.directory)
        try:
            if self._damaged:
                self._clean(step)
            save(self.manager, step, state, data_iterator, config, global_rows)
            if wait:
                self.manager.wait_until_finished()
        except Exception:
            self._damaged = True
            raise

    def _clean(self, step: int) -> None:
        """Reread the listing (Orbax still counts a step whose save failed) and remove what a failed save of
        `step` left, so that it can be written again."""
        self.manager.reload()
        leftover = self.directory / str(step)
        if step not in self.manager.all_steps() and leftover.exists():
            leftover.rmtree()
        self._damaged = False


# ---------------------------------------------------------------- what a run restores into

@dataclasses.dataclass(frozen=True)
class Target:
    """The restoring run: its config, abstract state and shardings (its mesh), and global batch rows."""

    config: Config
    abstract_state: Any
    shardings: Any
    global_rows: int

    @classmethod
    def of(cls, layout: RunLayout, mesh: Mesh, global_rows: int = 0) -> Target:
        """The target of a run with this layout on `mesh`; global_rows 0 where no data position is restored
        (parameters only: conversion, generation)."""
        return cls(layout.config, layout.state.abstract, layout.state_shardings(mesh), global_rows)

    def on_disk(self, item: str) -> Any:
        """Restore target of `item` in the canonical layout, with this run's shardings."""
        abstract, shardings = getattr(self.abstract_state, item), getattr(self.shardings, item)
        tree = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
        return stack.to_canonical(tree, model_config(self.config), stack=stack.stack_abstract)

    def in_memory(self, item: str, restored: Any) -> Any:
        """A restored canonical `item` in this run's layer layout and shardings."""
        return jax.device_put(stack.from_canonical(restored, model_config(self.config)), getattr(self.shardings, item))

    def state(self, step: int, params: Any, opt_state: Any, fp8_meta: Any = None) -> Any:
        """The restored train state; fp8_meta None: empty amax histories (`empty_histories`). Its frozen parameters
        (maxpar.training.trainable) are not in checkpoints: they stay abstract here, for the caller to read from
        where the run started (`load_parameters`)."""
        step_array = jax.device_put(np.asarray(step, np.int32), self.shardings.step)
        return self.abstract_state.replace(step=step_array, params=params, opt_state=opt_state,
                                           fp8_meta=self.empty_histories() if fp8_meta is None else fp8_meta)

    def of_item(self, item: str) -> Target:
        """This target with its `item` tree (e.g. the frozen parameters) in place of the parameters: what
        `load_parameters` reads a checkpoint's parameters into."""
        return dataclasses.replace(self, abstract_state=self.abstract_state.replace(
            params=getattr(self.abstract_state, item)), shardings=self.shardings.replace(
            params=getattr(self.shardings, item)))

    def empty_histories(self) -> Any:
        """All-zero fp8 amax histories in this run's shardings, as a new run starts with ({} without delayed
        scaling): what a state restored without them gets (the first step then scales by current amaxes)."""
        return jax.tree.map(lambda a, s: jnp.zeros(a.shape, a.dtype, device=s), self.abstract_state.fp8_meta,
                            self.shardings.fp8_meta)


def state_from_params(params: Any, tx: optax.GradientTransformation, target: Target) -> Any:
    """A step-0 train state around loaded parameters, with fresh optimizer state and amax histories
    (fine-tuning); no frozen parameters yet (the trainer adds them)."""
    def build(p):
        return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p))
    state = jax.jit(build, out_shardings=target.shardings.replace(fp8_meta={}, frozen={}))(params)
    return state.replace(fp8_meta=target.empty_histories())


def _with_histories(manager: ocp.CheckpointManager, step: int, target: Target, items: Sequence[str]
                    ) -> tuple[str, ...]:
    """`items`, and the fp8 amax histories with the training state (opt_state) when this run keeps them and
    the checkpoint has them. A checkpoint without them (written under fp8_scaling=current or without fp8: the
    quantization keys may change on resume) restores with empty histories, as a new run starts."""
    wanted = "opt_state" in items and jax.tree.leaves(target.abstract_state.fp8_meta)
    return (*items, HISTORIES) if wanted and HISTORIES in manager.item_metadata(step).keys() else tuple(items)


# ---------------------------------------------------------------- compatibility

def config_differences(saved: Mapping[str, Any], config: Config, keys: Iterable[str]) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, this config's value) for each of `keys` that differs.

    Keys the checkpoint's config does not have (written before the key existed) are skipped.
    """
    now = config.to_dict()
    return [(key, saved[key], now[key]) for key in keys if key in saved and saved[key] != now[key]]


def _format_differences(differences: Sequence[tuple[str, Any, Any]]) -> str:
    return "\n".join(f"  {key}: {old!r} in the checkpoint, {new!r} now" for key, old, new in differences)


def resume_keys(config: Config) -> tuple[str, ...]:
    """Keys a resumed run must share with its checkpoint: the model's, and those that give the saved data
    position its meaning (declared beside the data sources, maxpar/io/data/pipeline.py)."""
    return tuple(dict.fromkeys(MODEL_KEYS + position_keys(config)))


def check_config(saved: Mapping[str, Any], config: Config, keys: Sequence[str], where: str, advice: str,
                 sources: bool = False) -> None:
    """Refuse a checkpoint whose `keys` differ from this config's (and, with `sources`, whose mixture sources'
    data keys do: pipeline.mixture_differences)."""
    differences = config_differences(saved, config, keys) + (mixture_differences(saved, config) if sources else [])
    if differences:
        raise IncompatibleCheckpoint(f"{where} does not fit this config; these keys differ:\n"
                                     f"{_format_differences(differences)}\n{advice}")


def path_names(path: tuple[Any, ...]) -> str:
    """A key path as 'a/0/b', the same for a restore target and Orbax's metadata tree."""
    names = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(str(getattr(key, attr)))
                break
    return "/".join(names)


def _array_table(tree: Any, floats_as_one: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    def dtype(leaf: Any) -> str:
        name = str(np.dtype(leaf.dtype))
        return "floating" if floats_as_one and jnp.issubdtype(leaf.dtype, jnp.floating) else name
    return {path_names(path): (tuple(leaf.shape), dtype(leaf))
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def structure_differences(saved: Any, target: Any, limit: int = 8, cast_floats: bool = False) -> list[str]:
    """Arrays that are missing, extra, or of another shape/dtype in the checkpoint, as readable lines.

    cast_floats: a floating-point array of another floating dtype is no difference (it is cast on restore).
    """
    old, new = _array_table(saved, cast_floats), _array_table(target, cast_floats)
    lines = [f"  {name}: {old.get(name, 'absent')} in the checkpoint, {new.get(name, 'absent')} now"
             for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]
    return lines[:limit] + ([f"  ... and {len(lines) - limit} more"] if len(lines) > limit else [])


# ---------------------------------------------------------------- reading one step

def _step_dir(manager: ocp.CheckpointManager, step: int) -> epath.Path:
    return epath.Path(manager.directory) / str(step)


def _read_json_items(manager: ocp.CheckpointManager, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, config) of `step`: small JSON files, read before any array."""
    missing = [f"{item}/" for item in ("meta", "config") if not (_step_dir(manager, step) / item).is_dir()]
    if missing:
        raise ValueError(f"its {' and '.join(missing)} directory is missing")
    restored = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(),
                                                            config=ocp.args.JsonRestore()))
    meta, config = restored["meta"], restored["config"]
    if not isinstance(meta, dict) or meta.get("step") != step:
        raise ValueError(f"meta names step {meta.get('step') if isinstance(meta, dict) else meta!r}, not {step}")
    if meta.get("layout") != LAYOUT:
        raise IncompatibleCheckpoint(f"checkpoint step {step} in {manager.directory} has array layout "
                                     f"{meta.get('layout')!r}; this version of maxpar reads {LAYOUT!r}")
    return meta, config


def _is_parameters_only(step_dir: epath.Path) -> bool:
    """Whether a step holds parameters but no training state by design (maxpar.convert writes such steps)."""
    return (step_dir / "params").is_dir() and not (step_dir / "opt_state").exists() and not (step_dir / "data").exists()


def _saved_arrays(metadata: Any, step_dir: epath.Path, item: str, where: str) -> Any:
    """The Orbax metadata tree of `item`; a missing directory or missing/empty metadata is damage (ValueError),
    not an incompatibility: only an intact item says anything about the config that wrote it."""
    if item not in metadata.keys():
        if item != "params" and _is_parameters_only(step_dir):
            raise IncompatibleCheckpoint(f"{where} holds no {item} (a parameters-only checkpoint, as maxpar.convert "
                                         f"writes); start a run from it with load_parameters_path=")
        raise ValueError(f"its {item}/ directory is missing")
    tree = metadata[item]
    if tree is None or not jax.tree_util.tree_leaves(tree):
        raise ValueError(f"its {item}/_METADATA is missing or lists no arrays")
    return tree


def _check_structure(manager: ocp.CheckpointManager, step: int, target: Target, items: Sequence[str],
                     where: str, cast_params: bool = False) -> None:
    """Raise IncompatibleCheckpoint when an intact item's arrays differ from this config's, ValueError when damaged.

    Called after the model keys of the checkpoint's config were found equal to this config's, which fix the
    parameter tree: a params item that lists only some of this config's arrays (each with the right shape and
    dtype, none extra) has lost part of its metadata, which is damage. The optimizer state's tree also depends
    on optimizer settings (clipping on or off), so any difference there is an incompatibility. cast_params: the
    parameters restore into another floating dtype too (LoRA's frozen base in lora_base_weight_dtype).
    """
    metadata = manager.item_metadata(step)
    for item in items:
        saved = _saved_arrays(metadata, _step_dir(manager, step), item, where)
        expected = target.on_disk(item)
        # The optimizer state restores into this run's optimizer_state_dtype (a cast); the parameters'
        # dtype is weight_dtype, a model key checked before.
        lines = structure_differences(saved, expected, cast_floats=item == "opt_state" or cast_params)
        if lines and item == "params" and _is_strict_subset(saved, expected):
            raise ValueError(f"its {item}/_METADATA lists only {len(_array_table(saved))} of the "
                             f"{len(_array_table(expected))} arrays its config implies")
        if lines:
            raise IncompatibleCheckpoint(f"{where}: its {item} arrays differ from this config's:\n" + "\n".join(lines)
                                         + "\nUse the config that wrote it (its config is in the checkpoint's "
                                           "config/ item).")


def _is_strict_subset(saved: Any, expected: Any) -> bool:
    old, new = _array_table(saved), _array_table(expected)
    return len(old) < len(new) and all(new.get(name) == value for name, value in old.items())


def _read_arrays(manager: ocp.CheckpointManager, step: int, target: Target, items: Sequence[str]) -> dict[str, Any]:
    """`items` of `step` in the canonical layout, read straight into this run's shardings: each process reads the
    shards of its own devices (with `read_only_manager`, no collective)."""
    args = {item: ocp.args.StandardRestore(target.on_disk(item)) for item in items}
    restored = manager.restore(step, args=ocp.args.Composite(**args))
    return {item: restored[item] for item in items}


def _in_memory(target: Target, arrays: Mapping[str, Any]) -> dict[str, Any]:
    """Arrays `read_step_arrays` read, in this run's layer layout and shardings: the step of a restore that may
    communicate between processes, so it runs only once every process has read its shards."""
    return {item: target.in_memory(item, array) for item, array in arrays.items()}


def read_data_state(manager: ocp.CheckpointManager, step: int, data_iterator: Any) -> dict[str, Any]:
    """This process's iterator state at `step`, re-split if another number of processes saved it."""
    try:
        return distributed.read_data_state(_step_dir(manager, step) / "data", data_iterator.get_state(),
                                           jax.process_index(), jax.process_count())
    except ConfigError as e:  # a missing or unreadable state file: the checkpoint is damaged
        raise ValueError(f"data iterator state: {e}") from None


def _check_batch_layout(meta: Mapping[str, Any], target: Target, where: str) -> None:
    saved_rows = meta.get("global_batch_rows")
    if saved_rows != target.global_rows:
        raise IncompatibleCheckpoint(
            f"{where} was written with {saved_rows} rows per global batch, this run has {target.global_rows} "
            f"(per_device_batch_size x devices x gradient_accumulation_steps). The data position is saved per "
            f"row, so resume with {saved_rows} rows (e.g. per_device_batch_size={_suggest_batch(saved_rows, target)}), "
            f"or start a new run from this state with load_full_state_path= (its data then starts from the "
            f"beginning, deliberately).")


def _suggest_batch(rows: Any, target: Target) -> str:
    per_device = target.config.per_device_batch_size * (rows / max(target.global_rows, 1))
    return f"{per_device:g}"


def check_resumable(manager: ocp.CheckpointManager, step: int, target: Target, where: str) -> dict[str, Any]:
    """The meta of `step` after checking that its config and batch layout fit this run (IncompatibleCheckpoint)."""
    meta, saved_config = _read_json_items(manager, step)
    check_config(saved_config, target.config, resume_keys(target.config), where,
                 "Changing only parallelism (mesh degrees, logical_axis_rules), scan_layers, dtype, remat or the "
                 "optimizer settings is fine. Use the checkpoint's values, or a new run_name for a fresh run "
                 "(load_parameters_path= / load_full_state_path= start one from this checkpoint).", sources=True)
    _check_batch_layout(meta, target, where)
    return meta


@dataclasses.dataclass(frozen=True)
class StepRead:
    """What this process read of one step, before any collective: its data position (None where none is
    restored), the array items to restore and, once read, those arrays in the canonical layout."""

    step: int
    data_state: dict[str, Any] | None
    items: tuple[str, ...]
    arrays: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def check_step(manager: ocp.CheckpointManager, step: int, target: Target, data_iterator: Any) -> StepRead:
    """The cheap checks of this run's checkpoint `step` (JSON, compatibility, data files, array metadata), or raise."""
    where = f"checkpoint step {step} in {manager.directory}"
    check_resumable(manager, step, target, where)
    data_state = read_data_state(manager, step, data_iterator)
    items = _with_histories(manager, step, target, ARRAY_ITEMS)
    _check_structure(manager, step, target, items, where)
    return StepRead(step, data_state, items)


def read_step_arrays(manager: ocp.CheckpointManager, target: Target, checked: StepRead) -> StepRead:
    """`checked` with its arrays read, or raise."""
    return dataclasses.replace(checked, arrays=_read_arrays(manager, checked.step, target, checked.items))


def restored_state(target: Target, read: StepRead, data_iterator: Any) -> Any:
    """The train state of a step every process has read; the iterator moves only now."""
    arrays = _in_memory(target, read.arrays)
    data_iterator.set_state(read.data_state)
    return target.state(read.step, arrays["params"], arrays["opt_state"], arrays.get(HISTORIES))


def resume_step(manager: ocp.CheckpointManager, step: int, target: Target, data_iterator: Any) -> Any:
    """Restore this run's checkpoint `step` (state and data position) or raise, without agreeing with other
    processes (`resume` does): cheap checks first, arrays last."""
    checked = check_step(manager, step, target, data_iterator)
    return restored_state(target, read_step_arrays(manager, target, checked), data_iterator)


# ---------------------------------------------------------------- choosing a step, with fallback

_READ, _DAMAGED, _INCOMPATIBLE = 0, 1, 2  # what a process found of a step; the worst anywhere decides
_PROBLEM_BYTES = 400  # room for storage.describe_error's one line


def _findings_everywhere(found: int, problem: str) -> list[tuple[int, str]]:
    """(finding, problem) of every process, by process index: one all-gather of a small array, the same on every
    process whatever it found (alone: this process's own)."""
    if jax.process_count() == 1:
        return [(found, problem)]
    from jax.experimental import multihost_utils
    text = problem.encode()[:_PROBLEM_BYTES]
    row = np.zeros(1 + _PROBLEM_BYTES, np.uint8)
    row[0], row[1:1 + len(text)] = found, np.frombuffer(text, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(row)).reshape(-1, 1 + _PROBLEM_BYTES)
    return [(int(r[0]), bytes(r[1:]).rstrip(b"\0").decode(errors="replace")) for r in rows]


def load_everywhere(reads: Sequence[Callable[[Any], Any]], step: int) -> tuple[Any, str | None]:
    """(what the last of `reads` returned, None) when every process read `step`, else (None, the problem).

    All processes must restore the same step, and all must run the same collectives whatever fails where. So
    each read runs no collective (this process's own files; Orbax through `read_only_manager`), and after each
    the processes agree, in one all-gather, before any of them goes on: a failed process never waits in the
    agreement while a peer waits in a collective of its own. Each read gets what the previous one returned (the
    first gets `step`); a cheap first read (metadata) spares the costly one (arrays) everywhere once any process
    found damage. An IncompatibleCheckpoint on any process is raised on every process.
    """
    value: Any = step
    for read in reads:
        try:
            value, error = read(value), None
        except Exception as e:  # any read failure means this step cannot be trusted
            value, error = None, e
        found = _READ if error is None else _INCOMPATIBLE if isinstance(error, IncompatibleCheckpoint) else _DAMAGED
        findings = _findings_everywhere(found, "" if error is None else storage.describe_error(error))
        worst = max(f for f, _ in findings)
        if worst == _READ:
            continue
        if found == worst:  # this process's own error says the most
            if found == _INCOMPATIBLE:
                raise error
            return None, findings[jax.process_index()][1]
        process, problem = next((p, text) for p, (f, text) in enumerate(findings) if f == worst)
        if worst == _INCOMPATIBLE:
            raise IncompatibleCheckpoint(f"checkpoint step {step} does not fit this config on process {process}: "
                                         f"{problem}")
        return None, f"on process {process}: {problem}"
    return value, None


def first_usable(steps: Sequence[int], reads: Sequence[Callable[[Any], Any]], where: str, warn: Warn
                 ) -> tuple[int, Any, list[int]] | None:
    """(step, what `reads` returned, unusable newer steps) for the newest step that every process reads
    (`load_everywhere`), or None if none exist.

    An unreadable step (truncated or missing file, bad JSON...) earns a warning naming the step
    and the problem and the next older step is tried; an IncompatibleCheckpoint is raised at once.
    Raises CheckpointError when steps exist but none loads.
    """
    problems: list[tuple[int, str]] = []
    for step in steps:
        loaded, problem = load_everywhere(reads, step)
        if problem is None:
            return step, loaded, [s for s, _ in problems]
        older = [s for s in steps if s < step]
        warn(f"checkpoint step {step} in {where} is unusable ({problem}); "
             + (f"falling back to step {older[0]}" if older else "no older checkpoint is left"))
        problems.append((step, problem))
    if problems:
        listing = "; ".join(f"step {s}: {p}" for s, p in problems)
        raise CheckpointError(f"no usable checkpoint in {where} ({listing}). Nothing was deleted or moved. Move the "
                              f"unreadable checkpoints aside to start over, or start from a readable one with "
                              f"load_full_state_path= / load_parameters_path=.")
    return None


def set_aside(directory: epath.Path, step: int) -> epath.Path:
    """Rename an unusable step directory to STEP.unusable[.N] (kept for inspection, out of Orbax's listing)."""
    source = directory / str(step)
    for n in range(1000):
        destination = directory / (f"{step}.unusable" + (f".{n}" if n else ""))
        if not destination.exists():
            source.rename(destination)
            return destination
    raise CheckpointError(f"cannot set aside {source}: too many earlier .unusable copies")


def resume(manager: ocp.CheckpointManager, target: Target, data_iterator: Any, warn: Warn = warn_stderr) -> Any | None:
    """The run's state from its newest usable checkpoint (data iterator restored in place), or None.

    Unusable newer checkpoints are renamed aside, so that this run can save those steps again and
    `max_checkpoints_to_keep` never counts them in place of good ones.
    """
    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
        return None
    reader = read_only_manager(manager.directory)
    try:
        found = first_usable(steps, (lambda s: check_step(reader, s, target, data_iterator),
                                     lambda checked: read_step_arrays(reader, target, checked)),
                             str(manager.directory), warn)
    finally:
        reader.close()
    step, read, unusable = found
    state = restored_state(target, read, data_iterator)
    if unusable:
        if jax.process_index() == 0:
            for bad in unusable:
                warn(f"moved unusable checkpoint step {bad} aside to {set_aside(epath.Path(manager.directory), bad)}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("maxpar: unusable checkpoints set aside")
        manager.reload()
    return state


# ---------------------------------------------------------------- starting a new run from another run

def resolve_source(key: str, value: str) -> tuple[epath.Path, int | None]:
    """(checkpoints directory, step or None for the newest) of a load_*_path value."""
    path = storage.path(value)
    if path.name.isdigit() and path.parent.is_dir():
        return path.parent, int(path.name)
    for candidate in (path / "checkpoints", path):
        if candidate.is_dir() and any(child.name.isdigit() for child in candidate.iterdir()):
            return candidate, None
    raise ConfigError(f"{key}={value!r}: no checkpoint there. Give a step directory (RUN/checkpoints/STEP), or a run "
                      f"directory (RUN) or its checkpoints directory to take the newest usable step.")


def _load_from(key: str, value: str, target: Target, items: Sequence[str], warn: Warn) -> StepRead:
    directory, step = resolve_source(key, value)
    manager = read_only_manager(directory)
    try:
        if step is not None and step not in manager.all_steps():
            raise ConfigError(f"{key}={value!r}: step {step} is not a complete checkpoint; complete steps there: "
                              f"{sorted(manager.all_steps()) or 'none'}")
        steps = [step] if step is not None else sorted(manager.all_steps(), reverse=True)

        def check(s: int) -> StepRead:
            where = f"{key}={value!r} (step {s})"
            _, saved_config = _read_json_items(manager, s)
            check_config(saved_config, target.config, MODEL_KEYS, where,
                         "Loading needs the same model shape; everything else may change. The checkpoint carries "
                         "its model: the commands take it from there when no model key or model_name= is given "
                         "(maxpar.io.run_config.load_run_config).")
            restored = _with_histories(manager, s, target, items)
            _check_structure(manager, s, target, restored, where, cast_params=True)
            return StepRead(s, None, restored)

        found = first_usable(steps, (check, lambda checked: read_step_arrays(manager, target, checked)),
                             str(directory), warn)
        if found is None:
            raise ConfigError(f"{key}={value!r}: no complete checkpoint in {directory}")
        return found[1]
    finally:
        manager.close()


def load_full_state(value: str, target: Target, warn: Warn = warn_stderr) -> Any:
    """Parameters, optimizer state and step of another run's checkpoint; the data starts afresh."""
    read = _load_from("load_full_state_path", value, target, ARRAY_ITEMS, warn)
    arrays = _in_memory(target, read.arrays)
    return target.state(read.step, arrays["params"], arrays["opt_state"], arrays.get(HISTORIES))


def load_parameters(value: str, target: Target, warn: Warn = warn_stderr, key: str = "load_parameters_path") -> Any:
    """Only the model parameters of another run's checkpoint (for fine-tuning). A LoRA run's checkpoint holds its
    adapters only: they are merged into its own starting parameters (read the same way, so a chain of LoRA runs
    merges in order)."""
    return target.in_memory("params", _canonical_parameters(key, value, target, warn))


def _canonical_parameters(key: str, value: str, target: Target, warn: Warn) -> Any:
    """`load_parameters`' parameters in the canonical layout, in the target's shardings."""
    _, saved, _ = parameters_metadata(key, value)
    if not saved.get("lora_rank"):
        return _load_from(key, value, target, ("params",), warn).arrays["params"]
    where = f"{key}={value!r}"
    check_config(saved, target.config, MODEL_KEYS, where, "Loading needs the same model shape; everything else may "
                                                          "change.")
    base_path = saved.get("load_parameters_path") or ""
    if not base_path:
        raise ConfigError(f"{where} is a LoRA run (lora_rank={saved['lora_rank']}) that started from a seeded "
                          f"initialization, not from a checkpoint: there are no base weights its adapters belong to")
    base = _canonical_parameters(f"{where}'s load_parameters_path", base_path, target, warn)
    adapters = _read_adapters(key, value, base)
    factor = saved["lora_alpha"] / saved["lora_rank"]
    shardings = jax.tree.map(lambda a: a.sharding, base)
    return jax.jit(lambda b, a: lora.merge_adapters(lora.with_adapters(b, a), factor), out_shardings=shardings)(
        base, adapters)


def _read_adapters(key: str, value: str, like: Any) -> Any:
    """A LoRA checkpoint's adapters (its params item, canonical layout), replicated on the mesh of `like`'s arrays:
    they are small."""
    mesh = jax.tree.leaves(like)[0].sharding.mesh
    directory, _ = resolve_source(key, value)
    step, _, metadata = parameters_metadata(key, value)
    manager = read_only_manager(directory)
    try:
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype,
                                                               sharding=NamedSharding(mesh, PartitionSpec())),
                                metadata.tree if hasattr(metadata, "tree") else metadata)
        return manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))["params"]
    finally:
        manager.close()


# ---------------------------------------------------------------- parameters-only checkpoints (maxpar.convert)

def save_parameters(run_dir: epath.PathLike, params: Any, config: Config, step: int = 0) -> epath.Path:
    """Write `params` (canonical layout) as RUN_DIR/checkpoints/STEP: the params, meta and config items that
    load_parameters_path= reads, and no optimizer or data state (so it starts runs, never resumes them)."""
    manager = make_manager(run_dir, config)
    try:
        manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            meta=ocp.args.JsonSave(checkpoint_meta(step, 0)),
            config=ocp.args.JsonSave(config.to_dict()),
        ))
        manager.wait_until_finished()
        return _step_dir(manager, step)
    finally:
        manager.close()


def parameters_metadata(key: str, value: str) -> tuple[int, dict[str, Any], Any]:
    """(step, saved config, Orbax metadata tree of the params item) of a checkpoint named as load_parameters_path=
    names one (a run directory means its newest step), read without touching any array."""
    directory, step = resolve_source(key, value)
    manager = read_only_manager(directory)
    try:
        steps = sorted(manager.all_steps())
        if step is None and not steps:
            raise ConfigError(f"{key}={value!r}: no complete checkpoint in {directory}")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise ConfigError(f"{key}={value!r}: step {step} is not a complete checkpoint; complete steps there: "
                              f"{steps or 'none'}")
        _, config = _read_json_items(manager, step)
        return step, config, manager.item_metadata(step)["params"]
    finally:
        manager.close()
