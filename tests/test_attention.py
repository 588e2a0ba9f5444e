"""The `attention` choices: same logits as the einsum core on CPU; cuDNN refused where it cannot run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import micro_config
from maxpar.core.config import ConfigError, model_config
from maxpar.core.layout import check_attention_sharding
from maxpar.model import Transformer
from maxpar.train import setup_run

LENGTH = 32


def packed_batch() -> tuple[jax.Array, jax.Array, jax.Array]:
    """Two rows: three packed documents plus padding (segment 0), and one document filling the row."""
    tokens = (jnp.arange(2 * LENGTH).reshape(2, LENGTH) * 7) % 250 + 3
    segments = jnp.array([[1] * 10 + [2] * 15 + [3] * 5 + [0] * 2, [1] * LENGTH], jnp.int32)
    positions = jnp.array([list(range(10)) + list(range(15)) + list(range(5)) + [0, 0], list(range(LENGTH))],
                          jnp.int32)
    return tokens, positions, segments


def random_params(config, tokens, positions, segments):
    """Parameters of the model's shapes drawn with NumPy (compiling the real init costs seconds)."""
    shapes = jax.eval_shape(Transformer(model_config(config)).init, jax.random.key(0), tokens, positions, segments)
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.3, s.shape), s.dtype), shapes)


def logits(config, params, tokens, positions, segments) -> np.ndarray:
    return np.asarray(jax.jit(Transformer(model_config(config)).apply)(params, tokens, positions, segments))


def test_sliding_window_is_the_same_in_both_cores():
    """The einsum mask and jax.nn.dot_product_attention's local window agree, and the window matters."""
    tokens, positions, segments = packed_batch()
    params = random_params(micro_config(), tokens, positions, segments)
    windowed = logits(micro_config("sliding_window=4"), params, tokens, positions, segments)
    got = logits(micro_config("sliding_window=4", "attention=xla"), params, tokens, positions, segments)
    np.testing.assert_allclose(got, windowed, rtol=1e-5, atol=1e-5)
    full = logits(micro_config(), params, tokens, positions, segments)
    np.testing.assert_allclose(windowed[1, :4], full[1, :4], rtol=1e-5, atol=1e-5)  # within the window: no change
    assert np.abs(windowed[1, 8:] - full[1, 8:]).max() > 1e-2


def test_xla_attention_logits_equal_the_einsum_core_with_packed_documents():
    reference = micro_config()  # float32, GQA (4 query heads share 2 kv heads)
    tokens, positions, segments = packed_batch()
    params = random_params(reference, tokens, positions, segments)
    expected = logits(reference, params, tokens, positions, segments)
    got = logits(micro_config("attention=xla"), params, tokens, positions, segments)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # The document mask is really applied: ignoring it changes the logits of the packed row.
    unpacked = logits(micro_config("attention=xla"), params, tokens, positions, jnp.ones_like(segments))
    assert np.abs(unpacked[0, 10:30] - expected[0, 10:30]).max() > 1e-2


@pytest.mark.parametrize("overrides, message", [
    (["attention=cudnn_flash"], "dtype=float32"),
    (["attention=cudnn_flash_causal", "dtype=bfloat16"], "dataset_type=text"),
    (["attention=cudnn_flash", "dtype=bfloat16", "head_dim=12"], "head_dim=12"),
    (["attention=cudnn_flash", "dtype=bfloat16", "max_target_length=33"], "max_target_length=33"),
    (["attention=flash"], "dot_product"),
])
def test_unsupported_cudnn_combinations_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        micro_config(*overrides)


def test_cudnn_attention_is_refused_at_setup_without_a_gpu():
    config = micro_config("attention=cudnn_flash_causal", "dtype=bfloat16", "dataset_type=synthetic")
    with pytest.raises(ConfigError, match="attention=cudnn_flash_causal: cuDNN flash attention needs GPU devices"):
        setup_run(config, jax.devices()[:1])


