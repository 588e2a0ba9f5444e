"""Multi-head latent attention (attention_type=mla): the module against a plain-jnp reference, YaRN against its
formula and transformers, decoding from the latent cache, and sharded runs against one device."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import micro_config
from maxpar.core.config import ConfigError, model_config
from maxpar.model import Transformer
from maxpar.model.layers import rope_attention_factor, rope_inv_freq
from maxpar.model.mla import MultiHeadLatentAttention

MLA = ["attention_type=mla", "kv_lora_rank=24", "qk_nope_head_dim=12", "qk_rope_head_dim=8", "v_head_dim=20"]
YARN = ["rope_scaling_type=yarn", "rope_scaling_factor=40", "rope_original_max_position_embeddings=8",
        "rope_yarn_mscale=0.7", "rope_yarn_mscale_all_dim=1.0"]
LENGTH = 16


def rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rotate(x, positions, inv_freq, factor):
    """RoPE as Hugging Face writes it: x * cos + rotate_half(x) * sin, cos/sin = cat(freqs, freqs) * factor."""
    freqs = positions[:, :, None] * inv_freq[None, None, :]
    cos = np.concatenate([np.cos(freqs)] * 2, -1)[:, :, None] * factor
    sin = np.concatenate([np.sin(freqs)] * 2, -1)[:, :, None] * factor
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def yarn_formula(dim, theta, factor, original, beta_fast, beta_slow):
    """YaRN's inverse frequencies written out from the paper / DeepSeek-V3's reference code."""
    def correction(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = max(math.floor(correction(beta_fast)), 0), min(math.ceil(correction(beta_slow)), dim - 1)
    base = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 0.001), 0, 1)
    return base / factor * ramp + base * (1 - ramp)


def mscale(factor, m):
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def reference(p, x, positions, segments, c):
    """MLA in plain NumPy (float64), the scale applied to the scores, rope per Hugging Face's formula."""
    nope, rope = c.qk_nope_head_dim, c.qk_rope_head_dim
    eps = c.normalization_layer_epsilon
    if c.q_lora_rank:
        q = np.einsum("blr,rhd->blhd", rms(x @ p["query_a"], p["query_a_norm"]["scale"], eps), p["query_b"])
    else:
        q = np.einsum("ble,ehd->blhd", x, p["query"])
    compressed = x @ p["key_value_a"]
    latent = rms(compressed[..., :c.kv_lora_rank], p["key_value_a_norm"]["scale"], eps)
    kv = np.einsum("blr,rhd->blhd", latent, p["key_value_b"])
    scale = (nope + rope) ** -0.5
    if c.rope_scaling is None:
        inv_freq, factor = 1.0 / c.rope_theta ** (np.arange(0, rope, 2) / rope), 1.0
    else:
        s = c.rope_scaling
        inv_freq = yarn_formula(rope, c.rope_theta, s.factor, s.original_max_position_embeddings, s.beta_fast,
                                s.beta_slow)
        factor = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
        scale *= mscale(s.factor, s.mscale_all_dim) ** 2
    q_rope = rotate(q[..., nope:], positions, inv_freq, factor)
    k_rope = rotate(compressed[..., None, c.kv_lora_rank:], positions, inv_freq, factor)
    q = np.concatenate([q[..., :nope], q_rope], -1)
    k = np.concatenate([kv[..., :nope], np.broadcast_to(k_rope, kv.shape[:3] + (rope,))], -1)
    v = kv[..., nope:]
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    causal = np.arange(LENGTH)[:, None] >= np.arange(LENGTH)[None, :]
    visible = causal & (segments[:, :, None] == segments[:, None, :])
    scores = np.where(visible[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhvd,hde->bve", np.einsum("bhqk,bkhd->bqhd", probs, v).transpose(0, 2, 1, 3), p["out"])


def inputs(emb):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, LENGTH, emb)).astype(np.float32)
    positions = np.array([list(range(10)) + list(range(6)), list(range(LENGTH))])
    segments = np.array([[1] * 10 + [2] * 6, [1] * LENGTH])
    return x, positions, segments


@pytest.mark.parametrize("overrides", [[], ["q_lora_rank=20"], ["q_lora_rank=20", *YARN]],
                         ids=["direct_q", "q_lora", "q_lora_yarn"])
