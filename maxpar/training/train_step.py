"""Train state, loss, and the jitted train and eval steps with the run layout's shardings."""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import partial
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from maxpar.core.config import Config, model_config
from maxpar.core.layout import RunLayout, TracedState, resolve_layout, split_microbatches
from maxpar.core.mesh import MeshShape
from maxpar.core.sharding import logical_specs, named_shardings, replicated
from maxpar.model import Transformer
from maxpar.model.context_parallel import reorder_batch
from maxpar.model.fp8 import FP8_META, combine_observed, update_histories
from maxpar.model.moe import MOE_STATS, load_max_over_mean, moe_totals, routed_counts, routing_bias_update
from maxpar.model.mtp import MTP, mtp_inputs, mtp_loss_sum, with_mtp_targets
from maxpar.model.staged import loss_segments, staged_value_and_grad
from maxpar.model.transformer import stacked_layers
from maxpar.training import dpo, trainable
from maxpar.training.guards import judge_step
from maxpar.training.optimizer import learning_rate_schedule, make_optimizer

Batch = dict[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions")
LOSS_MASK = "loss_mask"  # post-training batches (use_sft, use_dpo): 1 on the targets the loss counts


def batch_keys(config: Config) -> tuple[str, ...]:
    """The [rows, length] int32 arrays of a batch of this run."""
    return BATCH_KEYS + ((LOSS_MASK,) if config.use_sft or config.use_dpo else ())


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    # fp8_scaling=delayed: the projections' amax histories (the model's FP8_META collection), updated by the step
    # from what it observed, not by the optimizer; {} otherwise.
    fp8_meta: Any = flax.struct.field(default_factory=dict)
    # The starting parameters the step never updates (LoRA's base, DPO's reference: maxpar.training.trainable);
    # {} otherwise. Not checkpointed: a restart reads them from load_parameters_path again.
    frozen: Any = flax.struct.field(default_factory=dict)


def init_state(model: nn.Module, tx: optax.GradientTransformation, config: Config, rng: jax.Array) -> TrainState:
    """Trained and frozen parameters (`trainable.split`), optimizer state and empty fp8 amax histories, still boxed
    with their logical axes."""
    tokens = jnp.zeros((1, config.max_target_length), jnp.int32)
    variables = model.init(rng, tokens, tokens, tokens)
    params, frozen = trainable.split(variables["params"], config)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      fp8_meta=variables.get(FP8_META, {}), frozen=frozen)


def trace_state(config: Config, tx: optax.GradientTransformation | None = None) -> TracedState:
    """The abstract train state of `config` with its logical axes: no devices, no memory.

    Initialization runs the layers in order whatever the layout, so the model needs none here.
    """
    tx = make_optimizer(config) if tx is None else tx
    boxed = jax.eval_shape(partial(init_state, Transformer(model_config(config)), tx, config), jax.random.key(0))
    trainable.check_lora_targets(trainable.policy(boxed.params, boxed.frozen, config), config)
    specs = logical_specs(boxed)
    model_specs = trainable.policy(specs.params, specs.frozen, config)  # what a pipeline splits into stages
    return TracedState(abstract=nn.unbox(boxed), specs=specs, stack_specs=stacked_layers(model_specs))


def run_layout(config: Config, mesh: MeshShape, tx: optax.GradientTransformation | None = None, *,
               check_batch: bool = True) -> RunLayout:
    """`config`'s run layout on a mesh of these degrees (`maxpar.core.layout.resolve_layout` on its traced state)."""
    return resolve_layout(config, mesh, trace_state(config, tx), check_batch=check_batch)


def layout_check(config: Config, tx: optax.GradientTransformation | None = None, *,
                 check_batch: bool = True) -> Callable[[MeshShape], RunLayout]:
    """`run_layout` of `config` on any candidate mesh, tracing the state once, on the first call: the whole-config
    check that `maxpar.core.mesh.local_mesh_shape` tries a device-count hint with."""
    traced = functools.cache(lambda: trace_state(config, tx))
    return lambda mesh: resolve_layout(config, mesh, traced(), check_batch=check_batch)


