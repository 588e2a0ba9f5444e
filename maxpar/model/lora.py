"""LoRA: low-rank adapters beside the projection weights of the roles `lora_target_roles` names.

An adapted weight W (its role's `Projection`: leading expert dims, the dims x is contracted over, the output's)
gets two factors beside it in the same module, `{name}_lora_a` A [experts, inputs, rank] and `{name}_lora_b`
B [experts, rank, outputs] (`maxpar.model.roles.adapter_name`), and the projection becomes
    x W + lora_alpha / lora_rank x (x A) B.
A is initialized like a weight of its fan-in and B at zero, so an adapted model starts as its base. The model
applies an adapter wherever its parameter tree holds one: the same model without them is the base (DPO's
reference under LoRA). Which parameters train and which stay frozen is the train step's choice
(`maxpar.training.trainable`); here are the arithmetic and the tree operations it needs.

Dense projections add (x A) B to the output (`adapted_projection`): two thin matmuls, no weight-sized term, so
the frozen W has no gradient to compute. The experts' weights go to the MoE dispatch (maxpar.model.moe_dispatch)
whole, all-gathered and exchanged there, so an expert weight is merged first (`adapted_weight`: W + s A B, one
weight-sized einsum per layer) and the dispatch runs unchanged under every sharding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxpar.model.matmul import matmul
from maxpar.model.roles import ParamRole, Projection, adapter_axes, adapter_name, adapter_of, param_role

Array = jax.Array
_RANK = "z"  # the einsum letter of the adapter rank (model specs use lowercase letters from their dims' names)


def scale(config: Any) -> float:
    """lora_alpha / lora_rank: what the adapter's output is multiplied by."""
    return config.lora_alpha / config.lora_rank


def targeted(module: nn.Module, name: str) -> ParamRole | None:
    """The role of `module`'s weight `name` when the run adapts it (lora_rank > 0, its role in lora_target_roles),
    else None."""
    config = module.config
    if not config.lora_rank:
        return None
    role = param_role((module.name or "", name))
    return role if role is not None and role.value in config.lora_target_roles else None


