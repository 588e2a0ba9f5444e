"""Pipelined = unpipelined, and what the compiled pipeline communicates.

For gPipe and circular schedules, S in {2, 4} stages and M in {S, 2S} microbatches, on 8
simulated devices mixed with data, fsdp and tensor axes: the logits and the gradient of every
parameter equal the one-device unpipelined model's with the same weights (float32). The
compiled programs show the stage-to-stage collective-permutes and that data-parallel gradient
reductions run once per step, however many microbatches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections import Counter
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import print_saved_residuals

from helpers import packed_batch, micro_config
from maxpar.core.config import model_config
from maxpar.model import stack
from maxpar.model import Transformer
from maxpar.model.matmul import PROJECTION
from maxpar.model.transformer import DecoderLayer, rematerialized
from maxpar.plan import hlo
from maxpar.train import setup_run

LAYERS, ROWS, LENGTH = 8, 16, 32
BASE = ("dataset_type=synthetic", f"num_decoder_layers={LAYERS}", "per_device_batch_size=2")
DP_TP = ("ici_data_parallelism=2", "ici_fsdp_parallelism=1", "ici_tensor_parallelism=2")
FSDP_TP = ("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")
CASES = {  # name: (stages, microbatches, repeats, other mesh axes and options)
    "gpipe_s2_m2": (2, 2, 1, DP_TP),
    "gpipe_s2_m4": (2, 4, 1, DP_TP),
    "gpipe_s4_m4": (4, 4, 1, ("ici_fsdp_parallelism=2",)),
    "gpipe_s4_m8": (4, 8, 1, ("ici_fsdp_parallelism=2",)),
    "circular_s2_m2": (2, 2, 2, (*FSDP_TP, "pipeline_fsdp_ag_once=true")),
    "circular_s2_m4": (2, 4, 2, (*FSDP_TP, "pipeline_fsdp_ag_once=true")),
    "circular_s4_m4": (4, 4, 2, ("ici_data_parallelism=2", "ici_fsdp_parallelism=1", "remat_policy=full")),
    # M = 2S at S = 4: gpipe_s4_m8; remat_policy=minimal under the stages' vmap: its saved residuals in
    # test_minimal_remat_saves_the_projections_under_the_stage_vmap, its gradients in tests/test_pipeline_1f1b.py.
}


def make_batch() -> dict[str, np.ndarray]:
    return packed_batch(ROWS, LENGTH)


def logits_and_grads(model: nn.Module):
    """params, batch -> (logits, gradient of the summed cross-entropy w.r.t. every parameter)."""
    def run(params, batch):
        def objective(p):
            logits = model.apply({"params": p}, batch["inputs"], batch["positions"], batch["segment_ids"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).sum(), logits
        (_, logits), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return logits, grads
    return run


@dataclasses.dataclass(frozen=True)
class Outcome:
    logits: np.ndarray
    grads: Any                 # canonical layout: decoder/layers stacked [L, ...]
    hlo: str = ""
    axis_sizes: dict[str, int] = dataclasses.field(default_factory=dict)
    iterations: int = 0


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Outcome]:
    """Canonical float32 parameters and the unpipelined model's logits and gradients on one device."""
    config = micro_config(*BASE)
    model = Transformer(model_config(config))
    tokens = jnp.zeros((1, LENGTH), jnp.int32)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens, tokens, tokens)["params"])
    logits, grads = jax.jit(logits_and_grads(model))(params, make_batch())
    return params, Outcome(np.asarray(logits), jax.device_get(grads))


@pytest.fixture(scope="module")
def outcomes(reference):
    """Each case's pipelined logits, gradients and compiled HLO, computed once per module on first use."""
    params, _ = reference
    cache: dict[str, Outcome] = {}

    def get(name: str) -> Outcome:
        if name not in cache:
            stages, micro, repeats, mesh = CASES[name]
            config = micro_config(*BASE, f"ici_stage_parallelism={stages}", f"num_pipeline_microbatches={micro}",
                                 f"num_pipeline_repeats={repeats}", *mesh)
            run = setup_run(config, jax.devices())
            assert run.schedule is not None and run.schedule.num_microbatches == micro
            placed = jax.device_put(stack.from_canonical(params, model_config(config)), run.state_shardings.params)
            batch = jax.device_put(make_batch(), run.in_sharding)
            step = jax.jit(logits_and_grads(run.model))
            compiled = step.lower(placed, batch).compile()
            logits, grads = compiled(placed, batch)
            canonical = stack.to_canonical(grads, model_config(config))
            cache[name] = Outcome(np.asarray(logits), jax.device_get(canonical),
                                  compiled.as_text(), dict(run.mesh.shape), run.schedule.num_iterations)
        return cache[name]
    return get


def assert_close(actual, expected, what: str) -> None:
    scale = float(np.max(np.abs(expected)))
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * scale, err_msg=what)


