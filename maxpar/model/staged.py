"""The transformer cut where a schedule with an explicit backward needs it: embedding, stage blocks, loss head.

`maxpar.pipeline.one_f_one_b` runs each stage's forward and backward itself, so it cannot be handed the whole
model as one function the way `maxpar.pipeline.spmd` is: it needs the block a stage runs and the head the last
stage runs, as functions of their own parameters. Those are the `Transformer`'s own parts (the rematerialized
layer unit stacked over a stage's layers, `RMSNorm`, `token_lookup`, `output_logits`), applied to the matching
subtrees of the same parameter tree, so a 1F1B or zero-bubble run trains and checkpoints the same parameters as
any other. The dense prefix (`decoder/dense_layers`) runs with the token lookup before the stages; a block's MoE
layers return their `moe_stats` sums, and `balance_objective` is their part of the step's objective.

Inside the executor the stages and the replicas' batch axes are manual (a device group is one stage of one
replica); the blocks and the head run under the layout's `ExecutorLayout.inner`, whose rules still split the
rows over FSDP and the heads and mlp over tensor parallelism there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from maxpar.core.axes import RESIDUAL, Logical
from maxpar.core.config import ModelConfig
from maxpar.core.layout import ModelLayout
from maxpar.core.op_schedule import OpSchedule
from maxpar.core.sharding import named_shardings
from maxpar.model.layers import RMSNorm
from maxpar.model.moe import MOE_STATS
from maxpar.model.mtp import MTP, MultiTokenPrediction, mtp_inputs, mtp_key, mtp_loss_sum
from maxpar.model.routing import balance_loss_from_sums
from maxpar.model.stack import DENSE, STACKED, layer_stack, num_units
from maxpar.model.transformer import (DECODER, FINAL_NORM, OUTPUT, TOKEN_EMBEDDING, DecoderLayer, decoder_unit,
                                      dense_prefix, embed, output_logits, output_weight, rematerialized, token_lookup)
from maxpar.pipeline.one_f_one_b import Placement, one_f_one_b

Array = jax.Array
Batch = dict[str, Array]
# loss_fn(logits [b, T, V] float32, targets, segment_ids) -> (objective, sums): what the step differentiates
LossFn = Callable[[Array, Array, Array], tuple[Array, Any]]
HEAD_KEYS = (FINAL_NORM, OUTPUT, TOKEN_EMBEDDING, MTP)  # what the last stage's loss head may read
# The head's logits keep their vocab whole: XLA's SPMD partitioner aborts on the loss's gather of vocab-split
# logits whose rows are split too, inside the executor's partly manual shard_map.
HEAD_LOGITS = (Logical.BATCH, Logical.LENGTH, None)


def block_fn(config: ModelConfig, layout: ModelLayout | None, layers: int) -> Callable[..., tuple[Array, Any]]:
    """(stage params [layers, ...], x, positions, segment_ids) -> (x after `layers` of the decoder's units, their
    MoE layers' `moe_stats` sums, leaves [layers, ...]: {} when dense), constrained by `layout`."""
    unit, kwargs = decoder_unit(config)
    block = layer_stack(rematerialized(config, unit), layers, collections=(MOE_STATS,))(config, layout, **kwargs)

    def run(params: Any, x: Array, positions: Array, segment_ids: Array) -> tuple[Array, Any]:
        (x, _), stats = block.apply({"params": params}, x, positions, segment_ids, mutable=[MOE_STATS])
        return x, stats.get(MOE_STATS, {})
    return run


def balance_objective(weight: float) -> Callable[[Any, Any], Array]:
    """(a microbatch's block stats, the step's totals of them) -> the block's part of the step's objective:
    weight x the step's tokens x its MoE layers' balance losses. The loss of a layer is a product of two
    whole-batch sums, so the part is taken linear in this microbatch's router probabilities, with the step's
    routed counts and tokens (constants to autodiff: top-k choices and a count): the parts of all microbatches
    add up to the unpipelined objective, and so do their gradients."""
    def run(stats: Any, totals: Any) -> Array:
        layers: dict[tuple[str, ...], dict[str, tuple[Array, Array]]] = {}
        for (path, mine), total in zip(jax.tree_util.tree_leaves_with_path(stats), jax.tree.leaves(totals)):
            keys = tuple(str(key.key) for key in path if hasattr(key, "key"))
            layers.setdefault(keys[:-1], {})[keys[-1]] = (mine, total)
        part = jnp.zeros((), jnp.float32)
        for layer in layers.values():
            if "expert_probability" in layer:
                routed, tokens = layer["expert_routed"][1], layer["balance_tokens"][1]
                part += jnp.sum(tokens * balance_loss_from_sums(routed, layer["expert_probability"][0], tokens))
        return weight * part
    return run


MTP_SIDE = ("inputs", "targets", "mask")  # per MTP module k, the `with_mtp_targets` arrays the head reads


def mtp_head_side(batch: Batch, num_layers: int) -> tuple[Array, ...]:
    """What the loss head reads beyond (targets, segment_ids) with MTP modules: positions (their decoder layers'),
    then per module k its `with_mtp_targets` arrays; () without MTP."""
    if not num_layers:
        return ()
    return (batch["positions"], *(batch[mtp_key(name, k)] for k in range(1, num_layers + 1) for name in MTP_SIDE))


def head_fn(config: ModelConfig, layout: ModelLayout | None, loss_fn: LossFn,
            mtp_weight: float = 0.0) -> Callable[..., tuple[Array, Any]]:
    """(head params, x, targets, segment_ids, *`mtp_head_side`) -> loss_fn of the logits: final norm, output
    projection (the embedding table when logits_via_embedding), then the loss. With MTP modules (head params
    `mtp`) they run on x as `Transformer` runs them, with the embedding table and the output projection: the
    objective adds mtp_weight x their `mtp_loss_sum`, the sums hold it as `mtp_sum`."""
    pin = (lambda a, axes: a) if layout is None else layout.constrain  # noqa: E731

    def run(head: dict, x: Array, targets: Array, segment_ids: Array, *mtp_side: Array) -> tuple[Array, Any]:
        x = pin(x, RESIDUAL)
        out = output_weight(config, head)

        def logits(h: Array) -> Array:
            return pin(output_logits(config, h, out), HEAD_LOGITS)

        normed = RMSNorm(config, layout).apply({"params": head[FINAL_NORM]}, x)
        objective, sums = loss_fn(logits(normed), targets, segment_ids)
        if MTP not in head:
            return objective, sums

        def lookup(ids: Array) -> Array:
            # the table as it comes, not gathered as `embed` gathers it: that gather inside the last stage's
            # branch leaves an FSDP group's devices waiting on different collectives (a hang at fsdp=4)
            return pin(token_lookup(head[TOKEN_EMBEDDING], ids, config.dtype), RESIDUAL)

        positions, arrays = mtp_side[0], iter(mtp_side[1:])
        batch = {mtp_key(name, k): next(arrays) for k in range(1, config.mtp_num_layers + 1) for name in MTP_SIDE}
        modules = MultiTokenPrediction(config, layout, layer=rematerialized(config, DecoderLayer),
                                       moe=config.num_experts > 1)
        mtp_logits = modules.apply({"params": head[MTP]}, x, mtp_inputs(batch, config.mtp_num_layers), positions,
                                   segment_ids, lookup, logits)
        mtp_sum = mtp_loss_sum(mtp_logits, batch)
        return objective + mtp_weight * mtp_sum, {**sums, "mtp_sum": mtp_sum}
    return run


def loss_segments(batch: Batch) -> Array:
    """The segment ids the loss head counts targets by: a post-training batch's are zeroed where its `loss_mask` is
    (the head's loss counts the targets of non-zero segments; the blocks attend by the real ids)."""
    if "loss_mask" not in batch:
        return batch["segment_ids"]
    return jnp.where(batch["loss_mask"] != 0, batch["segment_ids"], 0)


def before_stages(config: ModelConfig, layout: ModelLayout, prefix: dict, batch: Batch) -> Array:
    """What stage 0 receives: the token lookup, then the dense prefix (first_num_dense_layers), which runs
    outside the stages as in `Decoder`, on every device with the outer layout."""
    x = embed(config, layout, prefix[TOKEN_EMBEDDING], batch["inputs"])
    if DENSE not in prefix:
        return x
    return dense_prefix(config)(config, layout).apply({"params": prefix[DENSE]}, x, batch["positions"],
                                                      batch["segment_ids"])[0]


def staged_grads(config: ModelConfig, layout: ModelLayout, schedule: OpSchedule, params: dict, batch: Batch,
                 loss_fn: LossFn, block_objective: Callable[[Any, Any], Array] | None = None,
                 mtp_weight: float = 0.0) -> tuple[Any, dict]:
    """(sums of `loss_fn` over the batch, gradient of its objective w.r.t. `params`), by `schedule` run over
    the layout's pipeline stages: the same values as `jax.grad` of the unpipelined model's summed objective.
    With MoE layers the sums hold the stack's `moe_stats` too, as the model's collection nests them (leaves
    [L, ...]); `block_objective` (`balance_objective`) adds the balance loss to the objective. With MTP modules
    (a `with_mtp_targets` batch) the head runs them too (`head_fn`, weighted by mtp_weight)."""
    pipe = layout.pipeline
    prefix = {TOKEN_EMBEDDING: params[TOKEN_EMBEDDING], **({DENSE: params[DECODER][DENSE]}
                                                            if config.first_num_dense_layers else {})}
    x, pull_prefix = jax.vjp(lambda p: before_stages(config, layout, p, batch), prefix)
    head = {key: params[key] for key in HEAD_KEYS if key in params and (key != TOKEN_EMBEDDING
                                                                        or config.logits_via_embedding
                                                                        or config.mtp_num_layers)}
    layers, run = num_units(config) // schedule.num_blocks, pipe.executor
    stage_params = params[DECODER][STACKED]
    gathered = pipe.gathered_weight_specs()
    if gathered is not None:  # pipeline_fsdp_ag_once: gathered before the executor
        stage_params = jax.lax.with_sharding_constraint(stage_params, named_shardings(gathered, layout.mesh.abstract()))
    place = Placement(rows=NamedSharding(run.inner.mesh.abstract(), run.rows),
                      weights=pipe.executor_shardings(run.weights),
                      gathered=pipe.executor_shardings(run.gathered) if run.gathered else None)
    out = one_f_one_b(block_fn(config, run.inner, layers), head_fn(config, run.inner, loss_fn, mtp_weight),
                      stage_params, head, x, (batch["positions"], batch["segment_ids"]),
                      (batch["targets"], loss_segments(batch), *mtp_head_side(batch, config.mtp_num_layers)),
                      schedule=schedule, mesh=layout.mesh.abstract(), stage_axes=pipe.stage_axes,
                      batch_axes=run.batch_axes, block_objective=block_objective, placement=place)
    (d_prefix,) = pull_prefix(out.x)
    grads = {**params, **out.head, DECODER: {**params[DECODER], STACKED: out.stage}}
    if DENSE in d_prefix:
        grads[DECODER][DENSE] = d_prefix[DENSE]
    d_table = d_prefix[TOKEN_EMBEDDING]
    grads[TOKEN_EMBEDDING] = d_table + out.head[TOKEN_EMBEDDING] if TOKEN_EMBEDDING in out.head else d_table
    return ({**out.sums, MOE_STATS: {DECODER: {STACKED: out.stats}}} if out.stats else out.sums), grads


def staged_value_and_grad(model: Any, loss_fn: LossFn, balance_weight: float = 0.0, mtp_weight: float = 0.0
                          ) -> Callable[[Any, Any, Batch], tuple[tuple[Array, Any], tuple[Any, Any]]]:
    """`jax.value_and_grad(objective, argnums=(params, fp8_meta), has_aux=True)`'s contract, computed by the
    layout's explicit-backward op table (1f1b, zero_bubble, interleaved_1f1b) instead of autodiff through the
    model: ((objective, sums), (grads, fp8 cotangents: none, fp8_scaling=delayed is refused with stages)). The
    objective returned is `sums["loss_sum"]`; its gradient includes balance_weight (`balance_objective`'s) and
    mtp_weight x the MTP loss (`head_fn`'s)."""
    ops = model.layout.executor.ops
    aux = balance_objective(balance_weight) if model.config.num_experts > 1 and balance_weight else None

    def run(params: Any, fp8_meta: Any, batch: Batch) -> tuple[tuple[Array, Any], tuple[Any, Any]]:
        sums, grads = staged_grads(model.config, model.layout, ops, params, batch, loss_fn, aux, mtp_weight)
        return (sums["loss_sum"], sums), (grads, jax.tree.map(jnp.zeros_like, fp8_meta))
    return run
