"""Every axis name maxpar knows, defined once: the physical mesh axes and the logical names of array dims.

Model code names only `Logical` axes; `logical_axis_rules` (data, in configs/base.yml) map them to
physical mesh axes. A name outside this enum is an error wherever it appears (a rule, a parameter, an
activation constraint), so a typo can never silently leave an array unsharded.
"""

from __future__ import annotations

import enum


class Physical(enum.StrEnum):
    """The physical mesh axes (the values are what configs spell: `mesh_axes`, `ici_<axis>_parallelism`). Only
    config, mesh and layout name them; everything else asks the run layout."""

    DATA = "data"
    FSDP = "fsdp"
    TENSOR = "tensor"
    EXPERT = "expert"
    STAGE = "stage"
    CONTEXT = "context"


PHYSICAL_AXES = tuple(axis.value for axis in Physical)  # plain strings: configs, YAML and JSON hold them
STAGE_AXIS = Physical.STAGE      # the mesh axis whose degree is the number of pipeline stages
CONTEXT_AXIS = Physical.CONTEXT  # the mesh axis context parallelism splits the sequence over
ZERO_AXIS = Physical.DATA        # the mesh axis shard_optimizer_over_data (ZeRO-1) also splits the optimizer state over


class Logical(enum.StrEnum):
    """Logical names of array dimensions (the values are what configs and checkpoints spell)."""

    # activations
    BATCH = "activation_batch"
    LENGTH = "activation_length"            # the residual stream's sequence
    EMBED_ACT = "activation_embed"
    ATTN_LENGTH = "activation_attn_length"  # q, k, v sequence (may differ from the residual's: TP-sequence)
    HEADS_ACT = "activation_heads"
    KV_HEADS_ACT = "activation_kv_heads"
    HEAD_DIM_ACT = "activation_head_dim"
    MLP_LENGTH = "activation_mlp_length"    # the feed-forward hidden layer's sequence
    MLP_ACT = "activation_mlp"
    MLP_EMBED_ACT = "activation_mlp_embed"  # the feed-forward input and output's embed (TP-transpose splits it)
    VOCAB_ACT = "activation_vocab"
    # weights
    EMBED = "embed"
    MLP = "mlp"
    MLP_EMBED = "mlp_embed"                 # the dense feed-forward weights' embed dim (TP-transpose splits it)
    HEADS = "heads"
    KV_HEADS = "kv_heads"
    HEAD_DIM = "head_dim"
    VOCAB = "vocab"
    EXP = "exp"                             # the experts of a MoE layer
    NORM = "norm"
    LAYERS = "layers"                       # the stacked layer axis; pipeline stages split it
    REPEATS = "pipeline_repeats"            # a circular pipeline's R blocks per stage
    DENSE_LAYERS = "dense_layers"           # the stacked dense prefix (first_num_dense_layers): never the stages'
    LORA = "lora"                           # the low rank of multi-head latent attention's compressed q and kv
    ADAPTER = "adapter"                     # the rank of a LoRA adapter (lora_rank): small, never split


# Names configs/base.yml gives no rule: replicated unless a preset maps them (e.g. TP-transpose's mlp embed).
UNSHARDED_BY_DEFAULT = frozenset({Logical.EMBED_ACT, Logical.HEAD_DIM_ACT, Logical.MLP_EMBED_ACT, Logical.HEAD_DIM,
                                  Logical.NORM, Logical.REPEATS, Logical.LORA, Logical.ADAPTER,
                                  Logical.DENSE_LAYERS})

# The logical axes of the activations the model constrains.
BATCH_INPUT = (Logical.BATCH, Logical.LENGTH)                                  # [rows, length] token arrays
RESIDUAL = (Logical.BATCH, Logical.LENGTH, Logical.EMBED_ACT)
ATTN_Q = (Logical.BATCH, Logical.ATTN_LENGTH, Logical.HEADS_ACT, Logical.HEAD_DIM_ACT)
ATTN_KV = (Logical.BATCH, Logical.ATTN_LENGTH, Logical.KV_HEADS_ACT, Logical.HEAD_DIM_ACT)
MLP_HIDDEN = (Logical.BATCH, Logical.MLP_LENGTH, Logical.MLP_ACT)
MLP_IO = (Logical.BATCH, Logical.LENGTH, Logical.MLP_EMBED_ACT)  # the residual stream as the feed-forward sees it
LOGITS = (Logical.BATCH, Logical.LENGTH, Logical.VOCAB_ACT)


def unknown_logical(names) -> list[str]:
    """The names among `names` (None = an unsharded dim) that are not logical axes."""
    known = set(Logical)
    return [name for name in names if name is not None and name not in known]