@pytest.mark.parametrize("attention", ["dot_product", "blockwise"])
def test_mla_equals_a_plain_reference(overrides, attention):
    config = model_config(micro_config(*MLA, *overrides, f"attention={attention}", "attention_block_size=4"))
    x, positions, segments = inputs(config.emb_dim)
    module = MultiHeadLatentAttention(config)
    params = nn.unbox(module.init(jax.random.key(1), x, positions, segments))["params"]
    params = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(2), a.shape), params)  # norms != 1
    got = module.apply({"params": params}, *map(jnp.asarray, (x, positions, segments)))
    want = reference(jax.tree.map(lambda a: np.asarray(a, np.float64), params), x.astype(np.float64), positions,
                     segments, config)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_yarn_inverse_frequencies_and_attention_factor():
    config = micro_config(*MLA, *YARN, "rope_theta=10000")
    s = config.rope_scaling
    want = yarn_formula(8, 10000.0, 40.0, 8, 32.0, 1.0)
    np.testing.assert_allclose(rope_inv_freq(4, 10000.0, s), want, rtol=1e-6)
    assert not np.allclose(want, 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8))  # the scaling changes something
    assert rope_attention_factor(s) == pytest.approx(mscale(40, 0.7) / mscale(40, 1.0))
    unset = micro_config(*MLA, *YARN, "rope_yarn_mscale_all_dim=0").rope_scaling
    assert rope_attention_factor(unset) == pytest.approx(0.1 * math.log(40) + 1)


