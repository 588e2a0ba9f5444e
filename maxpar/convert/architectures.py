"""What each supported Hugging Face architecture is in maxpar terms: two tables per architecture.

`ConfigKey`s say which maxpar config key comes from which config.json key; `TensorRule`s say
which maxpar parameter (canonical layout: layers stacked on a leading axis) is made of which
Hugging Face tensors, and how. Supporting another architecture of the same family means adding
rows here: Mixtral adds its expert-count keys and rules for `decoder/layers/moe/*` whose HF
names carry `{expert}` as well as `{layer}` (stacked=("layer", "expert")).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

REQUIRED = object()  # ConfigKey default: config.json must have the key


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """maxpar key `key` <- config.json `hf_key` (`default` when absent or null; a callable default sees the
    whole config.json). `hf_key=None`: the architecture fixes the value (`default`) and config.json has no say."""

    key: str
    hf_key: str | None
    default: Any = REQUIRED
    from_hf: Callable[[Any], Any] = lambda value: value
    to_hf: Callable[[Any], Any] = lambda value: value


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """One maxpar parameter and the Hugging Face tensors it is made of.

    `stacked` names the leading maxpar axes that enumerate HF tensors (their indices fill the
    `{layer}`/`{expert}` fields of `hf_name`). The rest of the maxpar shape is one HF tensor:
    `inputs=None` is the same array; `inputs=n` is an `nn.Linear` weight [out, in] whose input is
    the first n remaining maxpar dims and whose output is the others (flattened, row-major), so
    q_proj [heads*head_dim, embed] is maxpar's query [embed, heads, head_dim].
    """

    path: str
    hf_name: str
    stacked: tuple[str, ...] = ()
    inputs: int | None = None
    # HF layer of stacked index i: i * layer_stride + layer_offset. Interleaved layers (moe_layer_interval=k > 1)
    # stack blocks of k: `decoder/layers/sublayer_j/...` holds HF layers j, k + j, 2k + j, ... (`tensor_rules`).
    layer_stride: int = 1
    layer_offset: int = 0
    # The last maxpar axis ends in RoPE features that HF stores as interleaved pairs (DeepSeek's rope_interleave):
    # `tensor_rules` turns it into `order`, maxpar's index i of that axis holding HF's index order[i].
    rope_tail: bool = False
    order: tuple[int, ...] | None = None
    float32: bool = False  # written in float32 whatever the export dtype (transformers keeps it so: DeepSeek's router)

    def hf_shape(self, leaf_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of one HF tensor of a maxpar leaf of `leaf_shape`."""
        own = tuple(leaf_shape[len(self.stacked):])
        if self.inputs is None:
            return own
        return math.prod(own[self.inputs:]), math.prod(own[:self.inputs])

    def hf_name_at(self, index: Sequence[int]) -> str:
        """The HF name of the tensor at stacked index `index` (e.g. (layer,))."""
        fields = dict(zip(self.stacked, index))
        if "layer" in fields:
            fields["layer"] = fields["layer"] * self.layer_stride + self.layer_offset
        return self.hf_name.format(**fields)

    def hf_names(self, leaf_shape: Sequence[int]) -> list[tuple[tuple[int, ...], str]]:
        """(stacked index, HF name) of every HF tensor of the leaf, outer axes first."""
        indices = itertools.product(*(range(n) for n in leaf_shape[:len(self.stacked)]))
        return [(index, self.hf_name_at(index)) for index in indices]


# ---------------------------------------------------------------- Llama family (dense, GQA)

