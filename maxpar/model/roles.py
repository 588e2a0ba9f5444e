"""What each parameter of the model is for: its role, the block it belongs to and its logical axes.

This is the contract between the model and whoever reasons about its parameters from outside (the
planner, `maxpar.plan`; the optimizer, which orthogonalizes the projections' matrices with Muon): they ask
`param_role(path)` and read roles, never parameter paths. A parameter is named here by its module's name and its
own, as `maxpar.model.layers`, `maxpar.model.moe` and `maxpar.model.transformer` create them; the logical axes are
those of one layer's parameter (a layer stack adds its `layers` / `pipeline_repeats` dims in front), and a
projection's weight says which of them are its matrix's rows (`Matrix`). A new parameter is declared here, or the
planner refuses the model.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

from maxpar.core.axes import Logical


class Block(enum.StrEnum):
    """The part of the model a parameter belongs to. The router counts with the MLPs (an ordinary weight);
    the experts are split over their own axis and moved by the MoE dispatch."""

    ATTENTION = "attention"
    MLP = "mlp"
    EXPERTS = "experts"
    NORM = "norm"
    EMBEDDING = "embedding"
    OUTPUT = "output"


class ParamRole(enum.StrEnum):
    """The job of one parameter in the model."""

    QUERY = "query"
    KEY = "key"
    VALUE = "value"
    ATTENTION_OUT = "attention_out"
    MLP_GATE = "mlp_gate"
    MLP_UP = "mlp_up"
    MLP_DOWN = "mlp_down"
    ROUTER = "router"
    EXPERT_GATE = "expert_gate"
    EXPERT_UP = "expert_up"
    EXPERT_DOWN = "expert_down"
    EMBEDDING = "embedding"                 # the token table (also the output projection with logits_via_embedding)
    OUTPUT = "output"                       # the output projection to the vocabulary
    NORM = "norm"                           # an RMSNorm scale
    QK_NORM = "qk_norm"                     # the RMSNorm scale of each query/key head (qk_norm: Qwen3)
    QUERY_A = "query_a"                     # MLA: x -> the query's low rank (q_lora_rank > 0)
    QUERY_B = "query_b"                     # MLA: the query's low rank -> each head's [nope | rope]
    KEY_VALUE_A = "key_value_a"             # MLA: x -> [latent | shared k_rope]
    KEY_VALUE_B = "key_value_b"             # MLA: the latent -> each head's [k_nope | v]
    LATENT_NORM = "latent_norm"             # MLA: the RMSNorm scale of the query's low rank or the kv latent
    SHARED_GATE = "shared_gate"             # MoE shared experts (num_shared_experts): a dense SwiGLU every token uses
    SHARED_UP = "shared_up"
    SHARED_DOWN = "shared_down"
    ROUTING_BIAS = "routing_bias"           # routed_bias: per-expert choice bias, moved by the train step, not the
                                            # optimizer (maxpar.training.optimizer.trained_mask)
    MTP_PROJECTION = "mtp_projection"       # multi-token prediction: [norm(embedding); norm(hidden)] -> embed

    @property
    def block(self) -> Block:
        return _DECLARED[self].block

    @property
    def axes(self) -> tuple[str | None, ...]:
        """The logical axes of one layer's parameter."""
        return _DECLARED[self].axes

    @property
    def matrix(self) -> Matrix | None:
        """How the parameter is the matrix of a projection x @ W (None: not a projection's weight)."""
        return _DECLARED[self].matrix


@dataclasses.dataclass(frozen=True)
class Matrix:
    """A projection's weight as the matrix it multiplies by: of one layer's parameter, the first `batch` dims index
    independent matrices (the experts), the next `fan_in` dims are contracted with the input (the matrix's rows,
    flattened), the rest are the output (its columns). E.g. the query [embed, heads, head_dim] is one
    [embed, heads x head_dim] matrix; an expert's gate [experts, embed, mlp] is `experts` [embed, mlp] matrices."""

    fan_in: int
    batch: int = 0


@dataclasses.dataclass(frozen=True)
class _Declaration:
    block: Block
    axes: tuple[str | None, ...]
    names: tuple[tuple[str, str], ...]      # (enclosing module's name, parameter's name); "" = the model itself
    matrix: Matrix | None = None            # a projection's weight: `ParamRole.matrix`


