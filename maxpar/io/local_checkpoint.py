"""The local checkpoint tier: each process saves the blocks of the state its own devices hold to node-local disk,
often; a restart takes the newest step complete on every process in either tier (docs/checkpoints.md).

Why not Orbax's emergency.CheckpointManager: it needs two or more data-parallel replicas (with one it is its
persistent manager alone), restores a lost local tier by broadcasting from another replica (so a run whose state is
sharded over processes, FSDP across hosts, cannot), and holds one `state` PyTree: no per-process data position, meta
or config. So the local tier is a second ordinary CheckpointManager per process, run by that process alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import grain.checkpoint
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from maxpar.core import storage
from maxpar.core.config import Config
from maxpar.io import checkpoint
from maxpar.io.checkpoint import ARRAY_ITEMS, HISTORIES, Target, Warn, warn_stderr

# Orbax's asynchronous directory creation signals completion under keys shared by all processes, so one process
# could take another's signal for its own directories; the local tier creates them before writing instead.
_CREATE_DIRECTORIES_FIRST = ocp.AsyncOptions(create_directories_asynchronously=False)
LOCAL_KEEP = 2  # newest steps the local tier keeps: it is a cache for preemptions; the persistent tier is the record
_LOCAL_LISTED = 8  # newest local steps each process reports when the processes agree on one
LOCAL_ITEMS = (*ARRAY_ITEMS, HISTORIES)  # the state's arrays, in the run's own layer layout and shardings


def local_directory(config: Config, run_name: str) -> epath.Path:
    """This process's own directory of the local tier.

    Processes on one machine share `local_checkpoint_directory`, so each writes under process_K-of-N; the count in
    the name keeps a job of another size from reading it.
    """
    return (storage.path(config.local_checkpoint_directory) / run_name
            / f"process_{jax.process_index()}-of-{jax.process_count()}")


def make_local_manager(run_name: str, config: Config) -> ocp.CheckpointManager | None:
    """This process's manager of the local tier, or None when it is off.

    It is active on this process only (no barrier with a peer, every file its own), so a save never waits for
    another process and a restore reads this process's own disk only. Saves are written under a temporary name
    and renamed when complete, as in the persistent tier.
    """
    if not config.local_checkpoint_directory:
        return None
    me = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={me},
                                               barrier_sync_key_prefix=f"maxpar_local_{me}")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=LOCAL_KEEP, enable_async_checkpointing=config.async_checkpointing, cleanup_tmp_directories=True,
        create=False, multiprocessing_options=alone, save_root_metadata=False, async_options=_CREATE_DIRECTORIES_FIRST)
    handlers = {"state": BlocksHandler(),
                "meta": ocp.JsonCheckpointHandler(multiprocessing_options=alone),
                "data": grain.checkpoint.CheckpointHandler(),
                "config": ocp.JsonCheckpointHandler(multiprocessing_options=alone)}
    directory = storage.absolute(local_directory(config, run_name))
    directory.mkdir(parents=True, exist_ok=True)  # Orbax creates no root directory for a subset of processes
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def _block_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _own_blocks(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> list[tuple[tuple[int, int], ...]]:
    """The distinct blocks of an array of `shape` that this process's devices hold, in a fixed order."""
    return sorted({_block_key(index, shape) for index in sharding.addressable_devices_indices_map(shape).values()})


def _live(target: Target) -> Any:
    """The LOCAL_ITEMS as this run holds them: its layer layout and shardings (the local tier's form)."""
    return tuple(jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              getattr(target.abstract_state, item), getattr(target.shardings, item))
                 for item in LOCAL_ITEMS)


def pieces_layout(tree: Any) -> str:
    """A digest of what this process holds of `tree` (arrays, or ShapeDtypeStructs with shardings): each leaf's
    path, shape, dtype and blocks. Equal at save and restore exactly when the blocks saved are the ones needed."""
    rows = [(checkpoint.path_names(path), tuple(leaf.shape), str(np.dtype(leaf.dtype)),
             _own_blocks(leaf.shape, leaf.sharding)) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]
    return hashlib.sha256(repr(rows).encode()).hexdigest()