def create_state(model: nn.Module, tx: optax.GradientTransformation, layout: RunLayout, mesh: Mesh,
                 with_frozen: bool = True) -> TrainState:
    """Initialize directly into the sharded layout: no device ever holds the full model. with_frozen=False: no
    frozen parameters (never computed), for a caller that reads them from a checkpoint."""
    config = layout.config
    shardings = layout.state_shardings(mesh)

    def init(rng: jax.Array) -> TrainState:
        state = nn.unbox(init_state(model, tx, config, rng))
        return state if with_frozen else state.replace(frozen={})
    return jax.jit(init, out_shardings=shardings if with_frozen else shardings.replace(frozen={}))(
        jax.random.key(config.seed))


def loss_mask(batch: Batch) -> jax.Array:
    """The targets the loss counts: a post-training batch's `loss_mask` (SFT's assistant tokens, DPO's responses),
    else every real (non-padding) one."""
    return batch[LOSS_MASK] != 0 if LOSS_MASK in batch else batch["segment_ids"] != 0


def _cross_entropy(logits: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
    mask = loss_mask(batch)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(jnp.where(mask, losses, 0.0)), jnp.sum(mask).astype(jnp.float32)


def _token_losses(logits: jax.Array, targets: jax.Array, segment_ids: jax.Array, z_loss_weight: float = 0.0
                  ) -> tuple[jax.Array, dict]:
    """A microbatch's objective and metric sums from its logits: the summed cross-entropy, plus (z_loss_weight > 0)
    z_loss_weight x PaLM's z-loss, the summed (log Z)^2 of each counted token's softmax normalizer, which keeps the
    logits from drifting (its sum is `z_loss_sum`). The loss head of every schedule: `objective`'s, and that of a
    schedule that runs the backward itself (`maxpar.model.staged`). `segment_ids`: the loss's (`loss_segments`: 0
    where a post-training batch's loss_mask is), so both count the same targets."""
    loss_sum, count = _cross_entropy(logits, {"targets": targets, "segment_ids": segment_ids})
    sums = {"loss_sum": loss_sum, "tokens": count}
    if not z_loss_weight:
        return loss_sum, sums
    log_z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)  # the cross-entropy's own normalizer (XLA's CSE)
    z_loss_sum = jnp.sum(jnp.where(segment_ids != 0, jnp.square(log_z), 0.0))
    return loss_sum + z_loss_weight * z_loss_sum, sums | {"z_loss_sum": z_loss_sum}


def model_variables(params: Any, fp8_meta: Any = None) -> dict[str, Any]:
    """What the model is applied with: the parameters, and the fp8 amax histories when the run keeps them (without
    them a delayed-scaling model scales by current amaxes: evaluation and sampling)."""
    return {"params": params, FP8_META: fp8_meta} if fp8_meta else {"params": params}


def loss_sum_and_count(params: Any, model: nn.Module, batch: Batch, fp8_meta: Any = None
                       ) -> tuple[jax.Array, jax.Array]:
    """Summed float32 cross-entropy over real (non-padding) targets, and their count."""
    logits = model.apply(model_variables(params, fp8_meta), batch["inputs"], batch["positions"],
                         batch["segment_ids"])
    return _cross_entropy(logits, batch)


