"""The AdamW transformation: moments in optimizer_state_dtype, update computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import micro_config
from maxpar.training.optimizer import learning_rate_schedule, make_optimizer


def params_and_grads(dtype):
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"w": jax.random.normal(keys[0], (8, 4)).astype(dtype), "norm": {"scale": jnp.ones((4,), dtype)}}
    grads = {"w": jax.random.normal(keys[1], (8, 4)).astype(dtype),
             "norm": {"scale": jax.random.normal(keys[2], (4,)).astype(dtype)}}
    return params, grads


def adam_state(state) -> optax.ScaleByAdamState:
    found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
    assert len(found) == 1
    return found[0]


def moments(state):
    adam = adam_state(state)
    return jax.tree.leaves(adam.mu) + jax.tree.leaves(adam.nu)


@pytest.mark.parametrize("weights,state_dtype,expected", [("float32", "", "float32"),
                                                          ("bfloat16", "", "bfloat16"),
                                                          ("bfloat16", "float32", "float32"),
                                                          ("float32", "bfloat16", "bfloat16")])
def test_both_moments_keep_the_requested_dtype_across_updates(weights, state_dtype, expected):
    config = micro_config(f"weight_dtype={weights}", f"optimizer_state_dtype={state_dtype}")
    tx = make_optimizer(config)
    params, grads = params_and_grads(jnp.dtype(weights))
    state = tx.init(params)
    assert {str(m.dtype) for m in moments(state)} == {expected}
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert {str(m.dtype) for m in moments(state)} == {expected}
    assert {str(u.dtype) for u in jax.tree.leaves(updates)} == {weights}


def test_float32_state_equals_optax_adamw():
    config = micro_config("gradient_clipping_threshold=0")
    params, grads = params_and_grads(jnp.float32)
    reference = optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2,
                            eps=config.adam_eps, weight_decay=config.adam_weight_decay,
                            mask=lambda p: {"w": True, "norm": {"scale": False}})
    ours, theirs = make_optimizer(config), reference
    ours_state, theirs_state = ours.init(params), theirs.init(params)
    for _ in range(3):
        ours_updates, ours_state = ours.update(grads, ours_state, params)
        theirs_updates, theirs_state = theirs.update(grads, theirs_state, params)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                     ours_updates, theirs_updates)
        params = optax.apply_updates(params, ours_updates)


def test_float32_moments_under_bf16_weights_do_not_round_through_bfloat16():
    # nu of a tiny gradient: (1 - b2) g^2 is far below bf16 resolution relative to 1 but exact in float32.
    config = micro_config("weight_dtype=bfloat16", "optimizer_state_dtype=float32", "gradient_clipping_threshold=0")
    tx = make_optimizer(config)
    params = {"w": jnp.ones((2,), jnp.bfloat16)}
    state = tx.init(params)
    grads = {"w": jnp.asarray([1.0, 1.0 + 2 ** -7], jnp.bfloat16)}
    _, state = tx.update(grads, state, params)
    mu = adam_state(state).mu["w"]
    assert mu.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(mu), (1 - config.adam_b1) * np.asarray([1.0, 1.0 + 2 ** -7]), rtol=1e-7)
