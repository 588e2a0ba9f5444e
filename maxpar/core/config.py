"""Typed run configuration: one schema, YAML defaults, `key=value` overrides.

The `Config` dataclass is the single source of truth for which keys exist and
their types and ranges; `configs/base.yml` is the single source of their
default values (a test checks the two name the same keys). Loading is pure: it
reads files and returns a frozen `Config`, touching neither JAX nor the
environment. Device-dependent resolution (device count, `-1` fill) lives in
`maxpar.core.mesh`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import omegaconf
from etils import epath
from omegaconf import OmegaConf

from maxpar.core import storage
from maxpar.core.axes import PHYSICAL_AXES, Logical, unknown_logical
from maxpar.core.schedule import EXPLICIT_BACKWARD, ScheduleKind

DTYPES = ("float32", "bfloat16", "float16")
SYNTHETIC_FIRST_TOKEN = 3  # synthetic data skips ids 0-2, the byte tokenizer's pad, bos and eos
ATTENTION = ("dot_product", "xla", "cudnn_flash", "cudnn_flash_causal", "blockwise", "splash")
ATTENTION_TYPES = ("gqa", "mla")
MLA_ATTENTION = ("dot_product", "blockwise", "splash")  # the cores that take v with another head width than q and k
# The block (flash-style) cores that run per device under the layout's shard_map: no seq x seq scores, and the
# sequence may be split over `context` (context parallelism).
BLOCK_ATTENTION = ("blockwise", "splash")
SPLASH_LANES = 128  # the splash kernel's key blocks (and its query blocks, with segment ids) are multiples of this
CONTEXT_STRATEGIES = ("all_gather", "ring")
CUDNN_ATTENTION = ("cudnn_flash", "cudnn_flash_causal")
QUANTIZATION = ("", "fp8")
ROUTED_SCORE_FUNCS = ("softmax", "sigmoid")
FP8_SCALING = ("current", "delayed")
OPT_TYPES = ("adamw", "muon")
LR_SCHEDULES = ("cosine", "wsd")
WSD_DECAY_STYLES = ("linear", "cosine", "1-sqrt")


class ConfigError(ValueError):
    """Bad configuration; the trainer prints it and exits with status 2."""


# The model a checkpoint carries (docs/checkpoints.md#a-checkpoint-carries-its-model). MODEL_KEYS fix the parameter
# tree and its dtype: every kind of load needs them equal. FUNCTION_KEYS change what the parameters compute but not
# their shapes (RoPE, norms, routing, the attention window): a run may change them deliberately.
MODEL_KEYS = ("emb_dim", "num_query_heads", "num_kv_heads", "head_dim", "mlp_dim", "num_decoder_layers",
              "vocab_size", "weight_dtype", "logits_via_embedding", "qk_norm", "num_experts",
              "moe_layer_interval", "first_num_dense_layers", "attention_type", "q_lora_rank", "kv_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mtp_num_layers", "moe_mlp_dim",
              "num_shared_experts", "routed_bias")
FUNCTION_KEYS = ("rope_theta", "rope_scaling_type", "rope_scaling_factor", "rope_low_freq_factor",
                 "rope_high_freq_factor", "rope_original_max_position_embeddings", "normalization_layer_epsilon",
                 "sliding_window", "num_experts_per_tok", "norm_topk_prob", "rope_yarn_beta_fast",
                 "rope_yarn_beta_slow", "rope_yarn_mscale", "rope_yarn_mscale_all_dim", "routed_score_func",
                 "routed_scaling_factor", "n_routing_groups", "topk_routing_group")
# What a checkpoint carries: its preset's name, its model's keys, and the tokenizer its token ids belong to.
CARRIED_KEYS = ("model_name", *MODEL_KEYS, *FUNCTION_KEYS, "tokenizer_path")


@dataclasses.dataclass(frozen=True)
class CarriedModel:
    """The model of a checkpoint a run starts from (`maxpar.io.run_config` reads it): the CARRIED_KEYS it was
    written with, and where they were read (for messages)."""
    source: str
    values: Mapping[str, Any]


def _key(doc: str, *, min: float | None = None, max: float | None = None,
         choices: Sequence[Any] | None = None, allow: Sequence[Any] = ()) -> dataclasses.Field:
    """A schema field: its one-line doc and its allowed values (no default here)."""
    return dataclasses.field(metadata=dict(doc=doc, min=min, max=max, choices=choices, allow=tuple(allow)))


AxisRule = tuple[str, tuple[str, ...]]
# docs/pipelines.md
PIPELINE_SCHEDULES = ("auto", *ScheduleKind)


class RopeScaling(typing.NamedTuple):
    """RoPE scaling (the rope_scaling_* and rope_yarn_* keys): Llama 3.1+'s `llama3` or YaRN (`yarn`,
    DeepSeek-V3); each kind reads its own fields."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    kind: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


# The data keys a source of dataset_mixture may set; the run's value stands for any it leaves out.
SOURCE_KEYS = ("dataset_type", "dataset_path", "grain_file_type", "dataset_text_field", "hf_path", "hf_data_files",
               "hf_train_split", "hf_eval_split")


@dataclasses.dataclass(frozen=True)
class MixtureSource:
    """One source of `dataset_mixture`: its name (the metrics' `tokens/NAME`), its share of the training tokens,
    and the data keys it sets, as sorted (key, value) pairs so that the config stays hashable."""
    name: str
    weight: float
    keys: tuple[tuple[str, Any], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "weight": self.weight, **dict(self.keys)}


