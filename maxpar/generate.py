"""Sampling from a checkpoint: `python -m maxpar.generate CONFIG [key=value ...] --prompt TEXT [--prompt ...]`.

Loads the parameters of `load_parameters_path` (a run, a step directory or a `maxpar.convert` output) onto
the run's mesh, tokenizes the prompts with the run's tokenizer and decodes with a KV cache: one prefill of
all prompts (right-padded, each row at its own positions; any number of them: the batch runs padded with
copies of the last row up to a multiple of the mesh's batch shards), then one token per step for every row,
until each row has written EOS or `max_new_tokens`. The cache is the `cache` collection of the model's attention
(maxpar/model/layers.py), sharded by the same logical rules as its k/v: batch over data/fsdp, heads over
tensor. Sampling is greedy (`temperature=0`) or temperature with optional top-k / top-p, seeded by `seed`.
It runs in one process: it joins no multi-process job, so the mesh must fit this host's devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from maxpar.core import storage
from maxpar.core.config import Config, ConfigError, model_config
from maxpar.core.mesh import build_mesh, local_mesh_shape
from maxpar.host import preflight
from maxpar.host.devices import cpu_unless_accelerators
from maxpar.io import checkpoint, logs
from maxpar.io.data.tokenizer import Tokenizer, load_tokenizer
from maxpar.io.run_config import load_run_config
from maxpar.model import Transformer
from maxpar.model.layers import CACHE
from maxpar.training.guards import INTERRUPTED_EXIT_STATUS
from maxpar.training.train_step import layout_check
from maxpar.training.trainable import merged_config

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Generation:
    """The new tokens of each prompt (EOS included when it ended there) and the throughput figures."""
    tokens: list[list[int]]
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


def check_request(config: Config, prompts: Sequence[Sequence[int]]) -> None:
    """Errors a user can fix, before anything is compiled."""
    if not prompts:
        raise ConfigError("no prompt: give --prompt TEXT (one or more) or --prompts_file PATH")
    for i, prompt in enumerate(prompts):
        if not len(prompt):
            raise ConfigError(f"prompt {i} is empty: give at least one token of text to continue")
        if len(prompt) + config.max_new_tokens > config.max_target_length:
            raise ConfigError(f"prompt {i} has {len(prompt)} tokens + max_new_tokens={config.max_new_tokens} > "
                              f"max_target_length={config.max_target_length}: the KV cache holds max_target_length "
                              f"positions; lower max_new_tokens or raise max_target_length")
    if not config.load_parameters_path:
        raise ConfigError("load_parameters_path is empty: name the run, step directory or maxpar.convert output "
                          "whose parameters to sample from")


def sample(logits: Array, key: Array, temperature: float, top_k: int, top_p: float) -> Array:
    """[B, V] float32 logits -> [B] token ids: argmax at temperature 0, else a draw from the tempered
    distribution restricted to the top_k most likely tokens and to the smallest set whose mass reaches top_p
    (never empty: the most likely token always stays, so top_p=0 is greedy, as in transformers)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        keep = (before < top_p).at[:, 0].set(True)
        cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


def decode(apply: Callable[..., tuple[Array, Any]], params: Any, prompts: Sequence[Sequence[int]], config: Config,
           eos_id: int, pad_id: int = 0) -> Generation:
    """Prefill, then decode one token per step with the KV cache.

    `apply(params, cache, tokens, positions, segment_ids) -> (logits [B, L, V], cache)` runs the model with a
    mutable cache (None: a new one). Rows are right-padded to the longest prompt; row r's prompt sits at
    positions 0..len_r - 1, its n-th new token at len_r + n, so every row decodes as if alone.
    """
    lengths = np.array([len(p) for p in prompts], np.int32)
    rows, width = len(prompts), int(lengths.max())
    tokens = np.full((rows, width), pad_id, np.int32)
    for i, prompt in enumerate(prompts):
        tokens[i, :len(prompt)] = prompt
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
    segments = (positions < lengths[:, None]).astype(np.int32)
    key = jax.random.key(config.seed)
    pick = jax.jit(lambda logits, key: sample(logits, key, config.temperature, config.top_k, config.top_p))

    jax.block_until_ready(apply(params, None, tokens, positions, segments))  # compile: not in the figure
    start = time.perf_counter()
    logits, cache = apply(params, None, tokens, positions, segments)
    last = jnp.take_along_axis(logits, jnp.asarray(lengths - 1)[:, None, None], axis=1)[:, 0]
    key, step_key = jax.random.split(key)
    token = np.asarray(pick(last, step_key))
    prefill_s = time.perf_counter() - start

    new = [[] for _ in range(rows)]
    done = np.zeros(rows, bool)
    start, steps = time.perf_counter(), 0
    for step in range(config.max_new_tokens):
        if step == 1:  # the first decode step compiled: time the steps after it
            start, steps = time.perf_counter(), 0
        for i in np.flatnonzero(~done):
            new[i].append(int(token[i]))
        done |= token == eos_id
        if done.all() or step == config.max_new_tokens - 1:
            break
        logits, cache = apply(params, cache, token[:, None].astype(np.int32), (lengths + step)[:, None],
                              np.ones((rows, 1), np.int32))
        key, step_key = jax.random.split(key)
        token = np.asarray(pick(logits[:, 0], step_key))
        steps += 1
    decode_s = time.perf_counter() - start
    return Generation(new, rows * width / prefill_s, rows * steps / decode_s if steps else 0.0)


def pad_rows(array: Any, multiple: int) -> np.ndarray:
    """[rows, ...] -> [rows rounded up to `multiple`, ...], the last row repeated: whole, ordinary rows (no
    all-padding row for attention to mask out), computed apart from the real ones and dropped by the caller."""
    array = np.asarray(array)
    return np.pad(array, [(0, -len(array) % multiple)] + [(0, 0)] * (array.ndim - 1), mode="edge")