def test_yarn_equals_transformers():
    """The inverse frequencies, attention factor and MLA softmax scale of transformers' DeepSeek-V3."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from maxpar.model.mla import softmax_scale

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.7, "mscale_all_dim": 1.0}
    hf = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=64, qk_nope_head_dim=32,
                                       v_head_dim=16, kv_lora_rank=16, rope_parameters=rope)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    config = model_config(micro_config(*MLA, "qk_rope_head_dim=64", "qk_nope_head_dim=32", "rope_scaling_type=yarn",
                                      "rope_scaling_factor=40", "rope_original_max_position_embeddings=64",
                                      "rope_yarn_mscale=0.7", "rope_yarn_mscale_all_dim=1.0"))
    np.testing.assert_allclose(rope_inv_freq(32, 10000.0, config.rope_scaling), inv_freq.numpy(), rtol=1e-6)
    assert rope_attention_factor(config.rope_scaling) == pytest.approx(factor)
    assert softmax_scale(config) == pytest.approx(yarn_apply_mscale(rope, 96 ** -0.5))


def test_cached_decoding_equals_the_full_forward():
    """Prefill 5 tokens, then decode one at a time from the latent cache: the logits of the full forward; and
    maxpar.generate's greedy tokens are the full forward's argmax."""
    from maxpar.generate import decode, model_apply

    run = micro_config(*MLA, "q_lora_rank=20", *YARN, f"max_new_tokens={LENGTH - 5}")
    config = model_config(run)
    model = Transformer(config)
    tokens = jnp.asarray((np.arange(2 * LENGTH).reshape(2, LENGTH) * 7) % 250 + 3, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(LENGTH), (2, LENGTH))
    ones = jnp.ones_like(tokens)
    params = model.init(jax.random.key(0), tokens, positions, ones)["params"]
    forward = jax.jit(lambda t: model.apply({"params": params}, t, positions, ones))
    apply = model_apply(model)
    logits, cache = apply(params, None, tokens[:, :5], positions[:, :5], ones[:, :5])
    got = [logits]
    leaves = jax.tree_util.tree_leaves_with_path(cache)
    assert sorted({jax.tree_util.keystr(path[-1:]) for path, _ in leaves}) == ["['key_rope']", "['latent']"]
    assert {leaf.shape[-2:] for _, leaf in leaves} == {(config.max_target_length, 24), (config.max_target_length, 8)}
    for i in range(5, LENGTH):
        logits, cache = apply(params, cache, tokens[:, i:i + 1], positions[:, i:i + 1], ones[:, i:i + 1])
        got.append(logits)
    np.testing.assert_allclose(jnp.concatenate(got, axis=1), forward(tokens), rtol=1e-4, atol=1e-4)

    new = decode(apply, params, np.asarray(tokens[:, :5]).tolist(), run, eos_id=-1).tokens
    generated = jnp.concatenate([tokens[:, :5], jnp.asarray(new, jnp.int32)], axis=1)
    greedy = np.asarray(jnp.argmax(forward(generated), axis=-1))[:, 4:-1]
    assert np.asarray(new).tolist() == greedy.tolist()


@pytest.mark.parametrize("overrides, message", [
    (["kv_lora_rank=0"], "kv_lora_rank=0"),
    (["qk_rope_head_dim=7"], "qk_rope_head_dim=7"),
    (["qk_norm=true"], "qk_norm=true"),
    (["attention=xla"], "attention=xla"),
    (["rope_scaling_type=yarn", "rope_yarn_beta_fast=1", "rope_yarn_beta_slow=2"], "rope_yarn_beta_fast=1"),
])
def test_mla_config_errors_name_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        micro_config(*MLA, *overrides)


def test_mla_ignores_the_gqa_head_keys():
    assert micro_config(*MLA, "num_query_heads=6", "num_kv_heads=4", "head_dim=15").num_query_heads == 6
    with pytest.raises(ConfigError, match="num_kv_heads=4"):
        micro_config("num_query_heads=6", "num_kv_heads=4")


@pytest.mark.parametrize("overrides", [[], ["q_lora_rank=20"]], ids=["direct_q", "q_lora"])
def test_matmul_params_count_the_mla_weights(overrides):
    """FLOPs and the planner's counts read matmul_params: it equals the model's attention weights, each declared."""
    from maxpar.model.arithmetic import attention_matmul_params
    from maxpar.model.roles import Block, param_role, path_keys

    config = micro_config(*MLA, *overrides)
    tokens = jnp.ones((1, 8), jnp.int32)
    shapes = jax.eval_shape(Transformer(model_config(config)).init, jax.random.key(0), tokens, tokens, tokens)
    leaves = jax.tree_util.tree_leaves_with_path(nn.unbox(shapes)["params"])
    roles = [param_role(path_keys(path)) for path, _ in leaves]
    assert None not in roles
    attention = sum(leaf.size for (_, leaf), role in zip(leaves, roles) if role.block == Block.ATTENTION)
    assert attention == config.num_decoder_layers * attention_matmul_params(config)


def test_mla_equals_transformers_deepseek_v3_attention():
    """transformers' DeepseekV3Attention (rope_interleave, yarn, q_lora) with its weights mapped as docs/model.md
    says: transposed, and each rope block's columns reordered evens-then-odds."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_model

    config = model_config(micro_config(*MLA, "q_lora_rank=20", *YARN))
    h, nope, rope, rank = config.num_query_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank
    s = config.rope_scaling
    hf_config = transformers.DeepseekV3Config(
        hidden_size=config.emb_dim, num_attention_heads=h, num_key_value_heads=h, q_lora_rank=config.q_lora_rank,
        kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=config.v_head_dim,
        rms_norm_eps=config.normalization_layer_epsilon, rope_interleave=True, max_position_embeddings=LENGTH,
        rope_parameters={"rope_type": "yarn", "rope_theta": config.rope_theta, "factor": s.factor,
                         "original_max_position_embeddings": s.original_max_position_embeddings,
                         "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "mscale": s.mscale,
                         "mscale_all_dim": s.mscale_all_dim})
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = hf_model.DeepseekV3Attention(hf_config, layer_idx=0).eval()
    for norm in (attention.q_a_layernorm, attention.kv_a_layernorm):
        torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    w = {name: p.detach().numpy().T for name, p in attention.named_parameters()}
    interleaved = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    q_columns = np.concatenate([np.arange(nope), nope + interleaved])
    params = {"query_a": w["q_a_proj.weight"], "query_a_norm": {"scale": w["q_a_layernorm.weight"]},
              "query_b": w["q_b_proj.weight"].reshape(config.q_lora_rank, h, -1)[..., q_columns],
              "key_value_a": w["kv_a_proj_with_mqa.weight"][:, np.concatenate([np.arange(rank), rank + interleaved])],
              "key_value_a_norm": {"scale": w["kv_a_layernorm.weight"]},
              "key_value_b": w["kv_b_proj.weight"].reshape(rank, h, -1),
              "out": w["o_proj.weight"].reshape(h, -1, config.emb_dim)}
    x = np.random.default_rng(0).normal(size=(2, LENGTH, config.emb_dim)).astype(np.float32)
    positions = np.broadcast_to(np.arange(LENGTH), (2, LENGTH))
    got = MultiHeadLatentAttention(config).apply({"params": params}, jnp.asarray(x), jnp.asarray(positions),
                                                 jnp.ones((2, LENGTH), jnp.int32))
    rotary = hf_model.DeepseekV3RotaryEmbedding(hf_config)
    causal = torch.triu(torch.full((LENGTH, LENGTH), float("-inf")), 1)[None, None]
    with torch.no_grad():
        hidden = torch.from_numpy(x)
        want, _ = attention(hidden, rotary(hidden, torch.from_numpy(positions.copy())), causal)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)