@dataclasses.dataclass(frozen=True)
class Config:
    # Run and outputs
    run_name: str = _key("name of the run; its outputs and checkpoints live in base_output_directory/run_name ('' = timestamped)")
    base_output_directory: str = _key("parent directory of all runs")
    model_name: str = _key("model shape preset from configs/models/NAME.yml ('' = use the keys as given)")
    seed: int = _key("seed for parameter init and data shuffling")
    steps: int = _key("number of optimizer steps", min=0)
    # Batch
    per_device_batch_size: float = _key("rows per device per microbatch (may be fractional if the global batch is whole)", min=0)
    max_target_length: int = _key("sequence length of a training row", min=1)
    gradient_accumulation_steps: int = _key("microbatches accumulated per optimizer step", min=1)
    # Optimizer
    learning_rate: float = _key("peak learning rate", min=0)
    warmup_steps: int = _key("linear warm-up steps from 0 to learning_rate", min=0)
    learning_rate_final_fraction: float = _key("the schedule (cosine or wsd) ends at this fraction of learning_rate",
                                               min=0, max=1)
    lr_schedule_type: str = _key("learning-rate schedule after the warm-up: cosine (down to the final fraction over "
                                 "the rest of `steps`) or wsd (warmup-stable-decay: constant, then down to the final "
                                 "fraction over the last wsd_decay_steps_fraction of `steps`)", choices=LR_SCHEDULES)
    wsd_decay_steps_fraction: float = _key("wsd: the fraction of `steps` its decay phase takes (at the end)",
                                           min=0, max=1)
    wsd_decay_style: str = _key("wsd: the decay's shape, linear, cosine or 1-sqrt (lr falls as 1 - sqrt(progress))",
                                choices=tuple(WSD_DECAY_STYLES))
    opt_type: str = _key("adamw, or muon: Newton-Schulz orthogonalized momentum for the hidden matrices (attention, "
                         "MLP and expert projections), AdamW for the rest (docs/optimizers.md)", choices=OPT_TYPES)
    muon_beta: float = _key("muon: momentum decay of the hidden matrices' gradients (Nesterov)", min=0, max=1)
    muon_weight_decay: float = _key("muon: decoupled weight decay of the hidden matrices, multiplied by the learning "
                                    "rate as AdamW's", min=0)
    muon_consistent_rms: float = _key("muon: > 0 scales each orthogonalized update by this x sqrt(max(fan_in, "
                                      "fan_out)), an RMS like AdamW's, so Muon shares AdamW's learning rate and weight "
                                      "decay (Moonshot: 0.2); 0 = Jordan's sqrt(max(1, fan_out / fan_in)), which "
                                      "wants a learning rate about 10x larger", min=0)
    adam_b1: float = _key("AdamW beta1", min=0, max=1)
    adam_b2: float = _key("AdamW beta2", min=0, max=1)
    adam_eps: float = _key("AdamW epsilon", min=0)
    adam_weight_decay: float = _key("AdamW decoupled weight decay", min=0)
    gradient_clipping_threshold: float = _key("global-norm clipping threshold (0 = off)", min=0)
    z_loss_weight: float = _key("weight of PaLM's z-loss, the mean over tokens of (log Z)^2 of the logits' softmax "
                                "normalizer, added to the training objective (0 = off; PaLM: 1e-4); metric z_loss",
                                min=0)
    shard_optimizer_over_data: bool = _key("ZeRO-1: shard the AdamW moments over the data axis too (parameters stay "
                                           "replicated over it); gradients reduce-scattered, parameters all-gathered")
    # Model
    emb_dim: int = _key("model (residual) width", min=1)
    num_query_heads: int = _key("attention query heads", min=1)
    num_kv_heads: int = _key("attention key/value heads (GQA); divides num_query_heads", min=1)
    head_dim: int = _key("width of one attention head", min=1)
    mlp_dim: int = _key("SwiGLU hidden width", min=1)
    num_decoder_layers: int = _key("decoder layers", min=1)
    vocab_size: int = _key("vocabulary size (>= the tokenizer's)", min=1)
    rope_theta: float = _key("RoPE base frequency", min=1)
    rope_scaling_type: str = _key("RoPE frequency scaling: '' = none, llama3 = Llama 3.1+ (the rope_scaling_* keys; "
                                  "maxpar.convert sets them from config.json), yarn = YaRN (DeepSeek-V3: "
                                  "rope_scaling_factor, rope_original_max_position_embeddings, the rope_yarn_* keys)",
                                  choices=("", "llama3", "yarn"))
    rope_scaling_factor: float = _key("llama3 RoPE: long wavelengths are divided by this factor", min=1)
    rope_low_freq_factor: float = _key("llama3 RoPE: wavelengths above original/low_freq_factor are fully scaled",
                                       min=0)
    rope_high_freq_factor: float = _key("llama3 RoPE: wavelengths below original/high_freq_factor are kept; "
                                        "> rope_low_freq_factor", min=0)
    rope_original_max_position_embeddings: int = _key("llama3 / yarn RoPE: the context length the model was "
                                                      "pretrained on", min=1)
    rope_yarn_beta_fast: float = _key("yarn RoPE: rotary pairs turning more than this many times over the original "
                                      "context keep their frequency (> rope_yarn_beta_slow)", min=0)
    rope_yarn_beta_slow: float = _key("yarn RoPE: rotary pairs turning fewer times than this are fully interpolated",
                                      min=0)
    rope_yarn_mscale: float = _key("yarn RoPE: the rotary part's attention factor is mscale(factor, this) / "
                                   "mscale(factor, rope_yarn_mscale_all_dim) when both are set (else "
                                   "mscale(factor, 1))", min=0)
    rope_yarn_mscale_all_dim: float = _key("yarn RoPE: > 0 multiplies MLA's softmax scale by mscale(factor, this)^2 "
                                           "(DeepSeek-V3: 1.0); 0 = off", min=0)
    normalization_layer_epsilon: float = _key("RMSNorm epsilon", min=0)
    logits_via_embedding: bool = _key("tie the output projection to the token embedding")
    qk_norm: bool = _key("RMSNorm on each query and key head (over head_dim, own scales) before RoPE (Qwen3)")
    attention_type: str = _key("gqa = grouped-query attention (num_kv_heads, head_dim); mla = DeepSeek's multi-head "
                               "latent attention (num_query_heads heads, the lora ranks and *_head_dim keys below; "
                               "num_kv_heads and head_dim unused)", choices=ATTENTION_TYPES)
    q_lora_rank: int = _key("mla: rank of the compressed query (0 = q projected directly, as DeepSeek-V2-Lite)", min=0)
    kv_lora_rank: int = _key("mla: width of the compressed key/value latent, what the KV cache holds per token", min=0)
    qk_nope_head_dim: int = _key("mla: per-head query/key width without position (RoPE) information", min=1)
    qk_rope_head_dim: int = _key("mla: per-head query/key width that RoPE rotates (the key's part is shared by all "
                                 "heads and cached); even", min=2)
    v_head_dim: int = _key("mla: per-head value width", min=1)
    dtype: str = _key("activation/compute dtype", choices=DTYPES)
    weight_dtype: str = _key("parameter dtype (and the optimizer state's, unless optimizer_state_dtype is set)",
                             choices=DTYPES)
    optimizer_state_dtype: str = _key("dtype of both AdamW moments ('' = weight_dtype); e.g. float32 under "
                                      "bfloat16 weights: 2 + 8 bytes per parameter", choices=("",) + DTYPES)
    remat_policy: str = _key("activation rematerialization per layer", choices=("none", "minimal", "full"))
    attention: str = _key("attention core: dot_product (einsums), xla (jax.nn.dot_product_attention), cudnn_flash "
                          "(cuDNN flash, GPU, packed documents as a bias), cudnn_flash_causal (causal only: "
                          "one document per row), blockwise (pure-JAX flash attention: blocks, online softmax, "
                          "skipped masked blocks; context parallelism), splash (JAX's Pallas TPU splash attention "
                          "kernel; TPU only; context parallelism with all_gather)", choices=ATTENTION)
    attention_block_size: int = _key("query/key block of attention=blockwise (capped at the local sequence, which "
                                     "it must divide); memory per head O(length x block)", min=1)
    sa_block_q: int = _key("query block of attention=splash, every kernel (capped at the local sequence, which it "
                           "must divide; a multiple of 128): MaxText's key", min=SPLASH_LANES)
    sa_block_kv: int = _key("key/value block of attention=splash, every kernel (capped at the keys' sequence, which "
                            "it must divide; a multiple of 128): MaxText's key", min=SPLASH_LANES)
    sliding_window: int = _key("attend only to this many most recent tokens, the current one included "
                               "(0 = all; Mistral; maxpar.convert sets it from config.json)", min=0)
    scan_layers: bool = _key("nn.scan over layers (stacked `layers` axis); faster compile")
    # Mixture of experts (maxpar/model/moe.py; docs/moe.md)
    num_experts: int = _key("experts per MoE layer (1 = dense SwiGLU MLP in every layer)", min=1)
    num_experts_per_tok: int = _key("experts each token is routed to (top-k); <= num_experts", min=1)
    norm_topk_prob: bool = _key("renormalize the top-k routing weights to sum to 1 (Mixtral; Qwen3-MoE's "
                                "norm_topk_prob); false = the softmax probabilities as they are")
    moe_layer_interval: int = _key("every k-th decoder layer (layers k, 2k, ...) is MoE, the others dense; "
                                   "1 = every layer; divides num_decoder_layers", min=1)
    first_num_dense_layers: int = _key("with num_experts > 1: the first k decoder layers are dense (SwiGLU of "
                                       "mlp_dim), a stack of their own; moe_layer_interval applies to the rest "
                                       "(DeepSeek-V3: 3); 0 = none", min=0)
    capacity_factor: float = _key("0 = dropless; > 0 = an expert takes at most ceil(capacity_factor x row length "
                                  "x top-k / num_experts) tokens of a row, the rest are dropped", min=0)
    load_balance_loss_weight: float = _key("weight of the load-balancing auxiliary loss added to the training "
                                           "objective", min=0)
    moe_mlp_dim: int = _key("hidden width of each routed expert and each shared expert (0 = mlp_dim; DeepSeek-V3: "
                            "2048 beside a dense mlp_dim of 18432)", min=0)
    num_shared_experts: int = _key("shared experts (0 = none): a dense SwiGLU of width num_shared_experts x "
                                   "moe_mlp_dim that every token goes through, added to the routed output", min=0)
    routed_score_func: str = _key("the router's scores: softmax over the experts (Mixtral, Qwen3-MoE) or each "
                                  "expert's sigmoid (DeepSeek-V3)", choices=ROUTED_SCORE_FUNCS)
    routed_scaling_factor: float = _key("multiplies the routed experts' combine weights (after norm_topk_prob; "
                                        "DeepSeek-V3: 2.5)", min=0)
    routed_bias: bool = _key("aux-loss-free balancing: a per-expert bias (a parameter the optimizer leaves alone) "
                             "added to the scores for the top-k choice only, moved by the train step towards "
                             "balance")
    routed_bias_update_rate: float = _key("routed_bias: each step, bias += rate x sign(mean load - expert load) "
                                          "(DeepSeek-V3: 0.001)", min=0)
    n_routing_groups: int = _key("group-limited routing: the experts in this many equal groups, a token picks "
                                 "among the experts of its best topk_routing_group groups (0 or 1 = off)", min=0)
    topk_routing_group: int = _key("groups kept per token with n_routing_groups > 1 (a group scores the sum of "
                                   "its two best biased scores, as DeepSeek-V3)", min=0)
    # Multi-token prediction (maxpar/model/mtp.py; docs/model.md): DeepSeek-V3's MTP modules after the layer stack
    mtp_num_layers: int = _key("multi-token prediction modules D (0 = off): module k predicts the token k+1 ahead "
                               "with one decoder layer of its own, sharing the embedding and the output projection; "
                               "trained, never run when sampling", min=0)
    mtp_loss_scaling_factor: float = _key("weight of the MTP loss (the mean over the D modules of their "
                                          "cross-entropies) added to the training objective", min=0)
    # Quantization (maxpar/model/fp8.py): the layer stack's projections and MLP matmuls
    quantization: str = _key("'' = matmuls in dtype; fp8 = the attention q/k/v/out, MLP and MoE expert matmuls take "
                             "float8 e4m3 operands and e5m2 gradients with per-tensor scales, float32 accumulation, "
                             "output in dtype (embedding, logits, attention scores and the MoE router stay in dtype)",
                             choices=QUANTIZATION)
    fp8_scaling: str = _key("fp8 scale recipe: current (from each tensor's amax in this step) or delayed (from the "
                            "largest of its last fp8_amax_history_length amaxes, kept in the train state; not with "
                            "the 1f1b/zero_bubble schedules)", choices=FP8_SCALING)
    fp8_amax_history_length: int = _key("fp8_scaling=delayed: steps of amax history kept per tensor", min=1)
    # Sampling (python -m maxpar.generate; docs/sampling.md)
    max_new_tokens: int = _key("tokens generated per prompt (fewer if it ends with EOS)", min=1)
    temperature: float = _key("sampling temperature (0 = greedy: the most likely token)", min=0)
    top_k: int = _key("sample among the k most likely tokens only (0 = all)", min=0)
    top_p: float = _key("sample among the most likely tokens whose probability sums to top_p "
                        "(1 = all; 0 = the most likely one)", min=0, max=1)
    # Logging, eval, checkpoints
    log_period: int = _key("log metrics every N steps", min=1)
    log_level: str = _key("library logs (absl, Orbax, JAX, Gloo): info = written to RUN/libraries.log, kept off "
                          "the terminal; debug = DEBUG records too, also printed on the terminal",
                          choices=("info", "debug"))
    eval_interval: int = _key("evaluate every N steps (0 = only at the end, -1 = never)", min=-1)
    eval_steps: int = _key("batches per evaluation", min=1)
    eval_fraction: float = _key("fraction of text documents held out for eval", min=0, max=0.5)
    checkpoint_period: int = _key("save a checkpoint every N steps", min=1)
    enable_checkpointing: bool = _key("save checkpoints and resume from the newest one")
    async_checkpointing: bool = _key("write checkpoints in the background while training continues")
    max_checkpoints_to_keep: int = _key("newest checkpoints kept on disk (0 = all)", min=0)
    save_attempts: int = _key("tries of a checkpoint save (storage refusing connections, a failed write) before the "
                              "run stops with exit status 74", min=1)
    save_retry_delay_s: float = _key("seconds to wait after a failed checkpoint save, doubled after each further "
                                     "failure", min=0)
    save_retry_max_delay_s: float = _key("longest wait between checkpoint save attempts", min=0)
    local_checkpoint_directory: str = _key("node-local directory of a fast checkpoint tier, written every "
                                           "local_checkpoint_period steps; each process keeps its own pieces there "
                                           "('' = off; gs:// is refused: it must be node-local)")
    local_checkpoint_period: int = _key("save to the local checkpoint tier every N steps", min=1)
    load_parameters_path: str = _key("start a new run from another run's parameters only: a checkpoint step dir "
                                     "RUN/checkpoints/STEP or a run dir (newest step); fresh optimizer, step 0")
    load_full_state_path: str = _key("start a new run from another run's parameters, optimizer state and step "
                                     "(same forms as load_parameters_path); the data starts from its beginning")
    stop_on_nan: bool = _key("stop at the first step whose loss or gradient norm is NaN/Inf (its update is never "
                             "applied, so no checkpoint holds it); false = skip such steps' updates and train on")
    skip_step_on_spike_factor: float = _key("skip a step's update when its loss exceeds this factor x the running "
                                            "average of the losses before it (0 = off; e.g. 2); counted in the "
                                            "metrics as skipped_spikes", min=0)
    skip_memory_check: bool = _key("start even when the planner's per-device memory estimate exceeds the device "
                                   "memory (host memory on CPU); false = refuse with the numbers before allocating")
    num_simulated_devices: int = _key("simulate this many CPU devices (applied before JAX starts, CPU only; "
                                      "0 = off, or set XLA_FLAGS=--xla_force_host_platform_device_count=N)", min=0)
    cpu_malloc_tuning: bool = _key("on XLA:CPU, glibc malloc keeps each step's freed buffers mapped instead of "
                                   "faulting them in again every step (faster multi-device CPU steps; "
                                   "maxpar's own processes only; your MALLOC_* variables stand; false = defaults)")
    peak_flops_per_device: float = _key("peak dense FLOP/s of one device for MFU (0 = look up the device kind)", min=0)
    profiler: str = _key("'' = off; xplane = a jax.profiler trace of profiler_steps steps under RUN/profile/ "
                         "(TensorBoard's profile plugin, Perfetto)", choices=("", "xplane"))
    profiler_start_step: int = _key("first traced step (steps count from 1; 2 skips the first step's warm-up)", min=1)
    profiler_steps: int = _key("number of steps traced", min=1)
    # Data
    dataset_type: str = _key("input pipeline: text (files), grain (record shards), hf (a Hugging Face dataset on "
                             "local disk) or synthetic", choices=("synthetic", "text", "grain", "hf"))
    dataset_path: str = _key("glob of text files, one document each (dataset_type=text), or of record shards "
                             "(dataset_type=grain); {stdlib} = Python's standard library directory")
    grain_file_type: str = _key("record shard format for dataset_type=grain: one record = one document",
                                choices=("jsonl", "parquet", "arrayrecord"))
    dataset_text_field: str = _key("the record field (JSONL, ArrayRecord) or column (Parquet, hf) holding the "
                                   "document text")
    hf_path: str = _key("dataset_type=hf: a directory written by save_to_disk, or a packaged builder (json, "
                        "parquet, csv, text, arrow) that reads hf_data_files; read offline")
    hf_data_files: str = _key("dataset_type=hf with a builder as hf_path: glob of its local data files")
    hf_train_split: str = _key("dataset_type=hf: the split trained on")
    hf_eval_split: str = _key("dataset_type=hf: the split evaluated on ('' = hold out eval_fraction of the "
                              "training split's rows)")
    tokenizer_path: str = _key("'' = byte-level; a sentencepiece .model or a Hugging Face tokenizer.json")
    dataset_mixture: tuple[MixtureSource, ...] = _key("weighted sources, mixed by tokens: a list of {name, weight, "
                                                      "and data keys (dataset_type, dataset_path, hf_path, ...)}; "
                                                      "[] = the single source of the keys above")
    # Post-training (docs/post-training.md): SFT on conversations, DPO on preference pairs, LoRA adapters
    use_sft: bool = _key("supervised fine-tuning: records are conversations (`messages`: role/content), formatted by "
                         "the tokenizer's chat template, packed whole (dataset_type=grain jsonl or hf)")
    sft_train_on_completion_only: bool = _key("use_sft: the loss on the assistant tokens only (false = on every "
                                              "token of the conversation)")
    chat_template_path: str = _key("a Jinja chat template file ('' = the tokenizer's own: chat_template in "
                                   "tokenizer_config.json, or chat_template.jinja, beside tokenizer_path)")
    use_dpo: bool = _key("direct preference optimization: records are pairs (prompt or messages, chosen, rejected); "
                         "the reference model is the starting parameters, frozen")
    dpo_beta: float = _key("use_dpo: beta of -log sigmoid(beta x (chosen - rejected log-ratio margin))", min=0)
    dpo_label_smoothing: float = _key("use_dpo: the share of pairs assumed mislabeled (conservative DPO; 0 = plain "
                                      "DPO)", min=0, max=0.49)
    lora_rank: int = _key("LoRA adapters of this rank on the lora_target_roles projections, the base weights frozen "
                          "(0 = off: every parameter is trained)", min=0)
    lora_alpha: float = _key("LoRA scaling: an adapter adds lora_alpha / lora_rank x (x A) B", min=0)
    lora_target_roles: tuple[str, ...] = _key("the parameter roles (maxpar/model/roles.py) that get adapters: query, "
                                              "key, value, attention_out, mlp_gate, mlp_up, mlp_down, expert_gate, "
                                              "expert_up, expert_down, shared_gate, shared_up, shared_down, query_a, "
                                              "query_b, key_value_a, key_value_b")
    lora_base_weight_dtype: str = _key("dtype of the frozen base weights under LoRA ('' = weight_dtype); e.g. "
                                       "bfloat16 halves them", choices=("",) + DTYPES)
    # Sharding
    mesh_axes: tuple[str, ...] = _key("order of the physical mesh axes (a permutation of data, fsdp, tensor, expert, stage, "
                                  "context)")
    logical_axis_rules: tuple[AxisRule, ...] = _key("logical axis -> physical mesh axes, in priority order")
    extra_logical_axis_rules: tuple[AxisRule, ...] = _key("rules checked before logical_axis_rules (strategy presets use this)")
    context_parallel_strategy: str = _key("how attention sees the keys of other context shards: all_gather (gather "
                                          "k/v per layer) or ring (k/v blocks travel the ring, never all held)",
                                          choices=CONTEXT_STRATEGIES)
    context_parallel_load_balance: bool = _key("reorder each row once at the input so every context shard gets "
                                               "chunks i and 2N-1-i: the same share of the causal triangle")
    num_slices: int = _key("slices (DCN granules); -1 = detect from the devices", min=1, allow=(-1,))
    ici_data_parallelism: int = _key("data-parallel degree within a slice (-1 = fill)", min=-1)
    ici_fsdp_parallelism: int = _key("FSDP degree within a slice (-1 = fill)", min=-1)
    ici_tensor_parallelism: int = _key("tensor-parallel degree within a slice (-1 = fill)", min=-1)
    ici_expert_parallelism: int = _key("expert-parallel degree within a slice (-1 = fill)", min=-1)
    ici_stage_parallelism: int = _key("pipeline stages within a slice (-1 = fill)", min=-1)
    ici_context_parallelism: int = _key("context-parallel degree (sequence split) within a slice (-1 = fill)", min=-1)
    dcn_data_parallelism: int = _key("data-parallel degree across slices (-1 = fill)", min=-1)
    dcn_fsdp_parallelism: int = _key("FSDP degree across slices (-1 = fill)", min=-1)
    dcn_tensor_parallelism: int = _key("tensor-parallel degree across slices (-1 = fill)", min=-1)
    dcn_expert_parallelism: int = _key("expert-parallel degree across slices (-1 = fill)", min=-1)
    dcn_stage_parallelism: int = _key("pipeline stages across slices (-1 = fill)", min=-1)
    dcn_context_parallelism: int = _key("context-parallel degree across slices (-1 = fill)", min=-1)
    # Pipeline (stages S = ici_stage_parallelism x dcn_stage_parallelism; maxpar/pipeline/)
    num_pipeline_microbatches: int = _key("microbatches M streamed through the pipeline stages per step "
                                          "(-1 = the number of stages S)", min=1, allow=(-1,))
    num_pipeline_repeats: int = _key("pipeline repeats R: 1 = gPipe; R > 1 = circular, each stage runs R "
                                     "blocks of num_decoder_layers / (S x R) layers", min=1)
    pipeline_schedule: str = _key("auto (gpipe when num_pipeline_repeats=1, else circular) | gpipe | circular | "
                                  "1f1b (each stage alternates forward and backward: at most S microbatches' "
                                  "stage inputs held, not M) | zero_bubble "
                                  "(ZB-H1: 1f1b's memory, the backward split into input and weight gradients, "
                                  "the latter filling the bubble) | interleaved_1f1b (1f1b over R = "
                                  "num_pipeline_repeats > 1 blocks per stage, circular's layout: the bubble "
                                  "divided by about R, M a multiple of S)",
                                  choices=PIPELINE_SCHEDULES)
    pipeline_fsdp_ag_per_repeat: bool = _key("all-gather the FSDP-sharded stage weights once per pipeline repeat "
                                             "(a window of M iterations; two repeats' blocks held at a time), "
                                             "rematerialized in the backward pass: between the default and ag_once")
    pipeline_fsdp_ag_once: bool = _key("all-gather the FSDP-sharded stage weights once per step before the "
                                       "pipeline loop instead of every iteration (more memory, less communication)")
    # Multi-process jobs (maxpar/host/distributed.py; '' / -1 = from the environment GKE, XPK or launch.local set)
    coordinator_address: str = _key("HOST:PORT of process 0's JAX coordinator ('' = from the environment, "
                                    "'auto' = JAX's own cluster detection)")
    num_processes: int = _key("processes in the job (-1 = from the environment; 1 = no distributed runtime)",
                              min=1, allow=(-1,))
    process_id: int = _key("this process's index in [0, num_processes) (-1 = from the environment)", min=0, allow=(-1,))
    distributed_init_timeout_s: int = _key("seconds to wait for every process to join the job", min=1)
    distributed_heartbeat_timeout_s: int = _key("a process silent this long counts as dead and the job stops", min=1)
    step_timeout_s: int = _key("a process whose next training step has not finished this many seconds after the "
                               "previous one is stuck and stops itself, so the job fails instead of hanging (0 = off)",
                               min=0)
    # Planning (python -m maxpar.plan)
    hardware: str = _key("hardware profile configs/hardware/NAME.yml to plan for ('' = match the local devices)")
    num_devices: int = _key("devices to plan for (0 = the local device count)", min=0)
    # Compiling for a TPU topology without one (libtpu; docs/tpu.md)
    compile_topology: str = _key("'' = train; a TPU topology name (v5p-256 = 128 chips, v5e-256, v6e-256, v4-128, "
                                 "tpu7x-64): compile the train step for it with XLA:TPU, print its per-chip memory, "
                                 "collectives and the compiler's step estimate, and exit (0 fits, 1 does not)")
    compile_topology_num_slices: int = _key("slices of compile_topology, joined by DCN (the dcn_* degrees)", min=1)
    compiled_trainstep_file: str = _key("with compile_topology: write the compiled train step there (serialized "
                                        "executable); without: train with the step loaded from there, which must "
                                        "have been compiled for these devices ('' = compile as usual)")

    # ---- derived values: pure functions of the config ----
    @property
    def rope_scaling(self) -> RopeScaling | None:
        if not self.rope_scaling_type:
            return None
        return RopeScaling(self.rope_scaling_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                           self.rope_original_max_position_embeddings, self.rope_scaling_type, self.rope_yarn_beta_fast,
                           self.rope_yarn_beta_slow, self.rope_yarn_mscale, self.rope_yarn_mscale_all_dim)

    @property
    def query_groups(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_query_heads // self.num_kv_heads

    @property
    def num_moe_layers(self) -> int:
        """Decoder layers whose MLP is a routed mixture of experts (every moe_layer_interval-th after the dense
        prefix)."""
        return self.num_stack_layers // self.moe_layer_interval if self.num_experts > 1 else 0

    @property
    def num_stack_layers(self) -> int:
        """Decoder layers in the `layers` stack, the one pipeline stages split: all but the dense prefix."""
        return self.num_decoder_layers - self.first_num_dense_layers

    @property
    def moments_dtype(self) -> str:
        """The dtype of the AdamW moments: optimizer_state_dtype, else weight_dtype."""
        return self.optimizer_state_dtype or self.weight_dtype

    @property
    def axis_rules(self) -> tuple[AxisRule, ...]:
        """All logical axis rules in priority order."""
        return self.extra_logical_axis_rules + self.logical_axis_rules

    def ici_parallelism(self) -> dict[str, int]:
        return {axis: getattr(self, f"ici_{axis}_parallelism") for axis in PHYSICAL_AXES}

    def dcn_parallelism(self) -> dict[str, int]:
        return {axis: getattr(self, f"dcn_{axis}_parallelism") for axis in PHYSICAL_AXES}

    def to_dict(self) -> dict[str, Any]:
        """Plain, YAML/JSON-friendly values (tuples become lists)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The keys the model reads, and only those: its architecture, how it computes, and how its layer stack is
    stored (scan_layers and num_pipeline_repeats shape the parameter tree). Parallelism is not here: the model
    takes every sharding decision from its `maxpar.core.layout.ModelLayout`. Hashable: a Flax module attribute."""

    # architecture
    emb_dim: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    num_decoder_layers: int
    vocab_size: int
    max_target_length: int        # the KV cache's length when sampling
    normalization_layer_epsilon: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    sliding_window: int
    logits_via_embedding: bool
    qk_norm: bool
    attention_type: str
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    moe_layer_interval: int
    first_num_dense_layers: int
    capacity_factor: float
    moe_mlp_dim: int
    num_shared_experts: int
    routed_score_func: str
    routed_scaling_factor: float
    routed_bias: bool
    n_routing_groups: int
    topk_routing_group: int
    mtp_num_layers: int
    lora_rank: int                # LoRA adapters (maxpar.model.lora): their rank, scaling and the roles adapted
    lora_alpha: float
    lora_target_roles: tuple[str, ...]
    # computation
    dtype: str
    weight_dtype: str
    attention: str
    attention_block_size: int     # the blockwise kernel's block without a context layout (one device)
    sa_block_q: int               # the splash kernel's query block (capped at the local sequence)
    sa_block_kv: int              # the splash kernel's key/value block (capped at the keys' sequence)
    quantization: str
    fp8_scaling: str
    fp8_amax_history_length: int
    remat_policy: str
    # the layer stack's storage
    scan_layers: bool
    num_pipeline_repeats: int


def model_config(config: Config) -> ModelConfig:
    """The model's keys of a run's config."""
    return ModelConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(ModelConfig)})


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(Config)}
_HINTS = typing.get_type_hints(Config)