def test_cudnn_config_initializes_abstractly_on_cpu():
    """Init only needs shapes, so the planner can trace a cuDNN config on a machine without a GPU."""
    config = micro_config("attention=cudnn_flash", "dtype=bfloat16")
    tokens, positions, segments = packed_batch()
    shapes = jax.eval_shape(Transformer(model_config(config)).init, jax.random.key(0), tokens, positions, segments)
    assert shapes["params"]["token_embedding"].value.shape == (config.vocab_size, config.emb_dim)


def test_cudnn_refuses_sequence_or_head_dim_sharding():
    sequence = micro_config("attention=cudnn_flash", "dtype=bfloat16", "ici_tensor_parallelism=2",
                           "extra_logical_axis_rules=[[activation_attn_length, [tensor]]]")
    sizes = {"data": 1, "stage": 1, "fsdp": 4, "expert": 1, "tensor": 2}
    with pytest.raises(ConfigError, match="cannot shard activation_attn_length \\(here over tensor\\)"):
        check_attention_sharding(sequence, sequence.axis_rules, sizes)
    check_attention_sharding(sequence, sequence.axis_rules, {**sizes, "fsdp": 8, "tensor": 1})  # size 1 shards nothing
    heads = micro_config("attention=cudnn_flash", "dtype=bfloat16", "ici_tensor_parallelism=2")
    check_attention_sharding(heads, heads.axis_rules, sizes)  # heads over tensor is fine


def test_dot_product_gradient_equals_autodiff_of_its_formula():
    """masked_attention's custom VJP (flash attention's backward on whole matrices) against autodiff of the
    plain einsum-softmax-einsum formula, in float32 with packed documents and GQA."""
    from maxpar.model.attention import causal_document_mask, masked_attention

    def plain(q, k, v, mask):
        b, length, heads, d = q.shape
        kv = k.shape[2]
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q.reshape(b, length, kv, heads // kv, d), k)
        probs = jax.nn.softmax(jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min), axis=-1)
        return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(q.shape)

    kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (2, 16, 4, 8))
    k, v = jax.random.normal(kk, (2, 16, 2, 8)), jax.random.normal(kv, (2, 16, 2, 8))
    mask = causal_document_mask(jnp.array([[1] * 10 + [2] * 6, [1] * 16]))
    cotangent = jax.random.normal(kg, q.shape)
    ours, our_pullback = jax.vjp(lambda *a: masked_attention(*a, mask), q, k, v)
    want, pullback = jax.vjp(lambda *a: plain(*a, mask), q, k, v)
    np.testing.assert_allclose(ours, want, rtol=1e-6, atol=1e-6)
    for got, expected in zip(our_pullback(cotangent), pullback(cotangent)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("choice", ["dot_product", "blockwise"])
def test_values_may_be_wider_than_queries_and_keys(choice):
    """MLA's v_head_dim differs from its q/k width: output and gradients of the cores against autodiff of the
    plain formula, with packed documents and GQA."""
    from maxpar.model.attention import attend, causal_document_mask

    config = micro_config("attention_block_size=4")
    kq, kk, kv, kg = jax.random.split(jax.random.key(1), 4)
    q, k = jax.random.normal(kq, (2, 16, 4, 6)), jax.random.normal(kk, (2, 16, 2, 6))
    v = jax.random.normal(kv, (2, 16, 2, 10))
    segments = jnp.array([[1] * 10 + [2] * 6, [1] * 16])
    mask = causal_document_mask(segments)

    def plain(q, k, v):
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q.reshape(2, 16, 2, 2, 6), k)
        probs = jax.nn.softmax(jnp.where(mask[:, :, None], scores, -jnp.inf), axis=-1)
        return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(2, 16, 4, 10)

    cotangent = jax.random.normal(kg, (2, 16, 4, 10))
    ours, our_pullback = jax.vjp(lambda *a: attend(*a, segments, choice, config=config), q, k, v)
    want, pullback = jax.vjp(plain, q, k, v)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)
    for got, expected in zip(our_pullback(cotangent), pullback(cotangent)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
