"""The layer layout, in one place: how the decoder's repeated unit is stored, and the canonical form.

Three layouts of the same layers, chosen by the config:
- stacked (`scan_layers=true`): one `layers` entry whose leaves have a leading axis of length
  `num_units` (the scan's; the pipeline's stages split it);
- circular (a stacked run with `num_pipeline_repeats=R > 1`): leaves [R, num_units / R, ...], so
  that the stages split the second axis; unit r * num_units/R + i sits at [r, i];
- unrolled (`scan_layers=false`): entries `layers_0 .. layers_{n-1}`.

With `first_num_dense_layers=k` the k dense layers before the MoE stack are a second stack,
`dense_layers` (leading axis `dense_layers`, which no rule gives the stages: the prefix runs
before a pipeline, on every stage's devices), or `dense_layers_0 .. dense_layers_{k-1}` unrolled;
circular repeats apply to the `layers` stack only.

The *canonical* layout, the one checkpoints store, is the stacked one. `to_canonical` and
`from_canonical` convert any tree that contains layers (parameters, optimizer moments, their
abstract twins) between a run's layout and the canonical one, so checkpoint code never names a layer.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from maxpar.core.axes import Logical
from maxpar.core.config import ModelConfig

STACKED = str(Logical.LAYERS)        # the stacked entry's name (and its leading axis's logical name)
DENSE = str(Logical.DENSE_LAYERS)    # the dense prefix's stacked entry (and its leading axis's logical name)
_UNROLLED = re.compile(rf"({STACKED}|{DENSE})_(\d+)")


def unrolled_name(index: int, stack: str = STACKED) -> str:
    return f"{stack}_{index}"


def num_units(config: ModelConfig) -> int:
    """How many repeated units the `layers` stack holds: its layers (all but the dense prefix), or blocks of
    moe_layer_interval layers."""
    layers = config.num_decoder_layers - config.first_num_dense_layers
    if config.num_experts > 1 and config.moe_layer_interval > 1:
        return layers // config.moe_layer_interval
    return layers


# ---------------------------------------------------------------- circular repeats

def split_repeats(x: Any, repeats: int) -> Any:
    """A circular pipeline's stack: [L, ...] -> [R, L/R, ...] (layer r * L/R + i at [r, i])."""
    return x.reshape(repeats, x.shape[0] // repeats, *x.shape[1:])


def merge_repeats(x: Any) -> Any:
    """[R, L/R, ...] -> [L, ...]: the inverse of `split_repeats`, back to the canonical layer order."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _on_boxed(fn: Callable[[Any], Any], names: Callable[[tuple], tuple]) -> Callable[[Any], Any]:
    """fn applied to an array leaf, or to the value of a logically partitioned (boxed) leaf, renaming its axes."""
    def apply(leaf):
        if isinstance(leaf, nn.LogicallyPartitioned):
            return leaf.replace(value=fn(leaf.value), names=names(tuple(leaf.names)))
        return fn(leaf)
    return apply


def _map_boxed(fn, tree):
    return jax.tree.map(fn, tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def layer_stack(unit: type[nn.Module], length: int, repeats: int = 1, collections: Sequence[str] = (),
                axis: str = STACKED) -> type[nn.Module]:
    """`unit` scanned over a stacked axis of `length` named `axis` (the stacked or circular layout).

    With repeats > 1 the parameters are stored [R, length / R, ...] with a leading `pipeline_repeats`
    axis; the scan sees them reshaped to [length, ...], with the same initial values as the stacked
    layout. `collections` are other variable collections the unit writes, stacked too.
    """
    stack = nn.scan(unit, variable_axes={"params": 0, **{c: 0 for c in collections}}, split_rngs={"params": True},
                    in_axes=(nn.broadcast, nn.broadcast), length=length,
                    metadata_params={nn.PARTITION_NAME: axis})
    if repeats == 1:
        return stack
    split = _on_boxed(lambda x: split_repeats(x, repeats), lambda names: (Logical.REPEATS, *names))
    merge = _on_boxed(merge_repeats, lambda names: names[1:])
    return nn.map_variables(stack, "params", trans_in_fn=lambda tree: _map_boxed(merge, tree),
                            trans_out_fn=lambda tree: _map_boxed(split, tree), init=True, mutable=True)


# ---------------------------------------------------------------- canonical layout (checkpoints)

def _unit(key: Any) -> tuple[str, int] | None:
    """(stack name, index) of an unrolled unit's entry name, else None."""
    return _unit_of_name(str(key))


@functools.lru_cache(maxsize=None)
def _unit_of_name(name: str) -> tuple[str, int] | None:
    match = _UNROLLED.fullmatch(name)
    return (match[1], int(match[2])) if match else None


def in_unrolled_unit(path: Sequence[Any]) -> bool:
    """Whether a tree path (jax key path, or entry names) runs through an unrolled unit's `layers_i` (or
    `dense_layers_i`) entry: the one place outside this module that must tell a per-layer leaf of
    scan_layers=false from the others."""
    return any(_unit(getattr(key, "key", key)) is not None for key in path)


def _is_unrolled(node: Any) -> bool:
    return isinstance(node, Mapping) and any(_unit(key) is not None for key in node)


def _is_stacked(node: Any) -> bool:
    return isinstance(node, Mapping) and (STACKED in node or DENSE in node)


def stack_abstract(leaves: Sequence[jax.ShapeDtypeStruct]) -> jax.ShapeDtypeStruct:
    """Abstract twin of jnp.stack: a new, unsharded leading axis in front of the unit's sharding."""
    first = leaves[0]
    sharding = first.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
    return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype, sharding=sharding)