def _plain(value: Any) -> Any:
    if isinstance(value, MixtureSource):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------- loading

def load_config(argv: Sequence[str], carried: CarriedModel | None = None) -> Config:
    """`argv` = [CONFIG.yml, key=value, ...] -> validated Config.

    Precedence, lowest first: the root YAML (base.yml), the model preset named
    by `model_name`, the `carried` model, YAML files that extend the root via
    `base_config`, then command-line overrides.

    `carried`: the model of the checkpoint the run starts from, which replaces the root's defaults: its model_name
    (unless the user names one) picks the preset, and its keys stand over the preset's. The user's YAMLs and
    key=values may change its FUNCTION_KEYS and tokenizer_path; one of MODEL_KEYS that they, or a preset they
    name, set to another value is a ConfigError naming the key and both values (the parameters would not load).
    """
    if not argv or "=" in argv[0]:
        raise ConfigError("usage: python -m maxpar.train CONFIG.yml [key=value ...] (first argument must be a YAML file)")
    chain = _yaml_chain(storage.path(argv[0]))
    overrides = ("command line", parse_overrides(argv[1:]))
    for source, layer in chain + [overrides]:
        _check_known_keys(layer, source)
    user = chain[1:] + [overrides]  # what the user set over the root file's defaults
    given = _merge([layer for _, layer in user])
    if carried is not None and "model_name" not in given:  # the checkpoint's preset, if this maxpar still has it
        name = carried.values.get("model_name") or ""
        model_name = name if name and _preset_file(chain, name).is_file() else ""
        carried_layers = [(carried.source, {**carried.values, "model_name": model_name})]
    else:
        model_name = _merge([layer for _, layer in chain + [overrides]]).get("model_name") or ""
        carried_layers = [(carried.source, dict(carried.values))] if carried is not None else []
    model_layers = _preset_layers(chain, model_name)
    if carried is not None:
        _check_known_keys(carried.values, carried.source)
        named = [(f"from model_name={model_name}", model_layers[0][1])] if given.get("model_name") else []
        _check_carried(carried, named + user)
    ordered = _defaults_for_saved(chain) + chain[:1] + model_layers + carried_layers + chain[1:] + [overrides]
    return config_from_dict(_merge([layer for _, layer in ordered]))


