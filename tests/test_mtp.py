"""Multi-token prediction (DeepSeek-V3's MTP): the loss against a plain-jnp formula, training under gradient
accumulation, FSDP x TP and a pipeline equal to one device, sampling and the parameter tree untouched."""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from helpers import step_metrics, micro_config
from maxpar.core.config import model_config
from maxpar.generate import decode, model_apply
from maxpar.model.arithmetic import parameter_counts
from maxpar.model import Transformer
from maxpar.model.mtp import MTP, with_mtp_targets
from maxpar.model.roles import ParamRole
from maxpar.model.transformer import Decoder, DecoderLayer
from maxpar.training.train_step import objective, trace_state

L = 32


def packed_batch(vocab: int) -> dict[str, jax.Array]:
    """Two rows: two packed documents then padding, and one document filling the row."""
    rng = np.random.default_rng(0)
    segments = np.array([[1] * 10 + [2] * 14 + [0] * 8, [1] * L], np.int32)
    positions = np.array([list(range(10)) + list(range(14)) + [0] * 8, list(range(L))], np.int32)
    inputs = rng.integers(1, vocab, size=(2, L)).astype(np.int32)
    targets = rng.integers(1, vocab, size=(2, L)).astype(np.int32)
    return {key: jnp.asarray(v) for key, v in dict(inputs=inputs, targets=targets, positions=positions,
                                                   segment_ids=segments).items()}


def init_params(config, seed: int = 0):
    tokens = jnp.zeros((1, L), jnp.int32)
    return nn.unbox(Transformer(model_config(config)).init(jax.random.key(seed), tokens, tokens, tokens)["params"])


def reference_mtp_loss(config, params, batch) -> float:
    """The paper's formula written out: h_0 the stack's output before the final norm, module k's input
    RMSNorm(Emb(t_{i+k})) ++ RMSNorm(h_{k-1}) through W_k and its layer, its logits RMSNorm_k(h_k) @ output;
    cross-entropy against t_{i+k+1} where i+k is in the row and in i's document; summed, mean over k."""
    cfg, eps = model_config(config), config.normalization_layer_epsilon
    p = jax.tree.map(np.asarray, params)

    def rms(x, scale):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale

    inputs, targets, segments = (np.asarray(batch[k]) for k in ("inputs", "targets", "segment_ids"))
    table = p["token_embedding"]
    h = np.asarray(jax.jit(Decoder(cfg).apply)({"params": params["decoder"]}, jnp.asarray(table[inputs]),
                                                batch["positions"], batch["segment_ids"]))
    total = 0.0
    for k in range(1, config.mtp_num_layers + 1):
        m = p[MTP][f"module_{k}"]
        ahead = np.zeros_like(inputs)
        ahead[:, :L - k] = inputs[:, k:]
        joined = np.concatenate([rms(table[ahead], m["embedding_norm"]["scale"]),
                                 rms(h, m["hidden_norm"]["scale"])], axis=-1)
        h, _ = jax.jit(DecoderLayer(cfg).apply)({"params": params[MTP][f"module_{k}"]["layer"]},
                                       jnp.asarray(joined @ m["projection"]["kernel"]), batch["positions"],
                                       batch["segment_ids"])
        h = np.asarray(h)
        logits = rms(h, m["head_norm"]["scale"]) @ p["output"]
        for b in range(inputs.shape[0]):
            for i in range(L - k):
                if segments[b, i] != 0 and segments[b, i + k] == segments[b, i]:
                    row = logits[b, i].astype(np.float64)
                    top = row.max()
                    total += top + np.log(np.exp(row - top).sum()) - row[targets[b, i + k]]
    return total / config.mtp_num_layers


