"""Behaviour of the model and optimizer pieces that sharding-equivalence tests cannot catch.

Equivalence tests compare the model with itself under different meshes; these check what it computes:
causality, attention confined to packed documents, padding out of the loss, RoPE, and the optimizer's
schedule, clipping and weight-decay mask.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import tiny_config
from maxpar.core.config import model_config
from maxpar.model import Transformer
from maxpar.model.layers import apply_rope
from maxpar.training.optimizer import decay_mask, learning_rate_schedule, make_optimizer
from maxpar.training.train_step import loss_sum_and_count

LENGTH = 32


@pytest.fixture(scope="module")
def model_and_params():
    config = tiny_config()
    model = Transformer(model_config(config))
    tokens = jnp.zeros((1, LENGTH), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(1), tokens, tokens, tokens)["params"]
    return config, model, jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, params,
                                       is_leaf=lambda x: hasattr(x, "unbox"))


def test_the_model_config_has_no_parallelism_choice():
    """The model takes its sharding decisions from its layout: its config holds the run's model keys only."""
    config = tiny_config()
    model = model_config(config)
    names = {field.name for field in dataclasses.fields(model)}
    assert not {n for n in names if "parallel" in n or n.startswith("pipeline_") or "axis_rules" in n}
    assert all(getattr(model, name) == getattr(config, name) for name in names)
    hash(model)  # a Flax module attribute


def _logits(model, params, tokens, positions, segments):
    return np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(tokens)[None],
                                           jnp.asarray(positions)[None], jnp.asarray(segments)[None])[0])


def _random_tokens(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 259, LENGTH).astype(np.int32)


def test_future_tokens_do_not_change_earlier_logits(model_and_params):
    _, model, params = model_and_params
    tokens, positions, segments = _random_tokens(0), np.arange(LENGTH), np.ones(LENGTH, np.int32)
    changed = tokens.copy()
    changed[20:] = _random_tokens(1)[20:]
    before, after = (_logits(model, params, t, positions, segments) for t in (tokens, changed))
    np.testing.assert_array_equal(before[:20], after[:20])
    assert not np.allclose(before[20:], after[20:])


def test_packed_documents_do_not_see_each_other(model_and_params):
    """Document 2 (positions restarting at 0) gives the same logits whatever document 1 holds, and the same
    as when it is alone in its row."""
    _, model, params = model_and_params
    split = 12
    segments = np.array([1] * split + [2] * (LENGTH - split), np.int32)
    positions = np.concatenate([np.arange(split), np.arange(LENGTH - split)])
    tokens = _random_tokens(2)
    other_first = tokens.copy()
    other_first[:split] = _random_tokens(3)[:split]
    packed = _logits(model, params, tokens, positions, segments)
    np.testing.assert_allclose(packed[split:], _logits(model, params, other_first, positions, segments)[split:],
                               rtol=1e-6, atol=1e-6)
    alone = np.concatenate([tokens[split:], np.zeros(split, np.int32)])
    alone_logits = _logits(model, params, alone, np.arange(LENGTH), (np.arange(LENGTH) < LENGTH - split).astype(np.int32))
    np.testing.assert_allclose(packed[split:], alone_logits[:LENGTH - split], rtol=1e-5, atol=1e-5)


def test_padding_is_out_of_the_loss(model_and_params):
    """Appending padding rows (segment id 0) changes neither the summed loss nor the token count."""
    _, model, params = model_and_params
    tokens = np.stack([_random_tokens(4), _random_tokens(5)])
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1), "segment_ids": np.ones_like(tokens),
             "positions": np.broadcast_to(np.arange(LENGTH), tokens.shape)}
    padded = {key: np.concatenate([value, np.full((1, LENGTH), 7 if key != "segment_ids" else 0, np.int32)])
              for key, value in batch.items()}
    padded["segment_ids"][0, 24:] = 0  # and a padded tail inside a real row
    loss_fn = jax.jit(loss_sum_and_count, static_argnums=1)
    loss, count = loss_fn(params, model, jax.tree.map(jnp.asarray, batch))
    batch["segment_ids"] = batch["segment_ids"].copy()
    batch["segment_ids"][0, 24:] = 0
    expected_loss, expected_count = loss_fn(params, model, jax.tree.map(jnp.asarray, batch))
    padded_loss, padded_count = loss_fn(params, model, jax.tree.map(jnp.asarray, padded))
    assert float(count) == 2 * LENGTH and float(expected_count) == 2 * LENGTH - 8
    assert float(padded_count) == float(expected_count)
    np.testing.assert_allclose(float(padded_loss), float(expected_loss), rtol=1e-6)
    assert float(padded_loss) < float(loss)