def _preset_file(chain: Sequence[tuple[str, dict[str, Any]]], model_name: str) -> epath.Path:
    return storage.path(chain[0][0]).parent / "models" / f"{model_name}.yml"


def _preset_layers(chain: Sequence[tuple[str, dict[str, Any]]], model_name: str) -> list[tuple[str, dict[str, Any]]]:
    """[(file, keys)] of the preset `model_name` names, beside the root YAML ([] for '')."""
    if not model_name:
        return []
    model_file = _preset_file(chain, model_name)
    if not model_file.is_file():
        available = sorted(p.stem for p in model_file.parent.glob("*.yml"))
        raise ConfigError(f"model_name={model_name!r}: no file {model_file}; available: {', '.join(available)}")
    model_layer = _read_yaml(model_file)
    _check_known_keys(model_layer, str(model_file))
    return [(str(model_file), model_layer)]


def _check_carried(carried: CarriedModel, user: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
    """ConfigError when a layer of the user's (lowest first) sets one of MODEL_KEYS to another value than the
    checkpoint's: the parameters could not load into that model."""
    conflicts = []
    for key in MODEL_KEYS:
        setting = next(((source, layer[key]) for source, layer in reversed(user) if key in layer), None)
        if key not in carried.values or setting is None:
            continue
        source, value = setting
        if _coerce(key, value) != _coerce(key, carried.values[key]):
            where = {"command line": "on the command line"}.get(source, source if source.startswith("from ")
                                                                 else f"in {source}")
            conflicts.append(f"{key}={value!r} {where}, {carried.values[key]!r} in the checkpoint")
    if conflicts:
        raise ConfigError(f"{carried.source} carries its model, which these settings contradict: "
                          f"{'; '.join(conflicts)}. Drop them: the checkpoint's model is taken whole (only its "
                          f"RoPE, norm, routing and tokenizer keys may be changed)")


DEFAULTS = Path(__file__).resolve().parents[2] / "configs" / "base.yml"


def _defaults_for_saved(chain: Sequence[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """base.yml's defaults under a root file that lacks keys: a run's saved config.yml names every key there was
    when it was written, so one saved before a key was added still loads (the new key takes its default)."""
    given = set().union(*(layer for _, layer in chain))
    if Path(chain[0][0]) == DEFAULTS or given >= set(FIELDS) or not DEFAULTS.is_file():
        return []
    return [(str(DEFAULTS), {k: v for k, v in _read_yaml(DEFAULTS).items() if k not in given})]


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`key=value` strings -> dict, values typed as YAML (OmegaConf)."""
    result: dict[str, Any] = {}
    for item in items:
        key, sep, _ = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        if "." in key:
            raise ConfigError(f"override {item!r}: keys are flat (no dots); did you mean {_suggest(key.split('.')[-1])}?")
        try:
            parsed = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
        except omegaconf.errors.OmegaConfBaseException as e:
            raise ConfigError(f"override {item!r}: cannot parse value: {e}") from None
        except Exception as e:  # yaml's ParserError, ScannerError, ReaderError...: the value is not valid YAML
            raise ConfigError(f"override {item!r}: the value of {key} is not valid YAML ({_one_line(e)}); close "
                              f"every bracket, and quote a string that YAML cannot read bare, e.g. {key}='\"@x\"' "
                              f"(no control characters)") from None
        result[key] = parsed[key]
    return result


def _one_line(error: BaseException) -> str:
    """A multi-line YAML error as one line, without its '<unicode string>' locations."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and "<unicode string>" not in line]
    return "; ".join(lines) or type(error).__name__


def config_from_dict(values: Mapping[str, Any]) -> Config:
    """Validate a complete key -> value mapping and build the Config."""
    _check_known_keys(values, "config")
    missing = sorted(set(FIELDS) - set(values))
    if missing:
        raise ConfigError(f"missing config keys: {', '.join(missing)} (every key needs a default in configs/base.yml)")
    typed = {name: _coerce(name, values[name]) for name in FIELDS}
    config = Config(**typed)
    validate(config)
    return config


def _yaml_chain(path: epath.Path) -> list[tuple[str, dict[str, Any]]]:
    """[(source, layer)] from the root (no base_config) down to `path` (local or gs://)."""
    chain: list[tuple[str, dict[str, Any]]] = []
    seen: set[epath.Path] = set()
    while True:
        path = path if storage.is_remote(path) else path.resolve()
        if path in seen:
            raise ConfigError(f"base_config cycle at {path}")
        seen.add(path)
        layer = _read_yaml(path)
        parent = layer.pop("base_config", None)
        chain.insert(0, (str(path), layer))
        if parent is None:
            return chain
        path = path.parent / str(parent)


def _read_yaml(path: epath.Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with path.open() as f:  # OmegaConf opens only local names
            data = OmegaConf.to_container(OmegaConf.load(f))
    except Exception as e:  # yaml and OmegaConf raise many kinds
        raise ConfigError(f"cannot parse {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of key: value")
    return data


def _merge(layers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update(layer)
    return merged


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, list(FIELDS), n=3, cutoff=0.6)
    if not close:
        close = [name for name in FIELDS if key in name or name in key][:3]
    return " or ".join(close) if close else "(no similar key; see configs/base.yml)"


def _check_known_keys(layer: Mapping[str, Any], source: str) -> None:
    for key in layer:
        if key not in FIELDS:
            raise ConfigError(f"unknown config key {key!r} in {source}; did you mean {_suggest(str(key))}?")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))


def _coerce(name: str, value: Any) -> Any:
    """Check `value` against the schema type of `name`; ints are accepted as floats."""
    hint = _HINTS[name]
    bad = ConfigError(f"{name}={value!r}: expected {_type_name(hint)}, got {type(value).__name__}")
    if hint is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if hint is str:
        if value is None:  # `key=` on the command line
            return ""
        if not isinstance(value, str):
            raise bad
        return value
    if typing.get_origin(hint) is tuple and typing.get_args(hint) == (str, ...):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}={value!r}: expected a list of strings")
        return tuple(value)
    if typing.get_args(hint) == (MixtureSource, ...):
        return _coerce_mixture(name, value)
    return _coerce_rules(name, value)


def _coerce_mixture(name: str, value: Any) -> tuple[MixtureSource, ...]:
    """A list of {name, weight, data keys} mappings -> MixtureSources: each key typed by the schema, names unique,
    weights positive (they are shares of the tokens); which sources can be read is checked when they are opened."""
    example = "e.g. [{name: code, weight: 0.7, dataset_type: grain, dataset_path: 'code/*.jsonl'}, ...]"
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{name}={value!r}: expected a list of sources, {example}")
    sources: list[MixtureSource] = []
    for index, entry in enumerate(value):
        where = f"{name}[{index}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ConfigError(f"{where}={entry!r}: each source is a mapping with a non-empty name, {example}")
        where = f"{name} source {entry['name']!r}"
        unknown = sorted(set(entry) - {"name", "weight", *SOURCE_KEYS})
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r}; a source takes name, weight and "
                              f"{', '.join(SOURCE_KEYS)}")
        weight = entry.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
            raise ConfigError(f"{where}: weight={weight!r}; a weight must be a positive number (its share of the "
                              f"training tokens)")
        if entry["name"] in {s.name for s in sources}:
            raise ConfigError(f"{where}: the name is used twice; every source needs its own name")
        keys = tuple(sorted((key, _coerce(key, v)) for key, v in entry.items() if key in SOURCE_KEYS))
        sources.append(MixtureSource(entry["name"], float(weight), keys))
    return tuple(sources)


