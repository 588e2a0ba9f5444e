"""Tests for maxpar.core.sharding and the sharded train state: every parallelism strategy on the 8 CPU devices."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import layout_on
from maxpar.core.axes import ATTN_KV, ATTN_Q, MLP_HIDDEN, RESIDUAL
from maxpar.core.config import ConfigError, load_config, model_config
from maxpar.core.mesh import create_mesh
from maxpar.core.sharding import batch_sharding, shard_count, uneven_split
from maxpar.model import Transformer
from maxpar.model.layers import Mlp
from maxpar.model.transformer import DecoderLayer
from maxpar.training.optimizer import make_optimizer
from maxpar.training.train_step import create_state

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
# The micro model (configs/models/micro.yml) with 64 tokens and rows of 16.
SHORT = ["model_name=micro", "vocab_size=64", "max_target_length=16", "dtype=float32", "weight_dtype=float32"]
FSDP4_TP2 = ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]

STRATEGIES = {
    "dp8": ("base.yml", ["ici_data_parallelism=8", "ici_fsdp_parallelism=1"]),
    "fsdp8": ("base.yml", ["ici_fsdp_parallelism=8"]),
    "fsdp4_tp2": ("base.yml", FSDP4_TP2),
    "dp2_fsdp2_tp2": ("base.yml", ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"]),
    "fsdp_transpose": ("fsdp_transpose.yml", FSDP4_TP2),
    "tp_sequence": ("tp_sequence.yml", FSDP4_TP2),
}

# Tiny model in elements: matrices (embeddings + 2 layers of attention and MLP) and norm scales.
MATRIX_ELEMENTS = 2 * 64 * 64 + 2 * (64 * 4 * 16 * 2 + 64 * 2 * 16 * 2 + 3 * 64 * 128)
NORM_ELEMENTS = 2 * 2 * 64 + 64
# Per-device parameter bytes (float32): matrices split over every non-replicated axis, norms replicated.
PER_DEVICE_BYTES = {
    "dp8": 4 * (MATRIX_ELEMENTS + NORM_ELEMENTS),
    "fsdp8": 4 * (MATRIX_ELEMENTS // 8 + NORM_ELEMENTS),
    "fsdp4_tp2": 4 * (MATRIX_ELEMENTS // 8 + NORM_ELEMENTS),
    "dp2_fsdp2_tp2": 4 * (MATRIX_ELEMENTS // 4 + NORM_ELEMENTS),
    "fsdp_transpose": 4 * (MATRIX_ELEMENTS // 8 + NORM_ELEMENTS),
    "tp_sequence": 4 * (MATRIX_ELEMENTS // 8 + NORM_ELEMENTS),
}


def config_for(preset: str, *overrides: str):
    return load_config([str(CONFIGS / preset), *SHORT, *overrides])


# ---------------------------------------------------------------- an independent resolver

def resolve(names: tuple, rules) -> tuple:
    """Logical names -> mesh axes per dim: rules in priority order; a rule applies only to a still-unassigned
    dim and only if none of its mesh axes is already used by another dim of the same array."""
    result: list = [None] * len(names)
    assigned = [False] * len(names)
    for logical, mesh_axes in rules:
        if logical not in names:
            continue
        pos = names.index(logical)
        used = {axis for entry in result if entry for axis in entry}
        if not assigned[pos] and not used & set(mesh_axes):
            result[pos], assigned[pos] = tuple(mesh_axes), True
    return tuple(entry or None for entry in result)


def normalize(spec, ndim: int) -> tuple:
    """PartitionSpec -> per-dim tuple of mesh axes (None when unsharded), padded to ndim."""
    entries = list(spec) + [None] * (ndim - len(spec))
    out = []
    for entry in entries:
        if entry is None:
            out.append(None)
        elif isinstance(entry, str):
            out.append((entry,))
        else:
            out.append(tuple(entry) or None)
    return tuple(out)


def pieces(entries: tuple, mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for entry in entries if entry for a in entry)


def logical_names(model: nn.Module, config) -> dict[str, tuple]:
    """keystr(path) -> logical axis names of every parameter, read from the model's own annotations."""
    tokens = jnp.zeros((1, config.max_target_length), jnp.int32)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, tokens, tokens))["params"]
    is_boxed = lambda x: isinstance(x, nn.Partitioned)
    leaves = jax.tree_util.tree_leaves_with_path(boxed, is_leaf=is_boxed)
    assert all(is_boxed(leaf) for _, leaf in leaves), "every parameter carries logical axis names"
    return {jax.tree_util.keystr(path): tuple(leaf.names) for path, leaf in leaves}


