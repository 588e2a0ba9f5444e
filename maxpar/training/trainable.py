"""Which parameters a run trains and which it keeps frozen, decided once for the train state.

The train state's `params` are what the optimizer updates and the checkpoints save; its `frozen` parameters are
the starting checkpoint's, never updated nor saved (a restart reads them from load_parameters_path again):
- LoRA (lora_rank > 0): params = the adapters; frozen = every other weight of the model (the base), in
  lora_base_weight_dtype. The model runs on the two joined; without the adapters it is the base.
- DPO without LoRA: params = the whole model; frozen = a copy of it, the reference model.
- otherwise frozen is empty.
So DPO's reference is `frozen` either way: the base under LoRA, the copy without.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import dataclasses

import jax
import jax.numpy as jnp

from maxpar.core.config import Config, ConfigError
from maxpar.model.lora import split_adapters, with_adapters
from maxpar.model.roles import ADAPTABLE, param_role


def split(params: Any, config: Config) -> tuple[Any, Any]:
    """(trained, frozen) of the model's full parameter tree (boxed, abstract or arrays)."""
    if config.lora_rank:
        adapters, base = split_adapters(params)
        dtype = config.lora_base_weight_dtype
        return adapters, (jax.tree.map(lambda w: w.astype(jnp.dtype(dtype)), base) if dtype else base)
    if config.use_dpo:
        return params, params
    return params, {}


def policy(params: Any, frozen: Any, config: Config) -> Any:
    """The parameters the trained model runs with: the adapters joined to the base under LoRA, else `params`."""
    return with_adapters(frozen, params) if config.lora_rank else params


def reference(frozen: Any) -> Any:
    """DPO's reference model: the frozen parameters (the base under LoRA, which then runs without adapters)."""
    return frozen


def _roles(params: Mapping[str, Any], keys: tuple[str, ...] = ()) -> set[str]:
    roles = set()
    for key, value in params.items():
        here = (*keys, str(key))
        if isinstance(value, Mapping):
            roles |= _roles(value, here)
        elif (role := param_role(here)) is not None:
            roles.add(role.value)
    return roles


def check_lora_targets(params: Mapping[str, Any], config: Config) -> None:
    """Every role of lora_target_roles is one LoRA adapts and one this model has (a ConfigError naming it)."""
    if not config.lora_rank:
        return
    allowed = [role.value for role in ADAPTABLE]
    unknown = [name for name in config.lora_target_roles if name not in allowed]
    if unknown:
        raise ConfigError(f"lora_target_roles: {unknown[0]!r} is not a projection role LoRA adapts; allowed: "
                          f"{', '.join(allowed)}")
    present = _roles(params)
    missing = [name for name in config.lora_target_roles if name not in present]
    if missing:
        raise ConfigError(f"lora_target_roles: this model has no {missing[0]!r} weights; the roles it has that LoRA "
                          f"adapts: {', '.join(name for name in allowed if name in present)}")


def merged_config(config: Config) -> Config:
    """The config that runs a trained model as one set of parameters (sampling, export): no adapters, which
    `maxpar.io.checkpoint.load_parameters` merges into the base, and nothing frozen."""
    return dataclasses.replace(config, lora_rank=0, lora_base_weight_dtype="", use_dpo=False)