def source_config(config: Config, source: MixtureSource) -> Config:
    """The single-source config a mixture source reads: the run's keys with the source's data keys over them."""
    return dataclasses.replace(config, dataset_mixture=(), **dict(source.keys))


def _coerce_rules(name: str, value: Any) -> tuple[AxisRule, ...]:
    example = "e.g. [[embed, [fsdp]], [mlp, [tensor]]]"
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{name}: expected a list of [logical_name, [mesh axes]] rules, {example}")
    rules = []
    for rule in value:
        ok = isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)
        axes = rule[1] if ok else None
        if isinstance(axes, str):
            axes = [axes]
        if axes is None:
            axes = [] if ok else None
        if not ok or not isinstance(axes, (list, tuple)) or not all(isinstance(a, str) for a in axes):
            raise ConfigError(f"{name}: bad rule {rule!r}; each rule is [logical_name, [mesh axes]], {example}")
        unknown = [a for a in axes if a not in PHYSICAL_AXES]
        if unknown:
            raise ConfigError(f"{name}: rule {rule!r} names unknown mesh axis {unknown[0]!r}; "
                              f"mesh axes are {', '.join(PHYSICAL_AXES)}")
        if unknown_logical([rule[0]]):
            raise ConfigError(f"{name}: rule {rule!r} names unknown logical axis {rule[0]!r}; logical axes are "
                              f"{', '.join(Logical)}")
        if len(set(axes)) != len(axes):
            raise ConfigError(f"{name}: rule {rule!r} names a mesh axis twice; an array dimension can be split "
                              f"over each mesh axis at most once")
        rules.append((rule[0], tuple(axes)))
    return tuple(rules)