def factor_shapes(shape: tuple[int, ...], split: Projection, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of A and B of a weight of `shape` split as `split` says."""
    lead, inputs = shape[:split.batch], shape[split.batch:split.batch + split.inputs]
    return (*lead, *inputs, rank), (*lead, rank, *shape[split.batch + split.inputs:])


def adapter(module: nn.Module, name: str, w: Array) -> tuple[Array, Array] | None:
    """(A, B) of `module`'s weight `name` (created at init when the run adapts it), or None: not adapted, or applied
    without adapters (the base model)."""
    a_name, b_name = adapter_name(name, ParamRole.LORA_A), adapter_name(name, ParamRole.LORA_B)
    if module.is_initializing():
        role = targeted(module, name)
        if role is None:
            return None
        split = role.projection
        a_shape, b_shape = factor_shapes(w.shape, split, module.config.lora_rank)
        batch = tuple(range(split.batch))
        a_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", batch_axis=batch,
                                                  in_axis=tuple(range(split.batch, split.batch + split.inputs)),
                                                  out_axis=(len(a_shape) - 1,))
        dtype = module.weight_dtype
        a = module.param(a_name, nn.with_logical_partitioning(a_init, adapter_axes(role, ParamRole.LORA_A)),
                         a_shape, dtype)
        b = module.param(b_name, nn.with_logical_partitioning(nn.initializers.zeros,
                                                              adapter_axes(role, ParamRole.LORA_B)), b_shape, dtype)
        return a, b
    if not module.has_variable("params", a_name):
        return None
    return module.get_variable("params", a_name), module.get_variable("params", b_name)


def factor_specs(spec: str, split: Projection) -> tuple[str, str]:
    """The einsum specs of x's projection through A and of that through B, from the weight's spec: 'ble,ehd->blhd'
    with one input dim -> ('ble,ez->blz', 'blz,zhd->blhd')."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    lead, contracted, rest = w[:split.batch], w[split.batch:split.batch + split.inputs], w[split.batch + split.inputs:]
    low = "".join(c for c in x if c not in contracted) + _RANK
    return f"{x},{lead}{contracted}{_RANK}->{low}", f"{low},{lead}{_RANK}{rest}->{out}"


def adapted_projection(module: nn.Module, spec: str, x: Array, w: Array, name: str, y: Array) -> Array:
    """`y` (x's projection by `module`'s weight `name`) plus its adapter's lora_alpha / lora_rank x (x A) B, in the
    module's compute dtype; `y` as it is without an adapter."""
    factors = adapter(module, name, w)
    if factors is None:
        return y
    role = param_role((module.name or "", name))
    to_low, from_low = factor_specs(spec, role.projection)
    a, b = factors
    low = matmul(to_low, x, a, module.dtype)
    return y + (scale(module.config) * matmul(from_low, low, b, module.dtype)).astype(y.dtype)


def merged(w: Array, a: Array, b: Array, inputs: int, factor: float) -> Array:
    """W + factor x A B in W's dtype. A [outer..., inputs..., rank] and B [outer..., rank, outputs...] share their
    leading dims (layers, repeats, experts: whatever stacks them), W has them too; `inputs` dims are contracted with
    x. Works on numpy arrays too (the converter's export)."""
    outer_count = a.ndim - inputs - 1
    letters = "abcdefghijklmnopqrstuvwxy"
    outer, rest = letters[:outer_count], letters[outer_count:]
    ins, outs = rest[:inputs], rest[inputs:inputs + w.ndim - outer_count - inputs]
    delta = jnp.einsum(f"{outer}{ins}{_RANK},{outer}{_RANK}{outs}->{outer}{ins}{outs}",
                       a.astype(jnp.float32), b.astype(jnp.float32))
    return (w.astype(jnp.float32) + factor * delta).astype(w.dtype)


def adapted_weight(module: nn.Module, name: str, w: Array) -> Array:
    """`module`'s weight `name` with its adapter merged in (W + lora_alpha / lora_rank x A B), or as it is."""
    factors = adapter(module, name, w)
    if factors is None:
        return w
    return merged(w, *factors, param_role((module.name or "", name)).projection.inputs, scale(module.config))


# ---------------------------------------------------------------- parameter trees

def _is_adapter(keys: tuple[str, ...]) -> bool:
    return adapter_of(keys) is not None


def split_adapters(params: Mapping[str, Any], keys: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(the adapters, everything else) of a nested parameter dict, each keeping the nesting (no empty branches)."""
    adapters, base = {}, {}
    for key, value in params.items():
        here = (*keys, str(key))
        if isinstance(value, Mapping):
            inner_adapters, inner_base = split_adapters(value, here)
            if inner_adapters:
                adapters[key] = inner_adapters
            if inner_base:
                base[key] = inner_base
        elif _is_adapter(here):
            adapters[key] = value
        else:
            base[key] = value
    return adapters, base


def with_adapters(base: Mapping[str, Any], adapters: Mapping[str, Any]) -> dict:
    """The nested union of two parameter dicts with disjoint leaves (`split_adapters`' inverse)."""
    joined = dict(base)
    for key, value in adapters.items():
        joined[key] = with_adapters(joined[key], value) if isinstance(value, Mapping) and key in joined else value
    return joined


def merge_adapters(params: Mapping[str, Any], factor: float) -> dict:
    """A tree with adapters -> the same model without them: each adapted weight replaced by W + factor x A B."""
    adapters, base = split_adapters(params)

    def merge(node: Mapping[str, Any], adapted: Mapping[str, Any], keys: tuple[str, ...]) -> dict:
        out = dict(node)
        for key, value in node.items():
            if isinstance(value, Mapping):
                out[key] = merge(value, adapted.get(key, {}), (*keys, str(key)))
                continue
            a_name, b_name = adapter_name(str(key), ParamRole.LORA_A), adapter_name(str(key), ParamRole.LORA_B)
            if a_name in adapted:
                inputs = param_role((*keys, str(key))).projection.inputs
                out[key] = merged(value, adapted[a_name], adapted[b_name], inputs, factor)
        return out
    return merge(base, adapters, ())

