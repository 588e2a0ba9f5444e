"""The transformer cut where a schedule with an explicit backward needs it: embedding, stage blocks, loss head.

`maxpar.pipeline.one_f_one_b` runs each stage's forward and backward itself, so it cannot be handed the whole
model as one function the way `maxpar.pipeline.spmd` is: it needs the block a stage runs and the head the last
stage runs, as functions of their own parameters. Those are the `Transformer`'s own parts (the rematerialized
layer unit stacked over a stage's layers, `RMSNorm`, `token_lookup`, `output_logits`), applied to the matching
subtrees of the same parameter tree, so a 1F1B or zero-bubble run trains and checkpoints the same parameters as
any other.

Inside the executor every mesh axis is manual (a device is one stage of one replica), so the blocks and the head
run with no layout: as on one device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from maxpar.core.axes import RESIDUAL
from maxpar.core.config import ModelConfig
from maxpar.core.layout import ModelLayout
from maxpar.core.op_schedule import OpSchedule
from maxpar.model.layers import RMSNorm
from maxpar.model.stack import STACKED, layer_stack, num_units
from maxpar.model.transformer import DECODER, decoder_unit, output_logits, rematerialized, token_lookup
from maxpar.pipeline.one_f_one_b import one_f_one_b

Array = jax.Array
Batch = dict[str, Array]
# loss_fn(logits [b, T, V] float32, targets, segment_ids) -> (objective, sums): what the step differentiates
LossFn = Callable[[Array, Array, Array], tuple[Array, Any]]
HEAD_KEYS = ("final_norm", "output", "token_embedding")  # what the last stage's loss head may read


def block_fn(config: ModelConfig, layers: int) -> Callable[..., Array]:
    """(stage params [layers, ...], x, positions, segment_ids) -> x after `layers` of the decoder's units."""
    unit, kwargs = decoder_unit(config)
    block = layer_stack(rematerialized(config, unit), layers)(config, None, **kwargs)

    def run(params: Any, x: Array, positions: Array, segment_ids: Array) -> Array:
        return block.apply({"params": params}, x, positions, segment_ids)[0]
    return run


def head_fn(config: ModelConfig, loss_fn: LossFn) -> Callable[..., tuple[Array, Any]]:
    """(head params, x, targets, segment_ids) -> loss_fn of the logits: final norm, output projection
    (the embedding table when logits_via_embedding), then the loss."""
    def run(head: dict, x: Array, targets: Array, segment_ids: Array) -> tuple[Array, Any]:
        x = RMSNorm(config, None).apply({"params": head["final_norm"]}, x)
        out = head["token_embedding" if config.logits_via_embedding else "output"]
        return loss_fn(output_logits(config, x, out), targets, segment_ids)
    return run


def embed(config: ModelConfig, layout: ModelLayout, table: Array, tokens: Array) -> Array:
    """The token lookup, as `Transformer` does it (the table is whole: no FSDP or tensor parallelism here)."""
    return layout.constrain(token_lookup(table, tokens, config.dtype), RESIDUAL)


def staged_grads(config: ModelConfig, layout: ModelLayout, schedule: OpSchedule, params: dict, batch: Batch,
                 loss_fn: LossFn) -> tuple[Any, dict]:
    """(sums of `loss_fn` over the batch, gradient of its objective w.r.t. `params`), by `schedule` run over
    the layout's pipeline stages: the same values as `jax.grad` of the unpipelined model's summed objective."""
    pipe = layout.pipeline
    table = params["token_embedding"]
    x, pull_embed = jax.vjp(lambda t: embed(config, layout, t, batch["inputs"]), table)
    head = {key: params[key] for key in HEAD_KEYS if key in params and (key != "token_embedding"
                                                                        or config.logits_via_embedding)}
    layers = num_units(config) // schedule.num_stages
    out = one_f_one_b(block_fn(config, layers), head_fn(config, loss_fn), params[DECODER][STACKED], head, x,
                      (batch["positions"], batch["segment_ids"]), (batch["targets"], batch["segment_ids"]),
                      schedule=schedule, mesh=layout.mesh.abstract(), stage_axes=pipe.stage_axes,
                      batch_axes=pipe.loop_batch_axes)
    (d_table,) = pull_embed(out.x)
    grads = {**params, **out.head, DECODER: {**params[DECODER], STACKED: out.stage}}
    grads["token_embedding"] = d_table + out.head["token_embedding"] if "token_embedding" in out.head else d_table
    return out.sums, grads


def staged_value_and_grad(model: Any, loss_fn: LossFn, kind: str
                          ) -> Callable[[Any, Any, Batch], tuple[tuple[Array, Any], tuple[Any, Any]]]:
    """`jax.value_and_grad(objective, argnums=(params, fp8_meta), has_aux=True)`'s contract, computed by the
    layout's explicit-backward schedule `kind` (1f1b, zero_bubble) instead of autodiff through the model:
    ((objective, sums), (grads, fp8 cotangents: none, fp8_scaling=delayed is refused with stages)). The
    objective is `sums["loss_sum"]`."""
    schedule = model.layout.pipeline.schedule
    ops = OpSchedule(kind, schedule.num_stages, schedule.num_microbatches)

    def run(params: Any, fp8_meta: Any, batch: Batch) -> tuple[tuple[Array, Any], tuple[Any, Any]]:
        sums, grads = staged_grads(model.config, model.layout, ops, params, batch, loss_fn)
        return (sums["loss_sum"], sums), (grads, jax.tree.map(jnp.zeros_like, fp8_meta))
    return run