def objective(params: Any, fp8_meta: Any, batch: Batch, *, model: nn.Module, config: Config
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(what the gradient is taken of, the sums the metrics need) for one microbatch.

    Dense: the summed cross-entropy, plus z_loss_weight x the summed z-loss (`_token_losses`). MoE: plus
    load_balance_loss_weight x the load-balancing loss (mean over the MoE layers) x the microbatch's real
    tokens, so that dividing by the step's tokens adds the weighted,
    token-averaged balance loss to the mean cross-entropy. MTP (mtp_num_layers > 0, a `with_mtp_targets` batch):
    plus mtp_loss_scaling_factor x the modules' mean summed cross-entropy, divided by the step's tokens the same way.
    """
    moe = config.num_experts > 1
    outputs, variables = model.apply(model_variables(params, fp8_meta), batch["inputs"], batch["positions"],
                                     batch["segment_ids"], mtp_inputs(batch, config.mtp_num_layers),
                                     mutable=[MOE_STATS] if moe else [])
    logits, mtp_logits = outputs if config.mtp_num_layers else (outputs, None)
    total, sums = _token_losses(logits, batch["targets"], loss_segments(batch), config.z_loss_weight)
    count = sums["tokens"]
    if mtp_logits is not None:
        sums["mtp_sum"] = mtp_loss_sum(mtp_logits, batch)
        total = total + config.mtp_loss_scaling_factor * sums["mtp_sum"]
    if not moe:
        return total, sums
    balance_sum, moe = moe_sums(variables[MOE_STATS], count, config)
    return total + config.load_balance_loss_weight * balance_sum, sums | moe


def moe_sums(stats: Any, count: jax.Array, config: Config) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(the balance loss x the tokens, the step's MoE sums: balance, dropped and routed copies, each layer's
    routed counts) from a model's `moe_stats` collection, or the explicit-backward schedules' (their sums)."""
    # the balance loss is the layer stack's: the MTP layers' routers are trained by the MTP loss only
    totals = moe_totals({key: value for key, value in stats.items() if key != MTP})
    balance_sum = totals["load_balance_loss"] / config.num_moe_layers * count
    # every MoE layer's routed counts, the MTP layers' too: what the bias update and the load metrics read
    return balance_sum, {"balance_sum": balance_sum, "dropped": totals["dropped"], "routed": totals["routed"],
                         "expert_routed": routed_counts(stats)}


def _staged_grad_fn(model: nn.Module, config: Config) -> Callable:
    """The explicit-backward schedule's value_and_grad (`maxpar.model.staged`), with `objective`'s MoE sums."""
    grad_fn = staged_value_and_grad(model, partial(_token_losses, z_loss_weight=config.z_loss_weight),
                                    config.load_balance_loss_weight / max(config.num_moe_layers, 1),
                                    config.mtp_loss_scaling_factor)

    def run(params: Any, fp8_meta: Any, batch: Batch) -> tuple[tuple[jax.Array, dict], tuple[Any, Any]]:
        (value, sums), grads = grad_fn(params, fp8_meta, batch)
        if MOE_STATS in sums:
            rest = {key: sum_ for key, sum_ in sums.items() if key != MOE_STATS}
            sums = rest | moe_sums(sums[MOE_STATS], sums["tokens"], config)[1]
        return (value, sums), grads
    return run


def step_objective(model: nn.Module, config: Config, frozen: Any) -> Callable:
    """(trained params, fp8_meta, batch) -> (what the gradient is taken of, the metric sums): the run's objective,
    chosen in one place. DPO's pair loss against the frozen reference (maxpar.training.dpo), else `objective`; the
    model runs on the trained parameters joined to the frozen ones as `trainable.policy` says (LoRA)."""
    if config.use_dpo:
        return lambda params, fp8_meta, batch: dpo.objective(
            trainable.policy(params, frozen, config), trainable.reference(frozen), fp8_meta, batch, model=model,
            config=config, balance=partial(moe_sums, config=config))
    return lambda params, fp8_meta, batch: objective(trainable.policy(params, frozen, config), fp8_meta, batch,
                                                     model=model, config=config)


def _grads(params: Any, fp8_meta: Any, model: nn.Module, batch: Batch, config: Config, frozen: Any = None
           ) -> tuple[Any, Any, dict[str, jax.Array]]:
    """Gradient of the summed objective, the amaxes the fp8 matmuls observed (the amax histories' cotangents:
    maxpar.model.fp8) and the metric sums, accumulated over microbatches with a scan (the amaxes by max)."""
    batch = reorder_batch(with_mtp_targets(batch, config.mtp_num_layers), model.layout)
    if model.layout is not None and model.layout.executor:  # the schedule runs its backward: maxpar.model.staged
        grad_fn = _staged_grad_fn(model, config)
    else:
        grad_fn = jax.value_and_grad(step_objective(model, config, {} if frozen is None else frozen), argnums=(0, 1),
                                     has_aux=True)
    if config.gradient_accumulation_steps == 1:
        (_, sums), (grads, seen) = grad_fn(params, fp8_meta, batch)
        return grads, seen, sums

    def accumulate(carry, micro):
        grads_acc, seen_acc, sums_acc = carry
        (_, sums), (grads, seen) = grad_fn(params, fp8_meta, micro)
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
        return (grads_acc, combine_observed(seen_acc, seen), jax.tree.map(jnp.add, sums_acc, sums)), None

    micro = jax.tree.map(lambda x: split_microbatches(x, config.gradient_accumulation_steps), batch)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    sums_shape = jax.eval_shape(grad_fn, params, fp8_meta, jax.tree.map(lambda x: x[0], micro))[0][1]
    sums_init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape)
    init = (zeros, jax.tree.map(jnp.zeros_like, fp8_meta), sums_init)
    (grads, seen, sums), _ = jax.lax.scan(accumulate, init, micro)
    return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), seen, sums