def _merge_any(leaf: Any) -> Any:
    """merge_repeats of an array, or of an abstract leaf (its layer axis then unsharded)."""
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        return merge_repeats(leaf)
    sharding = leaf.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *tuple(sharding.spec)[2:]))
    return jax.ShapeDtypeStruct((leaf.shape[0] * leaf.shape[1], *leaf.shape[2:]), leaf.dtype, sharding=sharding)


def to_canonical(tree: Any, config: ModelConfig, stack: Callable[[Sequence[Any]], Any] = jnp.stack) -> Any:
    """A tree in `config`'s layer layout -> the canonical (stacked) layout.

    Unrolled `layers_i` (and `dense_layers_i`) entries are stacked with `stack` (`stack_abstract` for
    restore targets); a circular stack [R, L/R, ...] is merged. Applies to every dict in the tree
    (parameters and the optimizer's per-parameter moments alike).
    """
    repeats = config.num_pipeline_repeats

    def convert(node: Any) -> Any:
        if not (_is_unrolled(node) or _is_stacked(node)):
            return node
        out = dict(node)
        if STACKED in node and repeats > 1:
            out[STACKED] = jax.tree.map(_merge_any, node[STACKED])
        unrolled = sorted((_unit(key), key) for key in node if _unit(key) is not None)
        for name in (DENSE, STACKED):
            units = [key for (stack_name, _), key in unrolled if stack_name == name]
            if not units:
                continue
            if [_unit(unit)[1] for unit in units] != list(range(len(units))):
                raise ValueError(f"unrolled layers are not numbered 0..{len(units) - 1}: {units}")
            for unit in units:
                del out[unit]
            out[name] = jax.tree.map(lambda *xs: stack(xs), *[node[unit] for unit in units])
        return out
    return jax.tree.map(convert, tree, is_leaf=lambda node: _is_unrolled(node) or _is_stacked(node))


def from_canonical(tree: Any, config: ModelConfig) -> Any:
    """The inverse of `to_canonical`: a canonical tree in `config`'s layer layout."""
    repeats = config.num_pipeline_repeats

    def convert(node: Any) -> Any:
        if not _is_stacked(node):
            return node
        out = dict(node)
        if config.scan_layers:
            if STACKED in node and repeats > 1:
                out[STACKED] = jax.tree.map(lambda x: split_repeats(x, repeats), node[STACKED])
            return out
        for name, length in ((DENSE, config.first_num_dense_layers), (STACKED, num_units(config))):
            if name in node:
                del out[name]
                out.update({unrolled_name(i, name): jax.tree.map(lambda x, i=i: x[i], node[name])
                            for i in range(length)})
        return out
    return jax.tree.map(convert, tree, is_leaf=_is_stacked)