# ---------------------------------------------------------------- validation

def _validate_mixture(config: Config) -> None:
    """Every source of dataset_mixture is a valid text, grain or hf source on its own."""
    for source in config.dataset_mixture:
        try:
            validate(source_config(config, source))
        except ConfigError as e:
            raise ConfigError(f"dataset_mixture source {source.name!r}: {e}") from None
        if source_config(config, source).dataset_type == "synthetic":
            raise ConfigError(f"dataset_mixture source {source.name!r}: dataset_type=synthetic cannot be mixed; "
                              f"a source is text, grain or hf")


def validate(config: Config) -> None:
    """Ranges, choices and cross-key rules that need no devices."""
    for name, field in FIELDS.items():
        value, meta = getattr(config, name), field.metadata
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}={value!r}: must be a finite number")
        if meta["choices"] is not None and value not in meta["choices"]:
            raise ConfigError(f"{name}={value!r}: must be one of "
                              f"{', '.join(repr(c) if c == '' else str(c) for c in meta['choices'])}")
        if value in meta["allow"]:
            continue
        if meta["min"] is not None and value < meta["min"]:
            raise ConfigError(f"{name}={value!r}: must be >= {meta['min']}")
        if meta["max"] is not None and value > meta["max"]:
            raise ConfigError(f"{name}={value!r}: must be <= {meta['max']}")
    if sorted(config.mesh_axes) != sorted(PHYSICAL_AXES):
        raise ConfigError(f"mesh_axes={list(config.mesh_axes)}: must be a permutation of {', '.join(PHYSICAL_AXES)}")
    gqa = config.attention_type == "gqa"  # mla reads neither head_dim nor num_kv_heads
    if gqa and config.head_dim % 2:
        raise ConfigError(f"head_dim={config.head_dim}: must be even (RoPE rotates pairs of the head's features)")
    if gqa and config.num_query_heads % config.num_kv_heads:
        raise ConfigError(f"num_query_heads={config.num_query_heads} must be a multiple of "
                          f"num_kv_heads={config.num_kv_heads}")
    for level, degrees in (("ici", config.ici_parallelism()), ("dcn", config.dcn_parallelism())):
        for axis, degree in degrees.items():
            if degree == 0:
                raise ConfigError(f"{level}_{axis}_parallelism=0: must be a positive degree or -1 (fill)")
        fills = [axis for axis, degree in degrees.items() if degree == -1]
        if len(fills) > 1:
            raise ConfigError(f"at most one {level}_*_parallelism may be -1; got -1 for "
                              + ", ".join(f"{level}_{a}_parallelism" for a in fills))
    if config.dataset_type == "synthetic" and config.vocab_size <= SYNTHETIC_FIRST_TOKEN:
        raise ConfigError(f"vocab_size={config.vocab_size}: dataset_type=synthetic draws tokens from "
                          f"[{SYNTHETIC_FIRST_TOKEN}, vocab_size), so it must be > {SYNTHETIC_FIRST_TOKEN}")
    _validate_moe(config)
    _validate_routing(config)
    _validate_rope_scaling(config)
    if config.dataset_type == "text" and not config.dataset_path:
        raise ConfigError("dataset_type=text needs dataset_path (a glob of text files)")
    if config.dataset_type == "grain" and not (config.dataset_path and config.dataset_text_field):
        raise ConfigError(f"dataset_type=grain needs dataset_path (a glob of {config.grain_file_type} shards) and "
                          f"dataset_text_field (got {config.dataset_text_field!r})")
    if config.dataset_type == "hf" and not (config.hf_path and config.dataset_text_field and config.hf_train_split):
        raise ConfigError(f"dataset_type=hf needs hf_path (a save_to_disk directory or a builder such as json), "
                          f"dataset_text_field and hf_train_split (got hf_path={config.hf_path!r}, "
                          f"dataset_text_field={config.dataset_text_field!r}, "
                          f"hf_train_split={config.hf_train_split!r})")
    _validate_mixture(config)
    _validate_attention(config)
    _validate_mla(config)
    _validate_pipeline(config)
    _validate_post_training(config)
    _validate_profiler(config)
    if storage.is_remote(config.local_checkpoint_directory):
        raise ConfigError(f"local_checkpoint_directory={config.local_checkpoint_directory!r}: must be a node-local "
                          f"path (a local disk of each host), not a bucket; checkpoint_period's persistent tier goes "
                          f"to base_output_directory")
    if config.load_parameters_path and config.load_full_state_path:
        raise ConfigError(f"load_parameters_path={config.load_parameters_path!r} and load_full_state_path="
                          f"{config.load_full_state_path!r}: set at most one (parameters only, or the full state)")