def test_mtp_loss_equals_the_formula_and_leaves_the_main_loss_alone():
    config = micro_config("mtp_num_layers=2", "mtp_loss_scaling_factor=0.3")
    params, batch = init_params(config), packed_batch(config.vocab_size)
    model = Transformer(model_config(config))
    total, sums = jax.jit(partial(objective, model=model, config=config))(params, {}, with_mtp_targets(batch, 2))
    np.testing.assert_allclose(sums["mtp_sum"], reference_mtp_loss(config, params, batch), rtol=1e-5)
    main = optax.softmax_cross_entropy_with_integer_labels(jax.jit(model.apply)({"params": params}, batch["inputs"],
                                                                       batch["positions"], batch["segment_ids"]),
                                                           batch["targets"])
    np.testing.assert_allclose(sums["loss_sum"], jnp.sum(jnp.where(batch["segment_ids"] != 0, main, 0)), rtol=1e-6)
    np.testing.assert_allclose(total, sums["loss_sum"] + 0.3 * sums["mtp_sum"], rtol=1e-6)


def test_mtp_off_leaves_the_parameters_and_their_initial_values_unchanged():
    off, on = micro_config(), micro_config("mtp_num_layers=1")
    assert off.mtp_num_layers == 0
    without, with_mtp = init_params(off), init_params(on)
    assert MTP not in without and MTP in with_mtp
    rest = {key: value for key, value in with_mtp.items() if key != MTP}
    jax.tree.map(np.testing.assert_array_equal, rest, without)
    counts = parameter_counts(trace_state(on).abstract.params)["total"]
    assert counts == parameter_counts(trace_state(off).abstract.params)["total"] + sum(
        x.size for x in jax.tree.leaves(with_mtp[MTP]))


def test_the_planner_counts_the_mtp_modules_by_role():
    from maxpar.plan.hardware import load_hardware
    from maxpar.plan.predict import Target, plan_layout
    config = micro_config("mtp_num_layers=2", "num_experts=4", "num_experts_per_tok=2")
    layout = plan_layout(config, Target(load_hardware("tpu-v5p"), 8, 1))  # refuses undeclared roles
    mtp = [t for t in layout.params() if f".{MTP}" in t.path or f"'{MTP}'" in t.path]
    assert {t.role for t in mtp} >= {ParamRole.MTP_PROJECTION, ParamRole.EXPERT_GATE, ParamRole.QUERY}
    assert sum(t.size for t in mtp) == sum(x.size for x in jax.tree.leaves(init_params(config)[MTP]))


def test_sampling_never_runs_the_mtp_modules():
    config = micro_config("mtp_num_layers=1", "max_new_tokens=4")
    params = init_params(config)
    apply = model_apply(Transformer(model_config(config)))
    prompts = [[5, 6, 7], [8, 9]]
    tokens = decode(apply, params, prompts, config, eos_id=-1).tokens
    scrambled = {**params, MTP: jax.tree.map(lambda x: x * 0 + 7.0, params[MTP])}
    assert decode(apply, scrambled, prompts, config, eos_id=-1).tokens == tokens
    plain = micro_config("max_new_tokens=4")
    without = {key: value for key, value in params.items() if key != MTP}
    assert decode(model_apply(Transformer(model_config(plain))), without, prompts, plain, eos_id=-1).tokens == tokens


# ---------------------------------------------------------------- training equals one device

MTP_ON = ("mtp_num_layers=1", "mtp_loss_scaling_factor=0.5")


def test_mtp_training_under_accumulation_pipeline_fsdp_and_tp_matches_one_device():
    """Four compiled train steps' losses, MTP losses and gradient norms of one run that has every property the MTP
    loss must survive (gradient accumulation sums its token counts, PP2 runs the modules after the last stage, FSDP2
    x TP2 splits their weights) equal the one-device run's: one compiled program proves them all."""
    metrics = ("loss", "grad_norm", "mtp_loss")
    want = step_metrics(jax.devices()[:1], 4, *MTP_ON, "per_device_batch_size=16", metrics=metrics)
    got = step_metrics(jax.devices(), 4, *MTP_ON, "per_device_batch_size=1", "gradient_accumulation_steps=2",
                       "ici_stage_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                       "num_pipeline_microbatches=2", metrics=metrics)
    assert want["loss"][-1] < want["loss"][0] and want["mtp_loss"][-1] < want["mtp_loss"][0]
    for metric in metrics:
        np.testing.assert_allclose(got[metric], want[metric], rtol=1e-5, err_msg=metric)