def model_apply(model: nn.Module, rows_multiple: int = 1) -> Callable[..., tuple[Array, Any]]:
    """The jitted (params, cache, tokens, positions, segment_ids) -> (logits, cache) of `decode`; the model's
    layout constrains the cache and activations as in training. Called without MTP tokens, the model never runs its
    multi-token prediction modules (maxpar.model.mtp): their parameters are loaded and ignored.

    Any number of rows: they run padded to a multiple of `rows_multiple` (the mesh's batch shards, which the MoE
    dispatch's shard_map must split evenly); the logits are the real rows', the cache keeps the padding rows,
    so it goes back in as it came out."""
    @jax.jit
    def run(params, cache, tokens, positions, segment_ids):
        variables = {"params": params, **({CACHE: cache} if cache is not None else {})}
        logits, mutated = model.apply(variables, tokens, positions, segment_ids, mutable=[CACHE])
        return logits, mutated[CACHE]

    def apply(params, cache, tokens, positions, segment_ids):
        padded = (jnp.asarray(pad_rows(a, rows_multiple)) for a in (tokens, positions, segment_ids))
        logits, cache = run(params, cache, *padded)
        return logits[:len(tokens)], cache
    return apply


def load_model(config: Config, devices: Sequence[Any] | None = None) -> tuple[Callable[..., Any], Any]:
    """(apply for `decode`, parameters of load_parameters_path) on the run's mesh over `devices`."""
    devices = list(jax.devices() if devices is None else devices)
    config = merged_config(config)  # a LoRA run's adapters are merged into its base as they load
    runs = layout_check(config, optax.identity(), check_batch=False)  # one trace for the hint and the layout
    layout = runs(local_mesh_shape(config, devices, runs))
    if layout.pipelined:
        raise ConfigError("maxpar.generate does not run pipelined (stage parallelism != 1): set "
                          "ici_stage_parallelism=1 and dcn_stage_parallelism=1; the checkpoint loads on any other mesh")
    mesh = build_mesh(layout.mesh, devices)
    target = checkpoint.Target.of(layout, mesh)
    params = checkpoint.load_parameters(config.load_parameters_path, target)
    return model_apply(Transformer(model_config(config), layout.model), layout.rows_degree), params


def generate(config: Config, prompts: Sequence[str], tokenizer: Tokenizer | None = None,
             devices: Sequence[Any] | None = None) -> tuple[list[str], Generation]:
    """The continuation text of each prompt, and the token-level result."""
    if tokenizer is None:
        try:
            tokenizer = load_tokenizer(config.tokenizer_path)
        except ValueError as e:
            raise ConfigError(f"tokenizer_path={config.tokenizer_path!r}: {e}") from None
    if any(not tokenizer.encode(prompt) for prompt in prompts):
        raise ConfigError(f"prompt {[bool(tokenizer.encode(p)) for p in prompts].index(False)} is empty: give at "
                          f"least one token of text to continue")
    # Training documents start with BOS (maxpar/io/data/text.py), so a prompt is the start of a document.
    ids = [[tokenizer.bos_id, *tokenizer.encode(prompt)] for prompt in prompts]
    check_request(config, ids)
    apply, params = load_model(config, devices)
    result = decode(apply, params, ids, config, tokenizer.eos_id, tokenizer.pad_id)
    texts = [tokenizer.decode([t for t in row if t != tokenizer.eos_id]) for row in result.tokens]
    return texts, result


def read_prompts(path: str) -> list[str]:
    """--prompts_file: one prompt per line (empty lines skipped), so a batch needs no shell quoting."""
    try:
        lines = storage.path(path).read_text(encoding="utf-8").splitlines()  # local or gs://
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--prompts_file {path!r}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    prompts = [line for line in lines if line]
    if not prompts:
        raise ConfigError(f"--prompts_file {path!r} holds no prompt: write one prompt per line")
    return prompts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maxpar.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the run's YAML (configs/base.yml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="load_parameters_path=RUN (its model comes with it), max_new_tokens, temperature, ...")
    parser.add_argument("--prompt", action="append", default=[], help="text to continue (repeat for a batch)")
    parser.add_argument("--prompts_file", metavar="PATH", help="a file of prompts, one per line (after any --prompt)")
    args = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)  # key=value after --prompt too
    try:
        run_config = load_run_config([args.config, *args.overrides])  # with the checkpoint's model
        config = run_config.config
        if run_config.note:  # stderr: stdout holds the continuations alone
            print(run_config.note, file=sys.stderr, flush=True)
        cpu_unless_accelerators()  # before JAX starts: no libtpu warnings where there is no TPU
        preflight.apply_simulated_devices(config)  # a run's num_simulated_devices=N: before JAX starts
        prompts = [*args.prompt, *(read_prompts(args.prompts_file) if args.prompts_file else [])]
        with logs.library_logs(logs.tool_log_path("generate"), config.log_level, mode="w"):
            texts, result = generate(config, prompts)
    except ConfigError as e:
        print(f"maxpar: config error: {e}", file=sys.stderr)
        return 2
    except checkpoint.CheckpointError as e:
        print(f"maxpar: checkpoint error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nmaxpar: interrupted; nothing was generated", file=sys.stderr)
        return INTERRUPTED_EXIT_STATUS
    for prompt, text in zip(prompts, texts):
        print(f"--- prompt: {prompt!r}\n{prompt}{text}")
    print(f"prefill {result.prefill_tokens_per_s:,.0f} tokens/s, decode {result.decode_tokens_per_s:,.1f} tokens/s "
          f"({len(texts)} rows; compilation excluded)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
