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
    ADAPTERS = "adapters"  # LoRA's low-rank factors beside the projections they adapt (lora_rank > 0)


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
    LORA_A = "lora_a"                       # LoRA: x's projection onto the adapter's rank (lora_rank), beside its
    LORA_B = "lora_b"                       # target weight; then the rank back to the target's output
                                            # (`adapter_of` names the target; their axes follow from its)

    @property
    def block(self) -> Block:
        return _DECLARED[self].block

    @property
    def axes(self) -> tuple[str | None, ...]:
        """The logical axes of one layer's parameter (an adapter's: `declared_axes`, from its target's)."""
        return _DECLARED[self].axes

    @property
    def projection(self) -> Projection | None:
        """How a weight this role names splits into x's dims and the output's (None: not a projection's weight).
        Muon reads it to see the matrix; LoRA adapts the projections in `ADAPTABLE`."""
        return _DECLARED[self].projection


@dataclasses.dataclass(frozen=True)
class Projection:
    """A projection weight's dims, in order: `batch` leading dims each input row picks one of (the experts), then
    `inputs` dims contracted with x, then the output's. A LoRA adapter of it is A [batch, inputs, rank] and
    B [batch, rank, outputs]."""

    batch: int
    inputs: int


@dataclasses.dataclass(frozen=True)
class _Declaration:
    block: Block
    axes: tuple[str | None, ...]
    names: tuple[tuple[str, str], ...]      # (enclosing module's name, parameter's name); "" = the model itself
    projection: Projection | None = None    # a projection's weight: `ParamRole.projection`
    adaptable: bool = True                  # a projection LoRA may adapt (`lora_target_roles`)


_L = Logical
_IN1, _IN2, _EXPERT = Projection(0, 1), Projection(0, 2), Projection(1, 1)
_DECLARED = {
    ParamRole.QUERY: _Declaration(Block.ATTENTION, (_L.EMBED, _L.HEADS, _L.HEAD_DIM), (("attention", "query"),),
                                  _IN1),
    ParamRole.KEY: _Declaration(Block.ATTENTION, (_L.EMBED, _L.KV_HEADS, _L.HEAD_DIM), (("attention", "key"),),
                                _IN1),
    ParamRole.VALUE: _Declaration(Block.ATTENTION, (_L.EMBED, _L.KV_HEADS, _L.HEAD_DIM), (("attention", "value"),),
                                  _IN1),
    ParamRole.ATTENTION_OUT: _Declaration(Block.ATTENTION, (_L.HEADS, _L.HEAD_DIM, _L.EMBED),
                                          (("attention", "out"),), _IN2),
    ParamRole.MLP_GATE: _Declaration(Block.MLP, (_L.MLP_EMBED, _L.MLP), (("mlp", "wi_gate"),), _IN1),
    ParamRole.MLP_UP: _Declaration(Block.MLP, (_L.MLP_EMBED, _L.MLP), (("mlp", "wi_up"),), _IN1),
    ParamRole.MLP_DOWN: _Declaration(Block.MLP, (_L.MLP, _L.MLP_EMBED), (("mlp", "wo"),), _IN1),
    ParamRole.ROUTER: _Declaration(Block.MLP, (_L.EMBED, None), (("moe", "router"),), _IN1, adaptable=False),
    ParamRole.EXPERT_GATE: _Declaration(Block.EXPERTS, (_L.EXP, _L.EMBED, _L.MLP), (("moe", "wi_gate"),), _EXPERT),
    ParamRole.EXPERT_UP: _Declaration(Block.EXPERTS, (_L.EXP, _L.EMBED, _L.MLP), (("moe", "wi_up"),), _EXPERT),
    ParamRole.EXPERT_DOWN: _Declaration(Block.EXPERTS, (_L.EXP, _L.MLP, _L.EMBED), (("moe", "wo"),), _EXPERT),
    ParamRole.EMBEDDING: _Declaration(Block.EMBEDDING, (_L.VOCAB, _L.EMBED), (("", "token_embedding"),)),
    ParamRole.OUTPUT: _Declaration(Block.OUTPUT, (_L.EMBED, _L.VOCAB), (("", "output"),), _IN1, adaptable=False),
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
    ParamRole.MTP_PROJECTION: _Declaration(Block.MLP, (None, _L.EMBED), (("projection", "kernel"),), _IN1,
                                           adaptable=False),
    # named `{target}_lora_a` / `{target}_lora_b` beside their target: `adapter_of`
    ParamRole.LORA_A: _Declaration(Block.ADAPTERS, (), ()),
    ParamRole.LORA_B: _Declaration(Block.ADAPTERS, (), ()),
}
_BY_NAME = {name: role for role, declared in _DECLARED.items() for name in declared.names}
ADAPTABLE = tuple(role for role, declared in _DECLARED.items()  # lora_target_roles' choices
                  if declared.projection and declared.adaptable)
_FACTORS = {"_lora_a": ParamRole.LORA_A, "_lora_b": ParamRole.LORA_B}


def adapter_name(target: str, factor: ParamRole) -> str:
    """The parameter name of LoRA factor `factor` (LORA_A or LORA_B) of the weight named `target`."""
    return f"{target}_{factor.value}"


def adapter_of(path: Sequence[str]) -> tuple[ParamRole, ParamRole] | None:
    """(LORA_A or LORA_B, the role of the weight it adapts) for an adapter's path, else None."""
    if not path:
        return None
    for suffix, factor in _FACTORS.items():
        if path[-1].endswith(suffix):
            target = param_role((*path[:-1], path[-1].removesuffix(suffix)))
            return (factor, target) if target in ADAPTABLE else None
    return None


def adapter_axes(target: ParamRole, factor: ParamRole) -> tuple[str | None, ...]:
    """One layer's logical axes of an adapter factor of `target`: A [batch, inputs, adapter], B [batch, adapter,
    outputs] in the target's own names (`Projection`)."""
    axes, split = target.axes, target.projection
    lead = axes[:split.batch]
    if factor is ParamRole.LORA_A:
        return (*lead, *axes[split.batch:split.batch + split.inputs], Logical.ADAPTER)
    return (*lead, Logical.ADAPTER, *axes[split.batch + split.inputs:])


def param_role(path: Sequence[str]) -> ParamRole | None:
    """The role of the parameter at `path` (its keys in the model's parameter tree), None if undeclared."""
    adapter = adapter_of(path)
    if adapter:
        return adapter[0]
    parent = path[-2] if len(path) > 1 else ""
    return _BY_NAME.get((parent, path[-1])) if path else None


def declared_axes(path: Sequence[str]) -> tuple[str | None, ...] | None:
    """The logical axes one layer's parameter at `path` is declared with (an adapter's from its target's), None if
    undeclared."""
    adapter = adapter_of(path)
    if adapter:
        return adapter_axes(adapter[1], adapter[0])
    role = param_role(path)
    return role.axes if role else None


def path_keys(key_path: Sequence[Any]) -> tuple[str, ...]:
    """The keys of a parameter tree's key path as `jax.tree_util.tree_leaves_with_path` gives it, for
    `param_role`."""
    return tuple(str(getattr(key, "key", key)) for key in key_path)