def _validate_post_training(config: Config) -> None:
    """SFT, DPO and LoRA against the other keys (the roles LoRA names are checked against the model when traced)."""
    mode = "use_sft=true" if config.use_sft else "use_dpo=true" if config.use_dpo else ""
    if config.use_sft and config.use_dpo:
        raise ConfigError("use_sft=true and use_dpo=true: choose one (SFT first, then DPO from its checkpoint with "
                          "load_parameters_path=)")
    if mode:
        if config.dataset_mixture:
            raise ConfigError(f"{mode} with dataset_mixture: post-training reads one source of records; set "
                              f"dataset_mixture=[]")
        if config.dataset_type not in ("grain", "hf") or (config.dataset_type == "grain"
                                                          and config.grain_file_type != "jsonl"):
            raise ConfigError(f"{mode} with dataset_type={config.dataset_type}"
                              + (f" grain_file_type={config.grain_file_type}" if config.dataset_type == "grain" else "")
                              + ": its records are read from JSON Lines (dataset_type=grain grain_file_type=jsonl) "
                                "or a Hugging Face dataset (dataset_type=hf, e.g. hf_path=parquet for Parquet files)")
        if config.mtp_num_layers:
            raise ConfigError(f"{mode} with mtp_num_layers={config.mtp_num_layers}: the MTP modules' loss is not "
                              f"masked to the trained tokens; set mtp_num_layers=0")
    if config.use_dpo and config.z_loss_weight:
        raise ConfigError(f"use_dpo=true with z_loss_weight={config.z_loss_weight:g}: DPO's pair loss takes no z-loss; "
                          f"set z_loss_weight=0")
    if config.use_dpo and config.pipeline_schedule in EXPLICIT_BACKWARD:
        raise ConfigError(f"use_dpo=true with pipeline_schedule={config.pipeline_schedule}: DPO's reference pass and "
                          f"pair loss run under pipeline_schedule=gpipe or circular")
    if config.lora_rank and config.pipeline_schedule in EXPLICIT_BACKWARD:
        raise ConfigError(f"lora_rank={config.lora_rank} with pipeline_schedule={config.pipeline_schedule}: that "
                          f"schedule computes every stage weight's gradient; LoRA runs pipeline_schedule=gpipe or "
                          f"circular")
    if not config.lora_rank and config.lora_base_weight_dtype:
        raise ConfigError(f"lora_base_weight_dtype={config.lora_base_weight_dtype} needs lora_rank > 0 (it is the "
                          f"dtype of LoRA's frozen base weights)")
    if config.lora_rank and not config.lora_target_roles:
        raise ConfigError(f"lora_rank={config.lora_rank} with lora_target_roles=[]: name the roles that get "
                          f"adapters, e.g. [query, key, value, attention_out]")


def _validate_profiler(config: Config) -> None:
    last = config.profiler_start_step + config.profiler_steps - 1
    if config.profiler and last > config.steps:
        raise ConfigError(f"profiler={config.profiler} traces steps {config.profiler_start_step}-{last} "
                          f"(profiler_start_step={config.profiler_start_step}, profiler_steps={config.profiler_steps}) "
                          f"but the run has steps={config.steps}: the window must end by step {config.steps}")


def _validate_rope_scaling(config: Config) -> None:
    """llama3 and yarn scaling interpolate between two bounds, which must be ordered."""
    if config.rope_scaling_type == "llama3" and not 0 < config.rope_low_freq_factor < config.rope_high_freq_factor:
        raise ConfigError(f"rope_low_freq_factor={config.rope_low_freq_factor}, rope_high_freq_factor="
                          f"{config.rope_high_freq_factor}: rope_scaling_type=llama3 needs "
                          f"0 < rope_low_freq_factor < rope_high_freq_factor (Llama 3.1 uses 1 and 4)")
    if config.rope_scaling_type == "yarn" and not 0 < config.rope_yarn_beta_slow < config.rope_yarn_beta_fast:
        raise ConfigError(f"rope_yarn_beta_fast={config.rope_yarn_beta_fast}, rope_yarn_beta_slow="
                          f"{config.rope_yarn_beta_slow}: rope_scaling_type=yarn needs 0 < rope_yarn_beta_slow < "
                          f"rope_yarn_beta_fast (DeepSeek-V3 uses 1 and 32)")