_L = Logical
_IN1, _IN2, _EXPERTS = Matrix(fan_in=1), Matrix(fan_in=2), Matrix(fan_in=1, batch=1)
_DECLARED = {
    ParamRole.QUERY: _Declaration(Block.ATTENTION, (_L.EMBED, _L.HEADS, _L.HEAD_DIM), (("attention", "query"),), _IN1),
    ParamRole.KEY: _Declaration(Block.ATTENTION, (_L.EMBED, _L.KV_HEADS, _L.HEAD_DIM), (("attention", "key"),), _IN1),
    ParamRole.VALUE: _Declaration(Block.ATTENTION, (_L.EMBED, _L.KV_HEADS, _L.HEAD_DIM), (("attention", "value"),),
                                  _IN1),
    ParamRole.ATTENTION_OUT: _Declaration(Block.ATTENTION, (_L.HEADS, _L.HEAD_DIM, _L.EMBED), (("attention", "out"),),
                                          _IN2),
    ParamRole.MLP_GATE: _Declaration(Block.MLP, (_L.MLP_EMBED, _L.MLP), (("mlp", "wi_gate"),), _IN1),
    ParamRole.MLP_UP: _Declaration(Block.MLP, (_L.MLP_EMBED, _L.MLP), (("mlp", "wi_up"),), _IN1),
    ParamRole.MLP_DOWN: _Declaration(Block.MLP, (_L.MLP, _L.MLP_EMBED), (("mlp", "wo"),), _IN1),
    ParamRole.ROUTER: _Declaration(Block.MLP, (_L.EMBED, None), (("moe", "router"),), _IN1),
    ParamRole.EXPERT_GATE: _Declaration(Block.EXPERTS, (_L.EXP, _L.EMBED, _L.MLP), (("moe", "wi_gate"),), _EXPERTS),
    ParamRole.EXPERT_UP: _Declaration(Block.EXPERTS, (_L.EXP, _L.EMBED, _L.MLP), (("moe", "wi_up"),), _EXPERTS),
    ParamRole.EXPERT_DOWN: _Declaration(Block.EXPERTS, (_L.EXP, _L.MLP, _L.EMBED), (("moe", "wo"),), _EXPERTS),
    ParamRole.EMBEDDING: _Declaration(Block.EMBEDDING, (_L.VOCAB, _L.EMBED), (("", "token_embedding"),)),
    ParamRole.OUTPUT: _Declaration(Block.OUTPUT, (_L.EMBED, _L.VOCAB), (("", "output"),), _IN1),
    ParamRole.NORM: _Declaration(Block.NORM, (_L.NORM,), (("pre_attention_norm", "scale"), ("pre_mlp_norm", "scale"),
                                                         ("final_norm", "scale"), ("embedding_norm", "scale"),
                                                         ("hidden_norm", "scale"), ("head_norm", "scale"))),
    ParamRole.QK_NORM: _Declaration(Block.NORM, (_L.HEAD_DIM,), (("query_norm", "scale"), ("key_norm", "scale"))),
    ParamRole.QUERY_A: _Declaration(Block.ATTENTION, (_L.EMBED, _L.LORA), (("attention", "query_a"),), _IN1),
    ParamRole.QUERY_B: _Declaration(Block.ATTENTION, (_L.LORA, _L.HEADS, _L.HEAD_DIM), (("attention", "query_b"),),
                                    _IN1),
    ParamRole.KEY_VALUE_A: _Declaration(Block.ATTENTION, (_L.EMBED, _L.LORA), (("attention", "key_value_a"),), _IN1),
    ParamRole.KEY_VALUE_B: _Declaration(Block.ATTENTION, (_L.LORA, _L.HEADS, _L.HEAD_DIM),
                                        (("attention", "key_value_b"),), _IN1),
    ParamRole.SHARED_GATE: _Declaration(Block.MLP, (_L.MLP_EMBED, _L.MLP), (("shared_experts", "wi_gate"),), _IN1),
    ParamRole.SHARED_UP: _Declaration(Block.MLP, (_L.MLP_EMBED, _L.MLP), (("shared_experts", "wi_up"),), _IN1),
    ParamRole.SHARED_DOWN: _Declaration(Block.MLP, (_L.MLP, _L.MLP_EMBED), (("shared_experts", "wo"),), _IN1),
    ParamRole.ROUTING_BIAS: _Declaration(Block.MLP, (None,), (("moe", "routing_bias"),)),
    ParamRole.LATENT_NORM: _Declaration(Block.NORM, (_L.LORA,), (("query_a_norm", "scale"),
                                                                 ("key_value_a_norm", "scale"))),
    ParamRole.MTP_PROJECTION: _Declaration(Block.MLP, (None, _L.EMBED), (("projection", "kernel"),), _IN1),
}
_BY_NAME = {name: role for role, declared in _DECLARED.items() for name in declared.names}


def param_role(path: Sequence[str]) -> ParamRole | None:
    """The role of the parameter at `path` (its keys in the model's parameter tree), None if undeclared."""
    parent = path[-2] if len(path) > 1 else ""
    return _BY_NAME.get((parent, path[-1])) if path else None


def path_keys(key_path: Sequence[Any]) -> tuple[str, ...]:
    """The keys of a parameter tree's key path as `jax.tree_util.tree_leaves_with_path` gives it, for
    `param_role`."""
    return tuple(str(getattr(key, "key", key)) for key in key_path)