def _own_pieces(array: jax.Array) -> list[np.ndarray]:
    """This process's distinct blocks of `array` as raw bytes: copies (the step may donate the buffers), in any
    dtype (bfloat16 too); the restoring run reads them back with its own dtype and block shapes."""
    blocks = {_block_key(shard.index, array.shape): shard.data for shard in array.addressable_shards}
    return [np.array(blocks[key], copy=True).reshape(-1).view(np.uint8) for key in sorted(blocks)]


def _from_pieces(pieces: Sequence[np.ndarray], leaf: jax.ShapeDtypeStruct) -> jax.Array:
    keys = _own_blocks(leaf.shape, leaf.sharding)
    blocks = {key: raw.view(np.dtype(leaf.dtype)).reshape([stop - start for start, stop in key])
              for key, raw in zip(keys, pieces, strict=True)}
    return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda index: blocks[_block_key(index, leaf.shape)])


class BlocksHandler(ocp.AsyncCheckpointHandler):
    """One process's blocks of the state, one .npz file, written in the background (the blocks are host copies).
    Orbax's array handlers do not fit a tier that each process restores alone: they write numpy arrays on process 0
    only, and a jax.Array as part of one global array."""

    FILE = "blocks.npz"

    async def async_save(self, directory: epath.Path, args: BlocksSave) -> list[ocp.future.Future]:
        async def write() -> None:
            self.save(directory, args)
        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="maxpar_local_blocks")]

    def save(self, directory: epath.Path, args: BlocksSave) -> None:
        with (directory / self.FILE).open("wb") as file:
            np.savez(file, **{f"{i}.{j}": block for i, blocks in enumerate(args.blocks)
                              for j, block in enumerate(blocks)})

    def restore(self, directory: epath.Path, args: BlocksRestore | None = None) -> list[list[np.ndarray]]:
        with (directory / self.FILE).open("rb") as file, np.load(file) as saved:
            names = sorted((tuple(map(int, name.split("."))), name) for name in saved.files)
            leaves: list[list[np.ndarray]] = [[] for _ in range(names[-1][0][0] + 1 if names else 0)]
            for (leaf, _), name in names:
                leaves[leaf].append(saved[name])
        return leaves

    def metadata(self, directory: epath.Path) -> None:
        return None

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self) -> None:
        pass


@ocp.args.register_with_handler(BlocksHandler, for_save=True)
@dataclasses.dataclass
class BlocksSave(ocp.args.CheckpointArgs):
    blocks: list[list[np.ndarray]]


@ocp.args.register_with_handler(BlocksHandler, for_restore=True)
@dataclasses.dataclass
class BlocksRestore(ocp.args.CheckpointArgs):
    pass


def save_local(manager: ocp.CheckpointManager, step: int, state: Any, data_iterator: Any, config: Config,
               global_rows: int) -> None:
    """Start a save of `step` to this process's local tier: the blocks of the state that its own devices hold
    (copied to host before this returns), its data position, the meta and the config."""
    arrays = tuple(getattr(state, item) for item in LOCAL_ITEMS)
    manager.save(step, args=ocp.args.Composite(
        state=BlocksSave([_own_pieces(a) for a in jax.tree.leaves(arrays)]),
        meta=ocp.args.JsonSave({**checkpoint.checkpoint_meta(step, global_rows), "pieces": pieces_layout(arrays)}),
        data=grain.checkpoint.CheckpointSave(data_iterator),
        config=ocp.args.JsonSave(config.to_dict()),
    ))