def _validate_mla(config: Config) -> None:
    """Multi-head latent attention's keys; num_kv_heads and head_dim are ignored under it."""
    if config.attention_type != "mla":
        return
    if config.kv_lora_rank <= 0:
        raise ConfigError(f"kv_lora_rank={config.kv_lora_rank}: attention_type=mla needs kv_lora_rank > 0 (the "
                          f"width of the compressed key/value latent; DeepSeek-V3 uses 512)")
    if config.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim={config.qk_rope_head_dim}: must be even (RoPE rotates pairs)")
    if config.qk_norm:
        raise ConfigError("qk_norm=true with attention_type=mla: MLA normalizes its compressed q and kv instead; "
                          "set qk_norm=false")
    if config.attention not in MLA_ATTENTION:
        raise ConfigError(f"attention={config.attention} with attention_type=mla: MLA's values are narrower or "
                          f"wider than its queries and keys, which only {' and '.join(MLA_ATTENTION)} support")


def _validate_moe(config: Config) -> None:
    """Mixture-of-experts keys that must agree with each other (the mesh is checked at setup)."""
    if config.num_experts_per_tok > config.num_experts:
        raise ConfigError(f"num_experts_per_tok={config.num_experts_per_tok} > num_experts={config.num_experts}: "
                          f"a token can be routed to at most num_experts experts")
    dense, layers = config.first_num_dense_layers, config.num_decoder_layers
    if dense and config.num_experts == 1:
        raise ConfigError(f"first_num_dense_layers={dense} with num_experts=1: every layer is dense already; set "
                          f"first_num_dense_layers=0, or num_experts > 1 for MoE layers after the dense prefix")
    if dense >= layers:
        raise ConfigError(f"first_num_dense_layers={dense} with num_decoder_layers={layers}: at least one MoE "
                          f"layer must follow the dense prefix; allowed: 0 to {layers - 1}")
    stacked = config.num_stack_layers
    if config.num_experts > 1 and stacked % config.moe_layer_interval:
        after = f" after first_num_dense_layers={dense}" if dense else ""
        raise ConfigError(f"moe_layer_interval={config.moe_layer_interval} does not divide the {stacked} layers"
                          f"{after} (num_decoder_layers={layers}): the MoE layer stack is made of blocks of "
                          f"moe_layer_interval layers (the last one MoE); allowed: a divisor of {stacked}")


def _validate_routing(config: Config) -> None:
    """Group-limited routing must leave every token at least num_experts_per_tok experts to choose from."""
    groups, kept, experts, k = (config.n_routing_groups, config.topk_routing_group, config.num_experts,
                                config.num_experts_per_tok)
    if config.num_experts == 1 or groups <= 1:
        return
    if experts % groups or experts // groups < 2:
        raise ConfigError(f"n_routing_groups={groups} with num_experts={experts}: the groups must split the experts "
                          f"evenly, at least 2 per group (a group scores its two best); allowed: 0, 1, or a divisor "
                          f"of {experts} up to {experts // 2}")
    if not 1 <= kept <= groups:
        raise ConfigError(f"topk_routing_group={kept} with n_routing_groups={groups}: allowed 1 to {groups}")
    if k > kept * (experts // groups):
        raise ConfigError(f"num_experts_per_tok={k} with topk_routing_group={kept} of n_routing_groups={groups}: the "
                          f"kept groups hold only {kept * (experts // groups)} experts; allowed: topk_routing_group >= "
                          f"{-(-k // (experts // groups))}")


def _validate_attention(config: Config) -> None:
    """What the kernels (cuDNN flash, splash) support, as far as the config alone can tell (the sequence a device
    holds and the devices: at setup)."""
    name = f"attention={config.attention}"
    if config.attention == "splash":
        for key in ("sa_block_q", "sa_block_kv"):
            if getattr(config, key) % SPLASH_LANES:
                raise ConfigError(f"{key}={getattr(config, key)}: the splash kernel's blocks are multiples of "
                                  f"{SPLASH_LANES} (e.g. 512 or 1024)")
    if config.attention not in CUDNN_ATTENTION:
        return
    if config.dtype not in ("bfloat16", "float16"):
        raise ConfigError(f"{name} with dtype={config.dtype}: cuDNN flash attention computes in bfloat16 or "
                          f"float16 only; set dtype=bfloat16 or use attention=dot_product / xla")
    if config.head_dim % 8 or config.head_dim > 256:
        raise ConfigError(f"{name} with head_dim={config.head_dim}: cuDNN flash attention needs head_dim a "
                          f"multiple of 8 and <= 256 (<= 128 before Hopper)")
    if config.attention == "cudnn_flash" and config.max_target_length % 2:
        raise ConfigError(f"{name} with max_target_length={config.max_target_length}: cuDNN trains attention "
                          f"with a bias (the packed-document mask) only for even sequence lengths")
    if config.attention == "cudnn_flash_causal" and config.dataset_type != "synthetic":
        raise ConfigError(f"{name} with dataset_type={config.dataset_type}: this mask is causal only and would let "
                          f"a token attend to the previous documents packed into its row; use "
                          f"attention=cudnn_flash (packed-document mask) or dataset_type=synthetic (one document per row)")


def _validate_pipeline(config: Config) -> None:
    """Pipeline keys that must agree with each other whatever the mesh (the stages: `maxpar.core.layout`)."""
    layers, repeats = config.num_stack_layers, config.num_pipeline_repeats
    if repeats > 1 and layers % repeats:
        prefix = f" - first_num_dense_layers={config.first_num_dense_layers}" if config.first_num_dense_layers else ""
        raise ConfigError(f"num_pipeline_repeats={repeats}: the {layers} stacked layers (num_decoder_layers="
                          f"{config.num_decoder_layers}{prefix}) "
                          f"must be divisible by it (each stage runs {repeats} blocks of layers / (stages x repeats) "
                          f"layers)")
    if config.pipeline_fsdp_ag_once and config.pipeline_fsdp_ag_per_repeat:
        raise ConfigError("pipeline_fsdp_ag_once=true and pipeline_fsdp_ag_per_repeat=true: choose one way to gather "
                          "the stage weights (once per step, or once per repeat; both false: every iteration)")
    if repeats > 1 and not config.scan_layers:
        raise ConfigError(f"num_pipeline_repeats={repeats} needs scan_layers=true (pipelining runs the scanned "
                          f"layer stack)")
    _validate_pipeline_schedule(config)


def _validate_pipeline_schedule(config: Config) -> None:
    """pipeline_schedule against num_pipeline_repeats (circular is R > 1) and what 1f1b runs (no MoE MTP modules)."""
    kind, repeats = config.pipeline_schedule, config.num_pipeline_repeats
    if kind in ("circular", "interleaved_1f1b") and repeats == 1:
        raise ConfigError(f"pipeline_schedule={kind} needs num_pipeline_repeats > 1 (the blocks each stage runs)")
    if kind in ("gpipe", "1f1b", "zero_bubble") and repeats > 1:
        raise ConfigError(f"pipeline_schedule={kind} with num_pipeline_repeats={repeats}: {kind} runs one block per "
                          f"stage; set num_pipeline_repeats=1, or pipeline_schedule=circular or interleaved_1f1b")
    if kind in EXPLICIT_BACKWARD and config.mtp_num_layers > 0 and config.num_experts > 1:
        raise ConfigError(f"pipeline_schedule={kind} with mtp_num_layers={config.mtp_num_layers} and "
                          f"num_experts={config.num_experts}: the {kind} loss head runs dense MTP modules only (it "
                          f"does not collect an MoE MTP layer's routing statistics); use pipeline_schedule=gpipe or "
                          f"circular, mtp_num_layers=0 or num_experts=1")


def to_yaml(config: Config) -> str:
    """Every key with its value, for logs and checkpoints."""
    return OmegaConf.to_yaml(OmegaConf.create(config.to_dict()))


def describe_keys() -> list[tuple[str, str, str]]:
    """(key, type, doc) for every key: used by `--help` and the base.yml test."""
    return [(name, _type_name(_HINTS[name]), field.metadata["doc"]) for name, field in FIELDS.items()]