LLAMA_KEYS = (
    ConfigKey("emb_dim", "hidden_size"),
    ConfigKey("num_query_heads", "num_attention_heads"),
    ConfigKey("num_kv_heads", "num_key_value_heads", default=lambda hf: hf["num_attention_heads"]),
    ConfigKey("head_dim", "head_dim", default=lambda hf: hf["hidden_size"] // hf["num_attention_heads"]),
    ConfigKey("mlp_dim", "intermediate_size"),
    ConfigKey("num_decoder_layers", "num_hidden_layers"),
    ConfigKey("vocab_size", "vocab_size"),
    ConfigKey("normalization_layer_epsilon", "rms_norm_eps", default=1e-6, from_hf=float),
    ConfigKey("logits_via_embedding", "tie_word_embeddings", default=False, from_hf=bool),
)
NO_WINDOW = ConfigKey("sliding_window", None, default=0)  # Llama attends to the whole causal context
MISTRAL_WINDOW = ConfigKey("sliding_window", "sliding_window", default=0, from_hf=int,
                           to_hf=lambda window: window or None)
DENSE = ConfigKey("num_experts", None, default=1)  # Llama and Mistral: one SwiGLU MLP per layer
NO_DENSE_PREFIX = ConfigKey("first_num_dense_layers", None, default=0)  # Mixtral, Qwen3-MoE: no dense layer stack
# Mixtral, Qwen3-MoE: softmax routing of experts as wide as mlp_dim, unscaled, without groups (DeepSeek-V3's features).
SOFTMAX_ROUTING = (ConfigKey("routed_score_func", None, default="softmax"),
                   ConfigKey("routed_scaling_factor", None, default=1.0),
                   ConfigKey("n_routing_groups", None, default=0), ConfigKey("moe_mlp_dim", None, default=0))
MIXTRAL_KEYS = (
    ConfigKey("num_experts", "num_local_experts"),
    ConfigKey("num_experts_per_tok", "num_experts_per_tok"),
    ConfigKey("moe_layer_interval", None, default=1),  # every Mixtral layer is MoE
    ConfigKey("norm_topk_prob", None, default=True),  # Mixtral always renormalizes its top-k weights
    NO_DENSE_PREFIX, *SOFTMAX_ROUTING,
)
NO_QK_NORM = ConfigKey("qk_norm", None, default=False)  # Llama, Mistral, Mixtral: q and k go to RoPE as projected
# Qwen3: Llama's keys with QK-norm; head_dim defaults as transformers' Qwen3Config does (128), the sliding window
# (layers >= max_window_layers) is refused by hf_config.unsupported, so the model attends to the whole context.
QWEN3_KEYS = tuple(key for key in LLAMA_KEYS if key.key != "head_dim") + (
    ConfigKey("head_dim", "head_dim", default=128), ConfigKey("qk_norm", None, default=True), NO_WINDOW)
# Qwen3-MoE: every decoder_sparse_step-th layer is MoE with experts of moe_intermediate_size; hf_config.unsupported
# refuses mlp_only_layers and dense layers of another width. Its config.json names the expert count num_experts
# (transformers 5 writes num_local_experts).
QWEN3_MOE_KEYS = tuple(key for key in QWEN3_KEYS if key.key not in ("head_dim", "mlp_dim")) + (
    ConfigKey("head_dim", "head_dim", default=lambda hf: hf["hidden_size"] // hf["num_attention_heads"]),
    ConfigKey("mlp_dim", "moe_intermediate_size"),
    ConfigKey("num_experts", "num_experts", default=lambda hf: hf["num_local_experts"]),
    ConfigKey("num_experts_per_tok", "num_experts_per_tok"),
    ConfigKey("moe_layer_interval", "decoder_sparse_step", default=1, from_hf=int),
    ConfigKey("norm_topk_prob", "norm_topk_prob", default=False, from_hf=bool),  # transformers' default: false
    NO_DENSE_PREFIX, *SOFTMAX_ROUTING,
)
# rope_theta is read by hf_config.rope_theta (it moved into `rope_parameters` in transformers 5).

LLAMA_TENSORS = (
    TensorRule("token_embedding", "model.embed_tokens.weight"),
    TensorRule("decoder/layers/pre_attention_norm/scale", "model.layers.{layer}.input_layernorm.weight", ("layer",)),
    TensorRule("decoder/layers/attention/query", "model.layers.{layer}.self_attn.q_proj.weight", ("layer",), 1),
    TensorRule("decoder/layers/attention/key", "model.layers.{layer}.self_attn.k_proj.weight", ("layer",), 1),
    TensorRule("decoder/layers/attention/value", "model.layers.{layer}.self_attn.v_proj.weight", ("layer",), 1),
    TensorRule("decoder/layers/attention/out", "model.layers.{layer}.self_attn.o_proj.weight", ("layer",), 2),
    TensorRule("decoder/layers/pre_mlp_norm/scale", "model.layers.{layer}.post_attention_layernorm.weight",
               ("layer",)),
    TensorRule("decoder/layers/mlp/wi_gate", "model.layers.{layer}.mlp.gate_proj.weight", ("layer",), 1),
    TensorRule("decoder/layers/mlp/wi_up", "model.layers.{layer}.mlp.up_proj.weight", ("layer",), 1),
    TensorRule("decoder/layers/mlp/wo", "model.layers.{layer}.mlp.down_proj.weight", ("layer",), 1),
    TensorRule("final_norm/scale", "model.norm.weight"),
    TensorRule("output", "lm_head.weight", (), 1),
)

_MIXTRAL_MOE = "model.layers.{layer}.block_sparse_moe"
MIXTRAL_TENSORS = tuple(rule for rule in LLAMA_TENSORS if "/mlp/" not in rule.path) + (
    # Transformers 5 fuses the experts in memory but saves (and reads) them one tensor per expert, as here.
    TensorRule("decoder/layers/moe/router", f"{_MIXTRAL_MOE}.gate.weight", ("layer",), 1),
    TensorRule("decoder/layers/moe/wi_gate", f"{_MIXTRAL_MOE}.experts.{{expert}}.w1.weight", ("layer", "expert"), 1),
    TensorRule("decoder/layers/moe/wi_up", f"{_MIXTRAL_MOE}.experts.{{expert}}.w3.weight", ("layer", "expert"), 1),
    TensorRule("decoder/layers/moe/wo", f"{_MIXTRAL_MOE}.experts.{{expert}}.w2.weight", ("layer", "expert"), 1),
)

QWEN3_TENSORS = LLAMA_TENSORS + (
    TensorRule("decoder/layers/attention/query_norm/scale", "model.layers.{layer}.self_attn.q_norm.weight", ("layer",)),
    TensorRule("decoder/layers/attention/key_norm/scale", "model.layers.{layer}.self_attn.k_norm.weight", ("layer",)),
)
_QWEN3_MOE = "model.layers.{layer}.mlp"
QWEN3_MOE_TENSORS = QWEN3_TENSORS + (  # the dense MLP rules serve the dense layers of decoder_sparse_step > 1
    TensorRule("decoder/layers/moe/router", f"{_QWEN3_MOE}.gate.weight", ("layer",), 1),
    TensorRule("decoder/layers/moe/wi_gate", f"{_QWEN3_MOE}.experts.{{expert}}.gate_proj.weight", ("layer", "expert"), 1),
    TensorRule("decoder/layers/moe/wi_up", f"{_QWEN3_MOE}.experts.{{expert}}.up_proj.weight", ("layer", "expert"), 1),
    TensorRule("decoder/layers/moe/wo", f"{_QWEN3_MOE}.experts.{{expert}}.down_proj.weight", ("layer", "expert"), 1),
)

# ---------------------------------------------------------------- DeepSeek-V3 (MLA, shared experts, MTP)

def _lora(value: Any) -> int:
    return int(value or 0)  # config.json's null: no compressed query


# Defaults: transformers' DeepseekV3Config's, for keys a config.json leaves out (q_lora_rank: null or absent = none).
DEEPSEEK_V3_KEYS = tuple(key for key in LLAMA_KEYS if key.key != "head_dim") + (
    ConfigKey("attention_type", None, default="mla"),
    ConfigKey("q_lora_rank", "q_lora_rank", default=0, from_hf=_lora, to_hf=lambda rank: rank or None),
    ConfigKey("kv_lora_rank", "kv_lora_rank"),
    ConfigKey("qk_nope_head_dim", "qk_nope_head_dim"),
    ConfigKey("qk_rope_head_dim", "qk_rope_head_dim"),
    ConfigKey("v_head_dim", "v_head_dim"),
    ConfigKey("first_num_dense_layers", "first_k_dense_replace", default=3, from_hf=int),
    ConfigKey("num_experts", "n_routed_experts"),
    ConfigKey("num_experts_per_tok", "num_experts_per_tok"),
    ConfigKey("moe_mlp_dim", "moe_intermediate_size"),
    ConfigKey("num_shared_experts", "n_shared_experts", default=1, from_hf=int),
    ConfigKey("norm_topk_prob", "norm_topk_prob", default=True, from_hf=bool),
    ConfigKey("routed_scaling_factor", "routed_scaling_factor", default=2.5, from_hf=float),
    ConfigKey("n_routing_groups", "n_group", default=8, from_hf=int, to_hf=lambda groups: groups or 1),  # 0: off
    ConfigKey("topk_routing_group", "topk_group", default=4, from_hf=int, to_hf=lambda kept: kept or 1),
    # hf_config.model_keys sets 0 when the safetensors lack the MTP layers (transformers saves none, and writes 1).
    ConfigKey("mtp_num_layers", "num_nextn_predict_layers", default=1, from_hf=int),
    ConfigKey("moe_layer_interval", None, default=1),  # moe_layer_freq: hf_config.unsupported refuses another
    ConfigKey("routed_score_func", None, default="sigmoid"),  # scoring_func: likewise
    ConfigKey("routed_bias", None, default=True),  # topk_method noaux_tc: e_score_correction_bias is always there
    NO_WINDOW, NO_QK_NORM,
)

_MLA = "model.layers.{layer}.self_attn"
_DEEPSEEK_MOE = "model.layers.{layer}.mlp"
_MTP = "model.layers.{layer}"  # an MTP module is the layer after the last decoder layer (k-th: num_hidden_layers+k-1)
DEEPSEEK_V3_TENSORS = tuple(rule for rule in LLAMA_TENSORS if "/attention/" not in rule.path) + (
    TensorRule("decoder/layers/attention/query", f"{_MLA}.q_proj.weight", ("layer",), 1, rope_tail=True),
    TensorRule("decoder/layers/attention/query_a", f"{_MLA}.q_a_proj.weight", ("layer",), 1),
    TensorRule("decoder/layers/attention/query_a_norm/scale", f"{_MLA}.q_a_layernorm.weight", ("layer",)),
    TensorRule("decoder/layers/attention/query_b", f"{_MLA}.q_b_proj.weight", ("layer",), 1, rope_tail=True),
    TensorRule("decoder/layers/attention/key_value_a", f"{_MLA}.kv_a_proj_with_mqa.weight", ("layer",), 1,
               rope_tail=True),
    TensorRule("decoder/layers/attention/key_value_a_norm/scale", f"{_MLA}.kv_a_layernorm.weight", ("layer",)),
    TensorRule("decoder/layers/attention/key_value_b", f"{_MLA}.kv_b_proj.weight", ("layer",), 1),
    TensorRule("decoder/layers/attention/out", f"{_MLA}.o_proj.weight", ("layer",), 2),
    TensorRule("decoder/layers/moe/router", f"{_DEEPSEEK_MOE}.gate.weight", ("layer",), 1, float32=True),
    TensorRule("decoder/layers/moe/routing_bias", f"{_DEEPSEEK_MOE}.gate.e_score_correction_bias", ("layer",),
               float32=True),
    TensorRule("decoder/layers/moe/wi_gate", f"{_DEEPSEEK_MOE}.experts.{{expert}}.gate_proj.weight",
               ("layer", "expert"), 1),
    TensorRule("decoder/layers/moe/wi_up", f"{_DEEPSEEK_MOE}.experts.{{expert}}.up_proj.weight",
               ("layer", "expert"), 1),
    TensorRule("decoder/layers/moe/wo", f"{_DEEPSEEK_MOE}.experts.{{expert}}.down_proj.weight", ("layer", "expert"), 1),
    TensorRule("decoder/layers/moe/shared_experts/wi_gate", f"{_DEEPSEEK_MOE}.shared_experts.gate_proj.weight",
               ("layer",), 1),
    TensorRule("decoder/layers/moe/shared_experts/wi_up", f"{_DEEPSEEK_MOE}.shared_experts.up_proj.weight",
               ("layer",), 1),
    TensorRule("decoder/layers/moe/shared_experts/wo", f"{_DEEPSEEK_MOE}.shared_experts.down_proj.weight",
               ("layer",), 1),
    # An MTP module's own tensors (`mtp/module_k/...`; its decoder layer takes the rules of `decoder/layers/`).
    TensorRule("mtp/embedding_norm/scale", f"{_MTP}.enorm.weight"),
    TensorRule("mtp/hidden_norm/scale", f"{_MTP}.hnorm.weight"),
    TensorRule("mtp/projection/kernel", f"{_MTP}.eh_proj.weight", (), 1),  # input: [embedding; hidden]
    TensorRule("mtp/head_norm/scale", f"{_MTP}.shared_head.norm.weight"),
)

# HF tensors that carry no parameters (buffers some older exports saved).
LLAMA_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# The released DeepSeek-V3's MTP layer holds copies of the embedding and output head, which maxpar's MTP modules
# share with the model: read from model.embed_tokens and lm_head, not written on export.
DEEPSEEK_V3_IGNORED = re.compile(LLAMA_IGNORED.pattern
                                 + r"|model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight")


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A supported `architectures[0]` of config.json."""

    name: str
    model_type: str
    keys: tuple[ConfigKey, ...]
    tensors: tuple[TensorRule, ...]
    ignored: re.Pattern[str] = LLAMA_IGNORED
    # Extra config.json entries to_hf writes (besides the keys above and rope).
    hf_constants: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # config.json keys to_hf copies from another of its keys when the template has none (keys maxpar does not
    # model separately but transformers reads).
    hf_defaults: Mapping[str, str] = dataclasses.field(default_factory=dict)


ARCHITECTURES = {arch.name: arch for arch in (
    Architecture("LlamaForCausalLM", "llama", LLAMA_KEYS + (NO_WINDOW, DENSE, NO_QK_NORM), LLAMA_TENSORS,
                 hf_constants={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}),
    Architecture("MistralForCausalLM", "mistral", LLAMA_KEYS + (MISTRAL_WINDOW, DENSE, NO_QK_NORM), LLAMA_TENSORS,
                 hf_constants={"hidden_act": "silu"}),
    Architecture("MixtralForCausalLM", "mixtral", LLAMA_KEYS + (MISTRAL_WINDOW, NO_QK_NORM) + MIXTRAL_KEYS,
                 MIXTRAL_TENSORS, hf_constants={"hidden_act": "silu", "router_jitter_noise": 0.0}),
    Architecture("Qwen3ForCausalLM", "qwen3", QWEN3_KEYS + (DENSE,), QWEN3_TENSORS,
                 hf_constants={"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False}),
    # Without a template, the dense width is the experts' (unread: dense layers exist only with
    # decoder_sparse_step > 1, where hf_config.unsupported requires the two equal).
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", QWEN3_MOE_KEYS, QWEN3_MOE_TENSORS,
                 hf_constants={"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
                               "mlp_only_layers": []},
                 hf_defaults={"intermediate_size": "moe_intermediate_size"}),
    Architecture("DeepseekV3ForCausalLM", "deepseek_v3", DEEPSEEK_V3_KEYS, DEEPSEEK_V3_TENSORS,
                 ignored=DEEPSEEK_V3_IGNORED,
                 hf_constants={"hidden_act": "silu", "attention_bias": False, "rope_interleave": True,
                               "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}),
)}


SUBLAYER = re.compile(r"^(decoder/layers/)sublayer_(\d+)/(.+)$")  # a layer of an interleaved block
DENSE_PREFIX = re.compile(r"^decoder/dense_layers/(.+)$")  # first_num_dense_layers' own stack, HF layers 0...
MTP_MODULE = re.compile(r"^mtp/module_(\d+)/(.+)$")  # the k-th MTP module (k from 1), HF layer num_layers + k - 1


def rope_order(size: int, rope: int) -> tuple[int, ...]:
    """`TensorRule.order` of an axis of `size` ending in `rope` RoPE features that HF interleaves as pairs: maxpar
    rotates half-split (maxpar/model/mla.py), so its rope features are HF's evens, then its odds."""
    head = size - rope
    return tuple(range(head)) + tuple(head + i for i in range(0, rope, 2)) + tuple(head + i for i in range(1, rope, 2))


def tensor_rules(architecture: Architecture, shapes: Mapping[str, Sequence[int]], num_layers: int = 0,
                 rope_dim: int = 0) -> dict[str, TensorRule]:
    """The rule of each maxpar parameter path, by its shape (a tied model has no `output`, so its rule drops out).

    Sublayer j of interleaved blocks of k layers takes the rule of the same parameter of a plain layer, for HF
    layers j, k + j, ... (the tables name one layer; the block layout is maxpar's, `maxpar.model.stack`). A dense
    prefix of n layers is HF layers 0..n-1 and shifts the main stack by n; MTP module k is HF layer
    `num_layers` + k - 1, its decoder layer under the main stack's rules. `rope_dim`: the RoPE features that
    `rope_tail` rules reorder. Raises ValueError when a parameter has no rule: this architecture's table is incomplete.
    """
    by_path = {rule.path: rule for rule in architecture.tensors}
    interval = len({match[2] for path in shapes if (match := SUBLAYER.match(path))}) or 1
    dense = next((shape[0] for path, shape in shapes.items() if DENSE_PREFIX.match(path)), 0)

    def rule_of(path: str) -> TensorRule | None:
        if match := DENSE_PREFIX.match(path):
            rule = by_path.get(f"decoder/layers/{match[1]}")
        elif match := SUBLAYER.match(path):
            rule = by_path.get(match[1] + match[3])
            rule = rule and dataclasses.replace(rule, layer_stride=interval, layer_offset=int(match[2]) + dense)
        elif match := MTP_MODULE.match(path):
            own = match[2].removeprefix("layer/")
            rule = by_path.get(f"decoder/layers/{own}" if own != match[2] else f"mtp/{own}")
            layer = str(num_layers + int(match[1]) - 1)
            rule = rule and dataclasses.replace(rule, hf_name=rule.hf_name.replace("{layer}", layer),
                                                stacked=tuple(axis for axis in rule.stacked if axis != "layer"))
        else:
            rule = by_path.get(path)
            rule = rule and (dataclasses.replace(rule, layer_offset=dense) if "layer" in rule.stacked else rule)
        if rule and rule.rope_tail:
            rule = dataclasses.replace(rule, order=rope_order(shapes[path][-1], rope_dim))
        return rule and dataclasses.replace(rule, path=path)

    rules = {path: rule_of(path) for path in shapes}
    missing = [path for path, rule in rules.items() if rule is None]
    if missing:
        raise ValueError(f"{architecture.name}: no Hugging Face tensor for maxpar parameters {missing}")
    return rules