def moe_metrics(sums: dict[str, jax.Array], count: jax.Array) -> dict[str, jax.Array]:
    """The step's MoE metrics (none for a dense model): balance loss, dropped token copies and their share, and
    the busiest expert's load over the mean load, averaged over the MoE layers and in the worst layer."""
    if "balance_sum" not in sums:
        return {}
    ratio = load_max_over_mean(sums["expert_routed"])
    return {"moe_load_balance_loss": sums["balance_sum"] / count, "moe_dropped_tokens": sums["dropped"],
            "moe_dropped_fraction": sums["dropped"] / jnp.maximum(sums["routed"], 1.0),
            "moe_load_max_over_mean": jnp.mean(ratio), "moe_load_max_over_mean_worst": jnp.max(ratio)}


def split_over_zero_axis(tree: Any, update_shardings: Any) -> Any:
    """ZeRO-1: constrain gradient-shaped arrays to the optimizer state's sharding (the parameters' plus the
    data axis), so the gradient is reduce-scattered over data, each replica updates its shard of the
    moments, and the updated parameters are all-gathered back to their own sharding."""
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, update_shardings)


def train_step(state: TrainState, batch: Batch, *, model: nn.Module, tx: optax.GradientTransformation,
               config: Config, update_shardings: Any = None) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on a global batch; loss is the mean cross-entropy over all its real tokens.

    The update is applied only if the step is judged good (`maxpar.training.guards.judge_step`: finite loss and
    gradient norm, no loss spike). A skipped step still counts (`step` advances: it indexes the data and the
    checkpoints) but leaves everything else bitwise as it was: the parameters (MoE routing biases included), the
    optimizer's moments and its count (so the learning-rate schedule, which follows the updates applied), the fp8
    amax histories. Only the guard's statistics move.

    update_shardings: with shard_optimizer_over_data (ZeRO-1), the shardings of gradients and updates (the
    layout's `update_specs` on the step's mesh).
    """
    grads, seen, sums = _grads(state.params, state.fp8_meta, model, batch, config, state.frozen)
    count = jnp.maximum(sums["tokens"], 1.0)
    grads = jax.tree.map(lambda g: g / count.astype(g.dtype), grads)
    if update_shardings is not None:
        grads = split_over_zero_axis(grads, update_shardings)
    loss, grad_norm = sums["loss_sum"] / count, optax.tree.norm(grads)
    guard = state.opt_state.guard
    verdict = judge_step(guard, loss, grad_norm, config.skip_step_on_spike_factor)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    if update_shardings is not None:
        updates = split_over_zero_axis(updates, update_shardings)
    params = optax.apply_updates(state.params, updates)
    if config.routed_bias and config.num_experts > 1:  # a dense model (routed_bias in its preset) has no routers
        params = routing_bias_update(params, sums["expert_routed"], config.routed_bias_update_rate)
    # what the update moves, kept as it was if the step is bad (the frozen parameters never move)
    moved = (params, opt_state, update_histories(state.fp8_meta, seen))
    params, opt_state, fp8_meta = jax.tree.map(lambda new, old: jnp.where(verdict.apply, new, old), moved,
                                               (state.params, state.opt_state, state.fp8_meta))
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state._replace(guard=verdict.guard),
                           fp8_meta=fp8_meta, frozen=state.frozen)
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "learning_rate": learning_rate_schedule(config)(state.step - guard.skipped),  # the updates applied so far
        "tokens": count,
        "skipped_nonfinite": verdict.guard.skipped_nonfinite,
        "skipped_spikes": verdict.guard.skipped_spikes,
        **moe_metrics(sums, count),
        **({"mtp_loss": sums["mtp_sum"] / count} if "mtp_sum" in sums else {}),
        **({"z_loss": sums["z_loss_sum"] / count} if "z_loss_sum" in sums else {}),
        **dpo.metrics(sums, count),
    }
    return new_state, metrics


def eval_step(params: Any, frozen: Any, batch: Batch, *, model: nn.Module, config: Config) -> dict[str, jax.Array]:
    """The loss sums of one held-out batch (DPO's: its pairs' loss and reward sums)."""
    batch = reorder_batch(batch, model.layout)
    policy = trainable.policy(params, frozen, config)
    if config.use_dpo:
        return dpo.objective(policy, trainable.reference(frozen), {}, batch, model=model, config=config)[1]
    loss_sum, count = loss_sum_and_count(policy, model, batch)
    return {"loss_sum": loss_sum, "tokens": count}


def jit_train_step(model: nn.Module, tx: optax.GradientTransformation, layout: RunLayout, mesh: Mesh):
    """The train step with the layout's in/out shardings on `mesh`; the input state is donated."""
    shardings = layout.state_shardings(mesh)
    update_shardings = None if layout.update_specs is None else named_shardings(layout.update_specs, mesh)
    step = partial(train_step, model=model, tx=tx, config=layout.config, update_shardings=update_shardings)
    return jax.jit(step,
                   in_shardings=(shardings, layout.input_sharding(mesh)),
                   out_shardings=(shardings, replicated(mesh)), donate_argnums=0)


def lower_train_step(model: nn.Module, tx: optax.GradientTransformation, layout: RunLayout, mesh: Mesh) -> Any:
    """The train step lowered for the layout's state and global batch on `mesh` (its program, before XLA)."""
    shardings = layout.state_shardings(mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), layout.state.abstract,
                         shardings)
    rows, length = layout.batch.global_rows, layout.config.max_target_length
    batch = {key: jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=layout.input_sharding(mesh))
             for key in batch_keys(layout.config)}
    return jit_train_step(model, tx, layout, mesh).lower(state, batch)


def compile_train_step(model: nn.Module, tx: optax.GradientTransformation, layout: RunLayout, mesh: Mesh) -> Any:
    """The train step compiled ahead of time for the layout's state and global batch on `mesh`."""
    return lower_train_step(model, tx, layout, mesh).compile()


def jit_eval_step(model: nn.Module, layout: RunLayout, mesh: Mesh):
    """(params, frozen, batch) -> `eval_step`'s sums, with the layout's shardings."""
    shardings = layout.state_shardings(mesh)
    return jax.jit(partial(eval_step, model=model, config=layout.config),
                   in_shardings=(shardings.params, shardings.frozen, layout.input_sharding(mesh)),
                   out_shardings=replicated(mesh))