@pytest.mark.parametrize("name", list(CASES))
def test_pipelined_logits_and_gradients_equal_the_unpipelined_model(name, reference, outcomes):
    _, expected = reference
    got = outcomes(name)
    assert_close(got.logits, expected.logits, "logits")
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(expected.grads)]
    assert len(paths) == 12  # every parameter: 9 per layer (stacked), embedding, final norm, output
    for path, actual, wanted in zip(paths, jax.tree.leaves(got.grads), jax.tree.leaves(expected.grads)):
        assert actual.shape == wanted.shape, path
        assert_close(actual, wanted, f"gradient of {path}")
    assert float(np.max(np.abs(expected.grads["decoder"]["layers"]["mlp"]["wo"][0]))) > 0  # first layer learns


def executions(outcome: Outcome, kind: str, axis: str) -> int:
    """How many times one step runs collectives of `kind` over exactly the mesh axis `axis`."""
    return sum(c.count for c in hlo.collectives(outcome.hlo, 8)
               if c.kind == kind and hlo.label_groups(c, outcome.axis_sizes) == axis)


@pytest.mark.parametrize("name", ["gpipe_s4_m4", "circular_s2_m4"])
def test_stages_pass_activations_by_collective_permute(name, outcomes):
    got = outcomes(name)
    permutes = [c for c in hlo.collectives(got.hlo, 8) if c.kind == "collective-permute"
                and hlo.label_groups(c, got.axis_sizes) == "stage" and c.count == got.iterations]
    assert permutes, "no collective-permute over `stage` running once per iteration"
    stages, micro = CASES[name][0], CASES[name][1]
    rows_per_device = ROWS // micro // (8 // stages // got.axis_sizes["tensor"])
    one_microbatch = rows_per_device * LENGTH * 64 * 4  # [b, T, emb] float32 on one device
    assert {c.operand_bytes for c in permutes} == {one_microbatch}


def test_data_parallel_gradient_reduction_runs_once_per_step_whatever_m(outcomes):
    two, four = outcomes("gpipe_s2_m2"), outcomes("gpipe_s2_m4")
    assert executions(two, "all-reduce", "data") == executions(four, "all-reduce", "data") > 0
    loops = Counter(c.kind for c in hlo.collectives(four.hlo, 8)
                    if c.count > 1 and hlo.label_groups(c, four.axis_sizes) == "data")
    assert loops == Counter(), "a data-axis collective runs inside the pipeline loop"


def test_fsdp_ag_once_gathers_and_reduces_once_while_the_default_does_so_per_iteration(outcomes):
    once = [outcomes("circular_s2_m2"), outcomes("circular_s2_m4")]
    default = [outcomes("gpipe_s4_m4"), outcomes("gpipe_s4_m8")]
    for kind in ("all-gather", "all-reduce"):  # XLA:CPU reduce-scatters gradients as all-reduce + slice
        assert executions(once[0], kind, "fsdp") == executions(once[1], kind, "fsdp") > 0
        assert executions(default[1], kind, "fsdp") > executions(default[0], kind, "fsdp") > 0


def test_circular_layout_initializes_the_canonical_weights(reference):
    """The same seed gives the same model in every layout: [R, L/R, ...] is the canonical stack reshaped."""
    params, _ = reference
    config = micro_config(*BASE, "ici_stage_parallelism=2", "num_pipeline_repeats=2")
    tokens = jnp.zeros((1, LENGTH), jnp.int32)
    init = jax.jit(Transformer(model_config(config)).init)
    circular = nn.unbox(init(jax.random.key(0), tokens, tokens, tokens)["params"])
    assert circular["decoder"]["layers"]["mlp"]["wo"].shape == (2, LAYERS // 2, 128, 64)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(stack.to_canonical(circular, model_config(config))),
                 jax.device_get(params))


def test_minimal_remat_saves_the_projections_under_the_stage_vmap():
    """remat_policy=minimal saves the layer's weight projections, also under the pipeline's vmap over
    stages (which gives every matmul a batch dimension, so a dimension-based policy would save none)."""
    config = micro_config("remat_policy=minimal", "dtype=bfloat16")
    layer = rematerialized(config, DecoderLayer)(config)
    x = jnp.ones((2, LENGTH, 64), jnp.bfloat16)
    ids = jnp.ones((2, LENGTH), jnp.int32)
    params = layer.init(jax.random.key(0), x, ids, ids)["params"]

    def loss(params, x):
        return jnp.sum(layer.apply({"params": params}, x, ids, ids)[0].astype(jnp.float32))

    def saved_projections(fn, *args):  # JAX prints the residuals ("bf16[2,32,4,16] named 'projection' from ...")
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            print_saved_residuals(fn, *args)
        return sorted(line.split()[0] for line in printed.getvalue().splitlines() if f"'{PROJECTION}'" in line)

    once = saved_projections(loss, params, x)
    # q, k, v, the attention output, gate, up (the down projection's output only feeds the residual sum, whose
    # gradient does not need it)
    assert once == sorted(["bf16[2,32,4,16]", "bf16[2,32,2,16]", "bf16[2,32,2,16]", "bf16[2,32,64]",
                           "bf16[2,32,128]", "bf16[2,32,128]"])
    stages = jax.tree.map(lambda a: jnp.stack([a, a]), (params, x))
    staged = saved_projections(lambda p, x: jnp.sum(jax.vmap(loss)(p, x)), *stages)
    assert staged == sorted(shape.replace("[", "[2,") for shape in once)
