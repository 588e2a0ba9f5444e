"""The config a command runs with: its YAML and key=value overrides, and the model of the checkpoint it starts from.

A checkpoint carries its model: every step's `config/` item holds the config that wrote it (a run's, or the one
`maxpar.convert from_hf` converted to). So `load_parameters_path=DIR` (or `load_full_state_path=DIR`) with
configs/base.yml is enough for train, generate and plan: `load_run_config` reads the checkpoint's model keys
(`maxpar.core.config.CARRIED_KEYS`) and `load_config` puts them over the YAML's defaults, under what the user set.
Reading is plain file access (no JAX, no Orbax manager), so it runs before the devices or a multi-process job start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from maxpar.core.config import CARRIED_KEYS, FUNCTION_KEYS, CarriedModel, Config, ConfigError, load_config
from maxpar.io.checkpoint import resolve_source


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A command's config, and the one line that says which checkpoint's model it took ('' = none)."""
    config: Config
    note: str = ""


def saved_config(directory: epath.Path, step: int | None) -> tuple[int, dict[str, Any]] | None:
    """(step, config) of the named step, or of the newest step whose config item reads; None if none does (the
    load itself then says what is wrong with the checkpoint)."""
    steps = [step] if step is not None else sorted(
        (int(child.name) for child in directory.iterdir() if child.name.isdigit()), reverse=True)
    for candidate in steps:
        try:
            saved = ocp.JsonCheckpointHandler().restore(directory / str(candidate) / "config")
        except (OSError, ValueError):  # missing or damaged: an older step of the run carries the same model
            continue
        if isinstance(saved, dict):
            return candidate, saved
    return None


def checkpoint_model(key: str, value: str) -> CarriedModel | None:
    """The model the checkpoint at `value` (a load_*_path) carries, or None where there is no readable one."""
    try:
        directory, step = resolve_source(key, value)
    except (ConfigError, OSError):  # no checkpoint there, or unreachable: the load says so
        return None
    found = saved_config(directory, step)
    if found is None:
        return None
    step, saved = found
    return CarriedModel(f"{key}={value} (step {step})", {k: saved[k] for k in CARRIED_KEYS if k in saved})


def describe(config: Config, carried: CarriedModel) -> str:
    """One line: the model taken, and the checkpoint's keys the user changed."""
    changed = [f"{key}={getattr(config, key)!r} (the checkpoint's: {carried.values[key]!r})"
               for key in (*FUNCTION_KEYS, "tokenizer_path")
               if key in carried.values and config.to_dict()[key] != carried.values[key]]
    return (f"maxpar: model from {carried.source}: {config.model_name or 'no preset (its own keys)'}"
            + (f"; changed: {', '.join(changed)}" if changed else ""))


def load_run_config(argv: Sequence[str]) -> RunConfig:
    """`load_config(argv)`, with the model of the checkpoint that load_parameters_path or load_full_state_path
    names (ConfigError where the user's settings contradict its parameters' shapes)."""
    config = load_config(argv)
    key = "load_parameters_path" if config.load_parameters_path else "load_full_state_path"
    carried = checkpoint_model(key, getattr(config, key)) if getattr(config, key) else None
    if carried is None:
        return RunConfig(config)
    config = load_config(argv, carried)
    return RunConfig(config, describe(config, carried))