def _read_local_step(manager: ocp.CheckpointManager, step: int, target: Target,
                     data_iterator: Any) -> tuple[dict[str, Any], list[list[np.ndarray]]]:
    """(this process's data state, its saved blocks) of local `step`, or raise. Only reads this process's own files,
    no collective: the processes agree on the step before any global array is built. A tier written under another
    mesh, process count or state layout holds other blocks than this run needs: a ValueError (the persistent tier
    is then used)."""
    meta = checkpoint.check_resumable(manager, step, target, f"local checkpoint step {step} in {manager.directory}")
    if meta.get("pieces") != pieces_layout(_live(target)):
        raise ValueError("it was written under another mesh, process count or state layout")
    data_state = checkpoint.read_data_state(manager, step, data_iterator)
    saved = manager.restore(step, args=ocp.args.Composite(state=BlocksRestore()))["state"]
    expected = [len(_own_blocks(leaf.shape, leaf.sharding)) for leaf in jax.tree.leaves(_live(target))]
    if [len(blocks) for blocks in saved] != expected:
        raise ValueError(f"its state holds other blocks ({sum(map(len, saved))}) than this run needs ({sum(expected)})")
    return data_state, saved


def _local_state(step: int, saved: list[list[np.ndarray]], target: Target) -> Any:
    """The train state of local `step` from every process's own blocks (all processes call this together)."""
    live = _live(target)
    params, opt_state, histories = jax.tree.unflatten(jax.tree.structure(live),
                                                      [_from_pieces(blocks, leaf) for blocks, leaf in
                                                       zip(saved, jax.tree.leaves(live))])
    return target.state(step, params, opt_state, histories)


def _steps_on_every_process(steps: Iterable[int]) -> tuple[list[int], int]:
    """(the steps every process lists, newest first; the newest step any process lists, -1 if none). A node-local
    step is usable only where every process has it."""
    newest = sorted(steps, reverse=True)[:_LOCAL_LISTED]
    if jax.process_count() == 1:
        return newest, max(newest, default=-1)
    from jax.experimental import multihost_utils
    padded = np.full(_LOCAL_LISTED, -1, np.int32)
    padded[:len(newest)] = newest
    listed = np.asarray(multihost_utils.process_allgather(padded)).tolist()
    common = set(listed[0]).intersection(*listed[1:]) - {-1}
    return sorted(common, reverse=True), max(max(row) for row in listed)


def _drop_local_after(manager: ocp.CheckpointManager, step: int) -> None:
    """Delete this process's local steps newer than the one the run resumes from: another timeline's, which must
    never be restored later and would block saving those steps again."""
    for newer in [s for s in manager.all_steps() if s > step]:
        manager.delete(newer)


def resume_tiers(manager: ocp.CheckpointManager, local: ocp.CheckpointManager | None, target: Target,
                 data_iterator: Any, warn: Warn = warn_stderr) -> tuple[Any, str] | None:
    """(state, which tier) from the newest step complete on every process in either tier, or None.

    A local step is taken only when it is newer than the persistent tier's newest step and every process can read
    its own copy; otherwise the persistent tier resumes as `checkpoint.resume` does (with its fallback).
    """
    if local is not None:
        persistent = max(manager.all_steps(), default=-1)
        common, anywhere = _steps_on_every_process(local.all_steps())
        newer = [s for s in common if s > persistent]
        if anywhere > max(newer + [persistent]):
            warn(f"local checkpoint step {anywhere} is not on every process (a lost local disk?); not using it")
        for step, older in zip(newer, newer[1:] + [None]):
            read, problem = checkpoint.load_everywhere([lambda s: _read_local_step(local, s, target, data_iterator)],
                                                       step)
            if problem is None:
                data_state, saved = read
                state = _local_state(step, saved, target)
                data_iterator.set_state(data_state)
                _drop_local_after(local, step)
                return state, f"local tier, {local.directory}"
            warn(f"local checkpoint step {step} in {local.directory} is not used ({problem}); "
                 + ("resuming from the persistent tier" if older is None else f"trying local step {older}"))
    state = checkpoint.resume(manager, target, data_iterator, warn)
    if state is None:
        return None
    if local is not None:
        _drop_local_after(local, int(state.step))
    return state, f"persistent tier, {manager.directory}"