def by_path(tree) -> dict:
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def adam_states(opt_state) -> list:
    found = [s for s in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
    assert len(found) == 1
    return found


# ---------------------------------------------------------------- each strategy, built once

@pytest.fixture(scope="module", params=list(STRATEGIES))
def built(request):
    preset, overrides = STRATEGIES[request.param]
    config = config_for(preset, *overrides)
    layout, mesh = layout_on(config)
    model, tx = Transformer(model_config(config), layout.model), make_optimizer(config)
    abstract, shardings = layout.state.abstract, layout.state_shardings(mesh)
    if request.param == "fsdp4_tp2":
        state = create_state(model, tx, layout, mesh)  # the default (threefry) PRNG, as in training
    else:
        # Layouts do not depend on the PRNG; the XLA RngBitGenerator compiles in half the time of a
        # partitioned threefry, which keeps this file fast on 2 CPU cores.
        with jax.default_prng_impl("rbg"):
            state = create_state(model, tx, layout, mesh)
    return SimpleNamespace(name=request.param, config=config, mesh=mesh, model=model, abstract=abstract,
                           shardings=shardings, state=state)


def test_param_specs_follow_logical_rules(built):
    names = logical_names(built.model, built.config)
    specs = by_path(built.shardings.params)
    arrays = by_path(built.state.params)
    abstract = by_path(built.abstract.params)
    assert set(names) == set(specs) == set(arrays)
    for path, logical in names.items():
        ndim = len(abstract[path].shape)
        assert len(logical) == ndim, path
        expected = resolve(logical, built.config.axis_rules)
        assert normalize(specs[path].spec, ndim) == expected, (path, logical, specs[path].spec)
        # create_state really produced that layout.
        assert arrays[path].shape == abstract[path].shape and arrays[path].dtype == abstract[path].dtype
        assert normalize(arrays[path].sharding.spec, ndim) == expected, (path, arrays[path].sharding)
        assert shard_count(specs[path]) == pieces(expected, built.mesh)


def test_per_device_parameter_bytes(built):
    arrays = by_path(built.state.params)
    names = logical_names(built.model, built.config)
    per_device = {d: 0 for d in built.mesh.devices.flat}
    for path, array in arrays.items():
        count = pieces(resolve(names[path], built.config.axis_rules), built.mesh)
        assert array.nbytes % count == 0
        assert len({tuple((s.start, s.stop) for s in shard.index) for shard in array.addressable_shards}) == count
        for shard in array.addressable_shards:
            assert shard.data.nbytes == array.nbytes // count, (path, shard.device)
            per_device[shard.device] += shard.data.nbytes
    assert set(per_device.values()) == {PER_DEVICE_BYTES[built.name]}
    total = sum(a.nbytes for a in arrays.values())
    assert total == 4 * (MATRIX_ELEMENTS + NORM_ELEMENTS)


def test_optimizer_state_sharded_like_params(built):
    params = by_path(built.state.params)
    (adam,) = adam_states(built.state.opt_state)
    (adam_shardings,) = adam_states(built.shardings.opt_state)
    for moments, moment_shardings in ((adam.mu, adam_shardings.mu), (adam.nu, adam_shardings.nu)):
        arrays, shardings = by_path(moments), by_path(moment_shardings)
        assert set(arrays) == set(params)
        for path, param in params.items():
            ndim = param.ndim
            assert normalize(shardings[path].spec, ndim) == normalize(param.sharding.spec, ndim), path
            assert normalize(arrays[path].sharding.spec, ndim) == normalize(param.sharding.spec, ndim), path
            assert arrays[path].addressable_shards[0].data.nbytes == param.addressable_shards[0].data.nbytes
    assert normalize(adam.count.sharding.spec, 0) == ()  # the step counter is a replicated scalar


def test_batch_input_sharding(built):
    mesh, config = built.mesh, built.config
    sharding = batch_sharding(mesh, config.axis_rules)
    spec = normalize(sharding.spec, 2)
    assert spec[0] == ("data", "fsdp", "expert", "stage")  # outside a pipeline loop its stages split the batch
    assert spec == resolve(("activation_batch", "activation_length"), config.axis_rules)
    blocks = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
    length_pieces = pieces(spec[1:], mesh)
    rows, length = 2 * blocks, config.max_target_length
    batch = jax.device_put(np.arange(rows * length, dtype=np.int32).reshape(rows, length), sharding)
    for shard in batch.addressable_shards:
        coords = dict(zip(mesh.axis_names, np.argwhere(mesh.devices == shard.device)[0]))
        block = (coords["data"] * mesh.shape["fsdp"] + coords["fsdp"]) * mesh.shape["expert"] + coords["expert"]
        assert shard.index[0] == slice(2 * block, 2 * block + 2), (shard.device, coords, shard.index)
        assert shard.data.shape == (2, length // length_pieces)


# ---------------------------------------------------------------- hand-written expectations

LAYER = "['decoder']['layers']"


def test_logical_names_of_the_model():
    config = config_for("base.yml")
    names = logical_names(Transformer(model_config(config)), config)
    assert names[f"{LAYER}['mlp']['wi_gate']"] == ("layers", "mlp_embed", "mlp")  # embed, named apart for TP-transpose
    assert names[f"{LAYER}['mlp']['wo']"] == ("layers", "mlp", "mlp_embed")
    assert names[f"{LAYER}['attention']['query']"] == ("layers", "embed", "heads", "head_dim")
    assert names[f"{LAYER}['attention']['key']"] == ("layers", "embed", "kv_heads", "head_dim")
    assert names[f"{LAYER}['attention']['out']"] == ("layers", "heads", "head_dim", "embed")
    assert names["['token_embedding']"] == ("vocab", "embed")
    assert names["['output']"] == ("embed", "vocab")
    assert names["['final_norm']['scale']"] == ("norm",)


FE = ("fsdp", "context", "expert")  # embed: FSDP-like axes (context: weights sharded like FSDP under CP)
HAND_SPECS = {
    "fsdp4_tp2": {
        f"{LAYER}['mlp']['wi_gate']": P("stage", FE, "tensor"),
        f"{LAYER}['mlp']['wo']": P("stage", "tensor", FE),
        f"{LAYER}['attention']['query']": P("stage", FE, "tensor", None),
        f"{LAYER}['attention']['key']": P("stage", FE, "tensor", None),
        f"{LAYER}['attention']['out']": P("stage", "tensor", None, FE),
        f"{LAYER}['pre_mlp_norm']['scale']": P("stage", None),
        "['token_embedding']": P("tensor", FE),
        "['output']": P(FE, "tensor"),
        "['final_norm']['scale']": P(None),
    },
    "fsdp_transpose": {
        f"{LAYER}['mlp']['wi_gate']": P("stage", None, ("tensor", "fsdp")),
        f"{LAYER}['mlp']['wi_up']": P("stage", None, ("tensor", "fsdp")),
        f"{LAYER}['mlp']['wo']": P("stage", ("tensor", "fsdp"), None),
        f"{LAYER}['attention']['query']": P("stage", FE, "tensor", None),
        "['token_embedding']": P("tensor", FE),
    },
    "tp_sequence": {  # weights as in fsdp4_tp2: the preset only moves activations
        f"{LAYER}['mlp']['wi_gate']": P("stage", FE, "tensor"),
        f"{LAYER}['attention']['out']": P("stage", "tensor", None, FE),
    },
    "fsdp8": {
        f"{LAYER}['mlp']['wi_gate']": P("stage", FE, "tensor"),
        "['output']": P(FE, "tensor"),
    },
    # Axes of size 1 stay in the specs; they cost nothing and keep one spec per rule set.
    "dp8": {
        f"{LAYER}['mlp']['wi_gate']": P("stage", FE, "tensor"),
        "['token_embedding']": P("tensor", FE),
    },
    "dp2_fsdp2_tp2": {
        f"{LAYER}['mlp']['wo']": P("stage", "tensor", FE),
        f"{LAYER}['attention']['value']": P("stage", FE, "tensor", None),
    },
}


def test_hand_written_specs(built):
    specs = by_path(built.shardings.params)
    arrays = by_path(built.state.params)
    for path, spec in HAND_SPECS[built.name].items():
        ndim = arrays[path].ndim
        assert normalize(specs[path].spec, ndim) == normalize(spec, ndim), (path, specs[path].spec)
        assert normalize(arrays[path].sharding.spec, ndim) == normalize(spec, ndim), path


def test_hand_written_shard_shapes(built):
    """Concrete per-device shapes of the MLP gate kernel (2, 64, 128) under each strategy."""
    expected = {"dp8": (2, 64, 128), "fsdp8": (2, 8, 128), "fsdp4_tp2": (2, 16, 64), "dp2_fsdp2_tp2": (2, 32, 64),
                "fsdp_transpose": (2, 64, 16), "tp_sequence": (2, 16, 64)}[built.name]
    gate = built.state.params["decoder"]["layers"]["mlp"]["wi_gate"]
    assert {shard.data.shape for shard in gate.addressable_shards} == {expected}


def test_unscanned_layers_have_no_stage_axis():
    config = config_for("base.yml", *FSDP4_TP2, "scan_layers=false")
    abstract, shardings = _state_shardings(config)
    gate = shardings.params["decoder"]["layers_1"]["mlp"]["wi_gate"]
    assert normalize(gate.spec, 2) == (FE, ("tensor",))
    assert abstract.params["decoder"]["layers_1"]["mlp"]["wi_gate"].shape == (64, 128)


def test_tied_embedding_has_no_output_param():
    config = config_for("base.yml", *FSDP4_TP2, "logits_via_embedding=true")
    abstract, shardings = _state_shardings(config)
    assert "output" not in shardings.params
    assert normalize(shardings.params["token_embedding"].spec, 2) == (("tensor",), FE)


def test_rules_are_data_not_code():
    """A rule given on the command line changes the layout: replicate everything but the vocab."""
    config = config_for("base.yml", *FSDP4_TP2, "logical_axis_rules=[[vocab,[fsdp,tensor]]]")
    _, shardings = _state_shardings(config)
    assert normalize(shardings.params["token_embedding"].spec, 2) == (("fsdp", "tensor"), None)
    assert normalize(shardings.params["decoder"]["layers"]["mlp"]["wi_gate"].spec, 3) == (None, None, None)


# ---------------------------------------------------------------- uneven splits

def _state_shardings(config):
    """(abstract train state, its NamedShardings on the 8 devices) from the run layout."""
    layout, mesh = layout_on(config)
    return layout.state.abstract, layout.state_shardings(mesh)


def _shardings_error(preset: str, *overrides: str) -> str:
    config = config_for(preset, *overrides)
    with pytest.raises(ConfigError) as info:
        _state_shardings(config)
    return str(info.value)


def test_kv_heads_not_divisible_by_tensor():
    message = _shardings_error("base.yml", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=4")
    assert "['attention']['key']" in message and "(2, 64, 2, 16)" in message
    assert "tensor" in message and "4" in message


def test_vocab_not_divisible_by_tensor():
    message = _shardings_error("base.yml", *FSDP4_TP2, "vocab_size=63")
    assert "['output']" in message and "63" in message


def test_embed_not_divisible_by_fsdp():
    message = _shardings_error("base.yml", "ici_fsdp_parallelism=8", "emb_dim=68")
    assert "parameter" in message and "68" in message and "fsdp" in message


def test_divisibility_depends_on_the_rules():
    # mlp_dim=132 splits over tensor=2 but not over fsdp*tensor=8 (fsdp_transpose).
    _state_shardings(config_for("base.yml", *FSDP4_TP2, "mlp_dim=132"))
    message = _shardings_error("fsdp_transpose.yml", *FSDP4_TP2, "mlp_dim=132")
    assert "['mlp']['wi_gate']" in message and "132" in message


def test_uneven_split_names_the_first_offender():
    mesh = create_mesh(config_for("base.yml", *FSDP4_TP2))
    tree = {"a": jax.ShapeDtypeStruct((8, 6), jnp.float32), "b": jax.ShapeDtypeStruct((6, 4), jnp.float32)}
    fine = {"a": NamedSharding(mesh, P("fsdp", "tensor")), "b": NamedSharding(mesh, P(None, ("fsdp",)))}
    assert uneven_split(tree, fine) is None
    bad = {"a": NamedSharding(mesh, P("fsdp", "tensor")), "b": NamedSharding(mesh, P(("fsdp", "tensor")))}
    split = uneven_split(tree, bad)
    assert "['b']" in split.name and split.shape == (6, 4) and split.dim == 0 and split.degree == 8


@pytest.mark.parametrize("preset, overrides, gathered", [
    ("base.yml", ["ici_fsdp_parallelism=8"], False),                               # FSDP: lookup on embed shards
    ("base.yml", ["ici_data_parallelism=2", "ici_fsdp_parallelism=4"], False),
    ("base.yml", FSDP4_TP2, True),                                                 # vocab split over tensor
    ("base.yml", ["ici_context_parallelism=4", "ici_fsdp_parallelism=2", "attention=blockwise"], True),  # context
    ("base.yml", ["ici_fsdp_parallelism=2", "ici_stage_parallelism=4", "num_decoder_layers=4"], True),  # pipeline
])
def test_the_token_lookup_gathers_the_table_unless_its_embed_shards_split_the_batch(preset, overrides, gathered):
    layout, _ = layout_on(config_for(preset, *overrides))
    assert layout.model.gather_lookup_table is gathered


# ---------------------------------------------------------------- TP-sequence really shards activations on length

def test_tp_sequence_rules_move_length_to_tensor():
    base = config_for("base.yml", *FSDP4_TP2).axis_rules
    seq = config_for("tp_sequence.yml", *FSDP4_TP2).axis_rules
    batch = ("data", "fsdp", "expert", "stage")
    # The sequence is split over `context` (degree 1 here) by default; TP-sequence's residual takes tensor first.
    ctx = ("context",)
    assert normalize(nn.logical_to_mesh_axes(RESIDUAL, list(base)), 3) == (batch, ctx, None)
    assert normalize(nn.logical_to_mesh_axes(RESIDUAL, list(seq)), 3) == (batch, ("tensor",), None)
    assert normalize(nn.logical_to_mesh_axes(MLP_HIDDEN, list(base)), 3) == (batch, ctx, ("tensor",))
    assert normalize(nn.logical_to_mesh_axes(MLP_HIDDEN, list(seq)), 3) == (batch, ctx, ("tensor",))
    # Attention stays head-sharded.
    for rules in (base, seq):
        assert normalize(nn.logical_to_mesh_axes(ATTN_Q, list(rules)), 4) == (batch, ctx, ("tensor",), None)
        assert normalize(nn.logical_to_mesh_axes(ATTN_KV, list(rules)), 4) == (batch, ctx, ("tensor",), None)


CONSTRAINT = re.compile(r"sdy\.sharding_constraint[^<]*<@\w+, \[(.*?)\]>\s*:\s*tensor<((?:\d+x)+)\w+>")


def _constraints(preset: str) -> dict[tuple[int, ...], set[tuple[frozenset, ...]]]:
    """Shape -> the per-dim mesh axes of every sharding constraint in the lowered decoder layer."""
    config = config_for(preset, *FSDP4_TP2)
    layer = DecoderLayer(model_config(config), layout_on(config)[0].model)  # its layout names the mesh and rules
    x = jax.ShapeDtypeStruct((4, 16, 64), jnp.float32)
    ids = jax.ShapeDtypeStruct((4, 16), jnp.int32)
    params = jax.eval_shape(lambda: nn.unbox(layer.init(jax.random.key(0), jnp.zeros(x.shape), jnp.zeros(
        ids.shape, jnp.int32), jnp.ones(ids.shape, jnp.int32))))
    text = jax.jit(layer.apply).lower(params, x, ids, ids).as_text()
    found: dict = {}
    for dims, shape in CONSTRAINT.findall(text):
        key = tuple(int(n) for n in shape.rstrip("x").split("x"))
        per_dim = tuple(frozenset(re.findall(r'"(\w+)"', d)) for d in re.findall(r"\{([^}]*)\}", dims))
        found.setdefault(key, set()).add(per_dim)
    assert found, "no sharding constraints found in the lowered text"
    return found


def test_tp_sequence_lowered_constraints_split_length():
    batch = frozenset({"data", "fsdp", "expert", "stage"})
    none, tensor, ctx = frozenset(), frozenset({"tensor"}), frozenset({"context"})  # context: degree 1 here
    base, seq = _constraints("base.yml"), _constraints("tp_sequence.yml")
    # Residual stream [4, 16, 64] splits on sequence; the MLP hidden [4, 16, 128] stays split on mlp (the seed's
    # tensor-sequence layout: all-gather the FF input over sequence, reduce-scatter its output back).
    assert base[(4, 16, 64)] == {(batch, ctx, none)}
    assert seq[(4, 16, 64)] == {(batch, tensor, none)}
    assert base[(4, 16, 128)] == seq[(4, 16, 128)] == {(batch, ctx, tensor)}
    # Query heads [4, 16, 4, 16] stay split over tensor on heads in both.
    assert base[(4, 16, 4, 16)] == seq[(4, 16, 4, 16)] == {(batch, ctx, tensor, none)}


@pytest.mark.parametrize("preset, local_shape", [("base.yml", (1, 16, 64)), ("tp_sequence.yml", (1, 8, 64))])
def test_tp_sequence_compiled_mlp_output_is_split_on_length(preset, local_shape):
    config = config_for(preset, *FSDP4_TP2)
    layout, mesh = layout_on(config)
    mlp = Mlp(model_config(config), layout.model)
    x = jax.ShapeDtypeStruct((4, 16, 64), jnp.float32, sharding=NamedSharding(mesh, P()))
    params = jax.eval_shape(lambda: nn.unbox(mlp.init(jax.random.key(0), jnp.zeros(x.shape))))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), params)
    compiled = jax.jit(mlp.apply).lower(params, x).compile()
    assert compiled.output_shardings.shard_shape(x.shape) == local_shape


def test_zero_axis_joins_the_first_dimension_it_divides():
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
    from maxpar.core.sharding import with_zero_axis
    mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
    def spec(shape, *entries):
        return with_zero_axis(shape, NamedSharding(mesh, P(*entries))).spec
    assert spec((64, 128), "fsdp", "tensor") == P(("fsdp", "data"), "tensor")  # a piece of each fsdp shard
    assert spec((2, 128), "fsdp", "tensor") == P("fsdp", ("tensor", "data"))     # 2 / (2 x 2): next dimension
    assert spec((3, 5), None, None) == P(None, None)                             # nothing divides: as it was
    assert spec((), ) == P()
    assert spec((8,), "data") == P("data")                                       # data already splits it


def test_an_uneven_split_names_the_model_key_behind_the_dimension():
    """The logical axis of the dimension that does not split tells which key to change (issue 43)."""
    assert _shardings_error("base.yml", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=4").startswith(
        "num_kv_heads=2 cannot be split 4 ways: parameter .params['decoder']['layers']['attention']['key']")
    assert "vocab_size=63 cannot be split 2 ways" in _shardings_error("base.yml", *FSDP4_TP2, "vocab_size=63")
    message = _shardings_error("base.yml", "ici_fsdp_parallelism=8", "emb_dim=68")
    assert message.startswith("emb_dim=68 cannot be split 8 ways") and "or another emb_dim" in message
