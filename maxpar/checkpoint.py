"""Orbax checkpoints of the full training state, the data iterator and the config.

Layout: RUN_DIR/checkpoints/STEP/{state, data, config}. `state` holds the
TrainState arrays (sharding-independent on disk, restored onto whatever mesh
the restoring run uses); `data` one Grain iterator state per process;
`config` the resolved config as JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grain.checkpoint
import jax
import orbax.checkpoint as ocp

from maxpar.config import Config


def make_manager(run_dir: Path, config: Config) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=config.max_checkpoints_to_keep or None,
        enable_async_checkpointing=config.async_checkpointing,
        create=True,
    )
    handlers = {
        "state": ocp.StandardCheckpointHandler(),
        "data": grain.checkpoint.CheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(),
    }
    return ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options, item_handlers=handlers)


def save(manager: ocp.CheckpointManager, step: int, state: Any, data_iterator: Any, config: Config) -> None:
    """Start an (async, if configured) save of everything needed to resume at `step`."""
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iterator),
        config=ocp.args.JsonSave(config.to_dict()),
    ))


def restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any, shardings: Any,
            data_iterator: Any) -> Any:
    """Restore `step` onto `shardings` (the current mesh's), and the data iterator in place."""
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target),
        data=grain.checkpoint.CheckpointRestore(data_iterator),
    ))
    return restored["state"]