def test_rope_matches_a_rotation_of_feature_pairs():
    """Feature i and i + D/2 rotate together by position x theta^(-i/(D/2)) (the half-split convention)."""
    rng = np.random.default_rng(0)
    heads, dim, theta = 2, 8, 10000.0
    x = rng.normal(size=(1, 5, heads, dim)).astype(np.float32)
    positions = np.array([[0, 1, 2, 7, 100]])
    out = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), theta))
    half = dim // 2
    expected = np.empty_like(x)
    for p_index, position in enumerate(positions[0]):
        for i in range(half):
            angle = position * theta ** (-i / half)
            a, b = x[0, p_index, :, i], x[0, p_index, :, i + half]
            expected[0, p_index, :, i] = a * np.cos(angle) - b * np.sin(angle)
            expected[0, p_index, :, i + half] = b * np.cos(angle) + a * np.sin(angle)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[0, 0], x[0, 0])  # position 0 is the identity


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(1)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 16)).astype(np.float32)) for _ in range(2))

    def score(pq: int, pk: int) -> float:
        return float(jnp.sum(apply_rope(q, jnp.array([[pq]]), 1e4) * apply_rope(k, jnp.array([[pk]]), 1e4)))
    assert score(5, 3) == pytest.approx(score(12, 10), rel=1e-5)
    assert score(5, 3) != pytest.approx(score(5, 4), rel=1e-3)


def test_learning_rate_schedule_warms_up_then_decays_to_the_final_fraction():
    config = tiny_config("learning_rate=1e-3", "warmup_steps=10", "steps=110", "learning_rate_final_fraction=0.1")
    schedule = learning_rate_schedule(config)
    assert float(schedule(0)) == 0.0
    assert float(schedule(5)) == pytest.approx(5e-4)
    assert float(schedule(10)) == pytest.approx(1e-3)
    assert float(schedule(60)) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5), rel=1e-5)  # cosine midpoint
    assert float(schedule(110)) == pytest.approx(1e-4, rel=1e-5)


def test_gradients_are_clipped_to_the_global_norm():
    """Adam's first moment after one step is (1 - b1) x the gradient the optimizer used: the clipped one."""
    grads = {"a": jnp.full((4,), 3.0), "b": jnp.full((2,), 4.0)}  # global norm sqrt(68)

    def first_moment_norm(threshold: float) -> float:
        tx = make_optimizer(tiny_config(f"gradient_clipping_threshold={threshold}", "adam_b1=0.9"))
        _, state = tx.update(grads, tx.init(grads), grads)
        (adam,) = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
                   if isinstance(s, optax.ScaleByAdamState)]
        return float(optax.tree.norm(adam.mu))
    assert first_moment_norm(1.0) == pytest.approx(0.1 * 1.0, rel=1e-5)
    assert first_moment_norm(0) == pytest.approx(0.1 * 68 ** 0.5, rel=1e-5)  # 0 = no clipping


def test_weight_decay_skips_norm_scales(model_and_params):
    _, _, params = model_and_params
    mask = decay_mask(params)
    flat = {jax.tree_util.keystr(path): value for path, value in jax.tree_util.tree_leaves_with_path(mask)}
    assert all(not decayed for path, decayed in flat.items() if "scale" in path)
    assert all(decayed for path, decayed in flat.items() if "scale" not in path)
    assert any("token_embedding" in path for path in flat) and flat["['token_embedding']"]



def _first_loss(model, params, vocab_size: int) -> float:
    from helpers import packed_batch

    batch = packed_batch(8, LENGTH, vocab_size)
    loss_sum, count = jax.jit(loss_sum_and_count, static_argnums=1)(params, model, batch)
    return float(loss_sum / count)


def test_a_fresh_model_starts_near_the_uniform_loss(model_and_params):
    """Step 1's loss is ln(vocab) plus about half the logits' variance (unit variance here), tied or not: tied
    embeddings once gave logits of std sqrt(emb_dim), a first loss of 41 here (~200 for qwen3-0.6b)."""
    config, untied_model, untied_params = model_and_params
    tied_model = Transformer(model_config(tiny_config("logits_via_embedding=true")))
    tokens = jnp.zeros((1, LENGTH), jnp.int32)
    tied_params = nn.unbox(jax.jit(tied_model.init)(jax.random.key(1), tokens, tokens, tokens)["params"])
    for model, params in ((untied_model, untied_params), (tied_model, tied_params)):
        assert abs(_first_loss(model, params, config.vocab_size) - np.log(config.vocab_size)) < 1.0
