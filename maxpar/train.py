"""`python -m maxpar.train CONFIG.yml [key=value ...]`: the training loop.

config -> mesh -> sharded state -> jitted step -> loop with logging, eval and
checkpoints. Everything device-dependent starts here, never while parsing config.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from tqdm import tqdm

from maxpar.core import storage
from maxpar.core.config import (DEFAULTS, Config, ConfigError, describe_keys, load_config,
                                model_config, to_yaml)
from maxpar.core.layout import BatchShape, RunLayout, check_devices
from maxpar.core.mesh import build_mesh, local_mesh_shape
from maxpar.core.schedule import Schedule
from maxpar.host import devices as host_devices
from maxpar.host import distributed, malloc, preflight
from maxpar.io import checkpoint, executable, local_checkpoint, logs
from maxpar.io.data.errors import DataError
from maxpar.io.data.mixture import SOURCE_TOKENS
from maxpar.io.data.pipeline import SourceData, open_datasets
from maxpar.io.metrics import MetricsWriter, peak_flops, rewind_metrics, throughput
from maxpar.model.arithmetic import parameter_counts, training_flops_per_token
from maxpar.io.run_config import load_run_config
from maxpar.model import Transformer
from maxpar.plan.fit import check_local_fit
from maxpar.training import dpo, summary, trainable
from maxpar.training.cadence import StepTimer, cadence
from maxpar.training.guards import (INTERRUPTED_EXIT_STATUS, PREEMPTED_EXIT_STATUS, STORAGE_EXIT_STATUS, LossCheck,
                                    Preempted, PreemptionWatch, SlowStepNote, StepsInFlight, StepWatchdog)
from maxpar.training.optimizer import make_optimizer
from maxpar.training.profiler import StepProfiler, profile_window
from maxpar.training.train_step import compile_train_step, create_state, jit_eval_step, layout_check


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Assemble global arrays from each process's rows."""
    return {key: jax.make_array_from_process_local_data(sharding, value) for key, value in local.items()}


def run_directory(config: Config) -> epath.Path:
    name = config.run_name or distributed.same_on_all_processes(time.strftime("run_%Y%m%d_%H%M%S"))
    return storage.path(config.base_output_directory) / name


def _eval_sums(eval_step, state, dataset_factory, steps: int, sharding) -> dict[str, float]:
    """The eval step's sums over the first `steps` batches of a fresh eval iterator (comparable over time)."""
    iterator = iter(dataset_factory())
    totals = [eval_step(state.params, state.frozen, global_batch(next(iterator), sharding)) for _ in range(steps)]
    return {key: sum(float(t[key]) for t in totals) for key in totals[0]}


def _evaluate(eval_step, state, dataset_factory, steps: int, sharding) -> float:
    """Mean loss over the first `steps` batches of a fresh eval iterator."""
    sums = _eval_sums(eval_step, state, dataset_factory, steps, sharding)
    return sums["loss_sum"] / max(sums["tokens"], 1.0)


def _eval_losses(run: RunSetup, eval_step, state) -> dict[str, float]:
    """eval_loss; a mixture's eval_loss/NAME for each source with held-out documents too, and as eval_loss their
    mean weighted by the mixture's weights: the held-out loss in the proportions the run trains on. DPO: also the
    held-out pairs' reward accuracy and margin (eval_dpo_reward_accuracy, eval_dpo_reward_margin)."""
    config = run.config
    if not run.sources:
        sums = _eval_sums(eval_step, state, run.eval_data, config.eval_steps, run.in_sharding)
        count = max(sums["tokens"], 1.0)
        return {"eval_loss": sums["loss_sum"] / count,
                **{f"eval_{name}": float(value) for name, value in dpo.metrics(sums, count).items()}}
    evaluated = [s for s in run.sources if s.eval]
    losses = {s.name: _evaluate(eval_step, state, s.eval, config.eval_steps, run.in_sharding) for s in evaluated}
    mean = sum(s.weight * losses[s.name] for s in evaluated) / sum(s.weight for s in evaluated)
    return {"eval_loss": mean, **{f"eval_loss/{name}": loss for name, loss in losses.items()}}


def _source_tokens(run: RunSetup, metrics: dict[str, Any]) -> dict[str, int]:
    """tokens/NAME: a mixture's tokens trained on from each source so far, summed over every process's lanes
    (a collective: every process logs the same steps)."""
    if SOURCE_TOKENS not in metrics:
        return {}
    counts = np.asarray(metrics[SOURCE_TOKENS]).sum(axis=0)
    if jax.process_count() > 1:
        counts = np.asarray(multihost_utils.process_allgather(counts)).sum(axis=0)
    return {f"tokens/{s.name}": int(n) for s, n in zip(run.sources, counts)}


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """A run layout bound to real devices, with its data, model and optimizer (shared by the loop and the benchmark)."""

    layout: RunLayout
    devices: list[jax.Device]
    mesh: Mesh
    model: Transformer
    tx: optax.GradientTransformation
    train_data: grain.IterDataset
    eval_data: Callable[[], grain.IterDataset] | None
    data_description: str  # what the data reads, for the run header
    sources: tuple[SourceData, ...] = ()  # a dataset_mixture's sources: names, weights, eval datasets

    @property
    def config(self) -> Config:
        return self.layout.config

    @property
    def shape(self) -> BatchShape:
        return self.layout.batch

    @property
    def schedule(self) -> Schedule | None:
        return self.layout.schedule

    @property
    def abstract_state(self) -> Any:
        return self.layout.state.abstract

    @functools.cached_property
    def in_sharding(self) -> NamedSharding:
        return self.layout.input_sharding(self.mesh)

    @functools.cached_property
    def state_shardings(self) -> Any:
        return self.layout.state_shardings(self.mesh)

    def restore_target(self) -> checkpoint.Target:
        return checkpoint.Target.of(self.layout, self.mesh, self.shape.global_rows)

    def compile_train_step(self) -> Any:
        """Ahead-of-time compiled train step for this run's state and batch layout; the one compiled before for
        these devices when compiled_trainstep_file names it."""
        if self.config.compiled_trainstep_file:
            return executable.load_executable(self.config.compiled_trainstep_file, self.devices,
                                              self.layout.mesh.describe(), self.config)
        return compile_train_step(self.model, self.tx, self.layout, self.mesh)


def setup_run(config: Config, devices: Sequence[jax.Device] | None = None) -> RunSetup:
    """The run layout of `config` on `devices` (every setup check), bound to them, with data, model and optimizer."""
    devices = list(jax.devices() if devices is None else devices)
    runs = layout_check(config)  # one trace for the device-count hint and the layout
    layout = runs(local_mesh_shape(config, devices, runs))
    check_devices(config, devices)
    mesh = build_mesh(layout.mesh, devices)
    block_index, block_count = layout.process_block(mesh)
    data = open_datasets(config, global_rows=layout.batch.global_rows, eval_rows=layout.batch.microbatch_rows,
                         shard_index=block_index, shard_count=block_count, notify=tqdm.write)
    model = Transformer(model_config(config), layout.model)
    return RunSetup(layout, devices, mesh, model, make_optimizer(config, layout), data.train, data.eval,
                    data.description, data.sources)


def accumulation_words(steps: int, microbatch_rows: int) -> str:
    """The batch line's note on gradient accumulation, only where there is some: a pipeline's microbatches are
    another thing, which its own line counts."""
    return f" in {steps} gradient-accumulation microbatches of {microbatch_rows} rows" if steps > 1 else ""


PRESETS = DEFAULTS.parent / "models"


def preset_differences(config: Config, name: str, presets: epath.PathLike = PRESETS) -> dict[str, Any] | None:
    """{key: this config's value} for each key of preset `name`'s file that the config sets otherwise (None: no
    such preset). The preset's values are read as a run would read them, on base.yml."""
    path = epath.Path(presets) / f"{name}.yml"
    if not path.is_file():
        return None
    keys = yaml.safe_load(path.read_text()) or {}
    preset = load_config([str(DEFAULTS), f"model_name={name}"])
    return {key: getattr(config, key) for key in keys if getattr(config, key) != getattr(preset, key)}


def describe_model(config: Config, presets: epath.PathLike = PRESETS) -> str:
    """The run header's name for the model: its preset and the preset's keys the run changes ("tiny (overridden:
    emb_dim=512, num_decoder_layers=6)"); without model_name (a config saved by a run or an import) the preset
    whose keys it has ("custom, as qwen3-0.6b"), or "custom"."""
    if config.model_name:
        changed = preset_differences(config, config.model_name, presets)
        if not changed:
            return config.model_name
        words = ", ".join(f"{key}={str(value).lower() if isinstance(value, bool) else value}"
                          for key, value in changed.items())
        return f"{config.model_name} (overridden: {words})"
    same = [path.stem for path in sorted(epath.Path(presets).glob("*.yml"))
            if preset_differences(config, path.stem, presets) == {}]
    return f"custom, as {same[0]}" if same else "custom"


def describe_computation(config: Config) -> str:
    """The model line's note on quantized matmuls, only where there are some."""
    if not config.quantization:
        return ""
    scaling = f", fp8_scaling={config.fp8_scaling}" if config.quantization == "fp8" else ""
    return f", quantization={config.quantization}{scaling}"


def print_header(run: RunSetup, run_dir: epath.Path, peak: float | None, log: Callable[[str], None]) -> None:
    """The run header: model, mesh, batch, data and pipeline schedule, all known before the first compile (so a
    test can read it from `setup_run` alone)."""
    config, devices = run.config, run.devices
    state = run.abstract_state
    counts = parameter_counts(trainable.policy(state.params, state.frozen, config), config.num_experts_per_tok)
    mesh_desc = run.layout.mesh.describe()
    log(f"maxpar: run {run_dir}" + ("" if config.run_name else f" (to resume it later: run_name={run_dir.name})"))
    log(f"  model {describe_model(config)}: {counts['total']:,} parameters "
        f"({counts['non_embedding']:,} non-embedding, {counts['active']:,} active per token), "
        f"{config.num_decoder_layers} layers, emb {config.emb_dim}{describe_computation(config)}")
    if config.lora_rank or config.use_sft or config.use_dpo:
        log(f"  {post_training_line(config, sum(leaf.size for leaf in jax.tree.leaves(state.params)))}")
    if config.num_experts > 1:
        dispatch = (f"capacity factor {config.capacity_factor:g}" if config.capacity_factor > 0 else "dropless")
        log(f"  mixture of experts: {config.num_moe_layers} MoE layers of {config.num_experts} experts, top-"
            f"{config.num_experts_per_tok}, {dispatch}, load-balance loss weight {config.load_balance_loss_weight:g}")
    log(f"  mesh {mesh_desc} over {len(devices)} {devices[0].device_kind} device(s) in {jax.process_count()} process(es)")
    log(f"  batch {run.shape.global_rows} rows x {config.max_target_length} tokens = {run.shape.tokens_per_step:,} "
        f"tokens/step{accumulation_words(config.gradient_accumulation_steps, run.shape.microbatch_rows)}; "
        f"{training_flops_per_token(config):.3e} FLOPs/token; "
        f"peak {'unknown' if peak is None else f'{peak:.3e}'} FLOP/s per device")
    log(f"  data {run.data_description}")
    if run.schedule is not None:  # an explicit backward is scheduled too: maxpar.core.op_schedule
        log(f"  {(run.layout.ops or run.schedule).describe()}")
        log(f"    layers per stage: {run.schedule.assignment()}")
    log(f"  library logs (absl, Orbax, JAX): {library_log(run_dir)}"
        + (" (one file per process)" if jax.process_count() > 1 else "")
        + ("; also printed here (log_level=debug)" if config.log_level == "debug" else ""))


def post_training_line(config: Config, trained: int) -> str:
    """The run header's line on what post-training trains: the objective, and LoRA's adapters."""
    if config.use_dpo:
        what = (f"DPO on preference pairs (beta {config.dpo_beta:g}"
                + (f", label smoothing {config.dpo_label_smoothing:g}" if config.dpo_label_smoothing else "")
                + "), reference = the starting parameters, frozen")
    elif config.use_sft:
        what = ("SFT on conversations, loss on the " + ("assistant tokens" if config.sft_train_on_completion_only
                                                        else "whole conversation"))
    else:
        what = "language-model loss"
    if config.lora_rank:
        return (f"{what}; LoRA rank {config.lora_rank}, alpha {config.lora_alpha:g} on "
                f"{', '.join(config.lora_target_roles)}: {trained:,} adapter parameters trained, the base frozen"
                + (f" in {config.lora_base_weight_dtype}" if config.lora_base_weight_dtype else ""))
    return f"{what}; {trained:,} parameters trained"


def initial_state(run: RunSetup, manager: Any, iterator: Any, log: Callable[[str], None], local: Any = None) -> Any:
    """Where training starts: this run's newest usable checkpoint in either tier (restoring `iterator` too), else
    load_full_state_path, else load_parameters_path (fresh optimizer), else a fresh init. The frozen parameters
    (LoRA's base, DPO's reference) are never in a checkpoint: `starting_frozen` reads them each time."""
    config = run.config
    target = run.restore_target()
    warn = checkpoint.warn_stderr if jax.process_index() == 0 else (lambda _: None)
    found = local_checkpoint.resume_tiers(manager, local, target, iterator, warn) if manager else None
    if found is not None:
        state, tier = found
        log(f"  resumed from checkpoint at step {int(state.step)} ({tier})")
        return state.replace(frozen=starting_frozen(run, target, warn))
    if config.load_full_state_path:
        state = checkpoint.load_full_state(config.load_full_state_path, target, warn)
        log(f"  started from the full state at step {int(state.step)} of {config.load_full_state_path}; "
            f"the data starts from its beginning")
        return state.replace(frozen=starting_frozen(run, target, warn))
    if config.load_parameters_path and config.lora_rank:  # the checkpoint is the base; the adapters start afresh
        state = create_state(run.model, run.tx, run.layout, run.mesh, with_frozen=False)
        log(f"  started LoRA adapters (rank {config.lora_rank}) on the frozen parameters of "
            f"{config.load_parameters_path}; step 0")
        return state.replace(frozen=starting_frozen(run, target, warn))
    if config.load_parameters_path:
        params = checkpoint.load_parameters(config.load_parameters_path, target, warn)
        log(f"  started from the parameters of {config.load_parameters_path}; fresh optimizer state, step 0")
        state = checkpoint.state_from_params(params, run.tx, target)
        return state.replace(frozen=starting_frozen(run, target, warn, params))
    return create_state(run.model, run.tx, run.layout, run.mesh)


def slow_step_note(devices: Sequence[jax.Device]) -> SlowStepNote | None:
    """On simulated CPU devices, what a step running half as long as XLA lets a collective wait may come to."""
    if devices[0].platform != "cpu" or len(jax.local_devices()) < 2:
        return None
    timeouts = host_devices.CollectiveTimeouts.of(os.environ.get("XLA_FLAGS", ""))
    return SlowStepNote(timeouts.abort_s / 2, host_devices.late_collective_words(timeouts))


def starting_frozen(run: RunSetup, target: checkpoint.Target, warn: Callable[[str], None], params: Any = None) -> Any:
    """The run's frozen parameters (maxpar.training.trainable), as they were when it started: those of
    load_parameters_path (the base under LoRA, else the reference: `params` when already read), else the seeded
    initialization's; {} for a run that freezes nothing."""
    if not jax.tree.leaves(target.abstract_state.frozen):
        return {}
    if not run.config.load_parameters_path:
        return create_state(run.model, run.tx, run.layout, run.mesh).frozen
    if params is not None and not run.config.lora_rank:  # DPO's reference: a copy of the starting parameters
        return jax.tree.map(jnp.copy, params)
    return checkpoint.load_parameters(run.config.load_parameters_path, target.of_item("frozen"), warn)


def held_out_losses(config: Config, devices: Sequence[jax.Device] | None = None) -> dict[str, float]:
    """The held-out figures (eval_loss; under DPO its reward accuracy and margin too) of the state a run of `config`
    starts from (load_parameters_path, a LoRA run's adapters at zero, or the seeded init), as its evaluations
    compute them; nothing is trained or written."""
    run = setup_run(config, devices)
    if run.eval_data is None:
        raise ConfigError("nothing is held out (eval_fraction=0 and no eval split): no held-out loss to compute")
    state = initial_state(run, None, iter(run.train_data), lambda _: None)
    return _eval_losses(run, jit_eval_step(run.model, run.layout, run.mesh), state)


def library_log(run_dir: epath.Path) -> epath.Path:
    """This process's file for the libraries' log records (absl, Orbax, JAX) while it trains."""
    return logs.library_log_path(run_dir, jax.process_index(), jax.process_count())


def train(config: Config, devices: Sequence[jax.Device] | None = None,
          run_dir: epath.PathLike | None = None) -> dict[str, Any]:
    """Train per `config`; returns the last logged metrics row. The libraries' logs go to `library_log`
    meanwhile, so that the terminal shows maxpar's lines (log_level=debug shows both)."""
    run_dir = storage.path(run_dir) if run_dir else run_directory(config)
    with logs.library_logs(library_log(run_dir), config.log_level):
        return _train(config, devices, run_dir)


def _train(config: Config, devices: Sequence[jax.Device] | None, run_dir: epath.Path) -> dict[str, Any]:
    setup_start = time.perf_counter()
    run = setup_run(config, devices)
    devices = run.devices
    lead = jax.process_index() == 0
    log = tqdm.write if lead else (lambda *_: None)
    peak = peak_flops(devices[0].device_kind, config.peak_flops_per_device)
    print_header(run, run_dir, peak, log)

    iterator = iter(run.train_data)
    manager = checkpoint.make_manager(run_dir, config) if config.enable_checkpointing else None
    local = local_checkpoint.make_local_manager(run_dir.name, config) if manager else None
    warn = checkpoint.warn_stderr if lead else (lambda _: None)
    saver = checkpoint.Saver.of(manager, config, warn) if manager else None
    writer, bar = None, None
    profiler = StepProfiler(profile_window(config), run_dir, log)
    try:
        with (PreemptionWatch(saver.newest_complete if saver else None) as preemption,
              StepWatchdog(config.step_timeout_s, slow_step_note(devices)) as watchdog):
            state = initial_state(run, manager, iterator, log, local)
            start = int(state.step)
            if lead and rewind_metrics(run_dir / "metrics.jsonl", start):
                log(f"  metrics.jsonl: dropped the rows after step {start}; they are logged again from here")

            compile_start = time.perf_counter()
            step_fn = run.compile_train_step()
            log(f"  loaded the train step compiled before from {config.compiled_trainstep_file} in "
                f"{time.perf_counter() - compile_start:.1f} s" if config.compiled_trainstep_file else
                f"  compiled the train step in {time.perf_counter() - compile_start:.1f} s")
            has_eval = run.eval_data or any(s.eval for s in run.sources)
            eval_fn = jit_eval_step(run.model, run.layout, run.mesh) if has_eval else None

            writer = MetricsWriter(run_dir, enabled=lead)
            if lead:
                (run_dir / "config.yml").write_text(to_yaml(config), encoding="utf-8")
            bar = tqdm(total=config.steps, initial=start, disable=None if lead else True, unit="step",
                       dynamic_ncols=True)
            row: dict[str, Any] = {}
            when = cadence(config, has_eval_data=eval_fn is not None, checkpointing=manager is not None)
            timer, losses = StepTimer(), LossCheck(enabled=config.stop_on_nan, start_step=start)
            in_flight = StepsInFlight()  # a stop requested now waits for about one step, not for all dispatched
            skipped_before = skipped_counts(state.opt_state)  # the updates skipped before the last row (or start)

            def log_step(step: int, metrics: dict[str, Any], state: Any = None, late: bool = False) -> dict[str, Any]:
                """Read, evaluate (given the `state`) and write one metrics row, and a line for the updates skipped
                since the previous row. A row read `late` ends the timer's window where the step ended: the next step
                is already running."""
                row = _metrics_row(run, step, jax.device_get(metrics), timer.per_step(), peak)
                if late:
                    timer.restart()
                if state is not None:
                    row.update(_eval_losses(run, eval_fn, state))
                writer.write(row)
                bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
                log(_format_row(row))
                skipped = _skipped_words(skipped_before, row, config.skip_step_on_spike_factor)
                if skipped:
                    log(skipped)
                skipped_before.update({key: row[key] for key in SKIPPED_COUNTS})
                return row

            lagging: tuple[int, Any] | None = None  # a step read late (Due.read_late): read after the next dispatch
            loop_start = time.perf_counter()
            watchdog.progress(start)  # compiled: the first step is timed like the others
            for step in range(start + 1, config.steps + 1):
                profiler.before_step(step)
                batch = next(iterator)
                seen = batch.pop(SOURCE_TOKENS, None)
                state, metrics = step_fn(state, global_batch(batch, run.in_sharding))
                profiler.after_step(step, metrics)
                in_flight.add(metrics)
                if seen is not None:  # read with the step's metrics, which may be logged a step late
                    metrics = {**metrics, SOURCE_TOKENS: seen}
                if lagging:  # the previous step, read now that this one is queued
                    losses.check(manager)
                    row, lagging = log_step(*lagging, late=True), None
                losses.add(step, metrics["loss"], metrics["grad_norm"])
                timer.tick()
                bar.update(1)
                due = when.after(step, stop=preemption.requested(step))
                if due.read_late:
                    lagging = (step, metrics)
                    watchdog.progress(step)
                    continue
                if due.check_losses:
                    losses.check(manager)
                if due.log:
                    row = log_step(step, metrics, state if due.eval else None)
                if due.save or due.save_local:  # first: a resume from this checkpoint keeps its rows
                    writer.upload()
                if due.save:  # the last step's and a preemption's complete before the state is given up
                    saver.save(step, state, iterator, config, run.shape.global_rows, wait=due.stop or due.last)
                if due.save_local:
                    local_checkpoint.save_local(local, step, state, iterator, config, run.shape.global_rows)
                if due.stop:
                    raise Preempted(step, saved=manager is not None,
                                    rerun="rerun the same command" if config.run_name else
                                    f"rerun with run_name={run_dir.name}", signum=preemption.signum or signal.SIGTERM)
                if due.log:  # the next window starts after this step's eval and save
                    timer.restart()
                watchdog.progress(step)
    finally:
        profiler.stop()
        for closable in (bar, writer):  # also when a step raises (preemption, NaN, a lost peer, lost storage)
            if closable is not None:
                storage.close_after(closable.close, warn)
        for closing in (manager, local):
            if closing is not None:
                storage.close_after(closing.wait_until_finished, warn)
                storage.close_after(closing.close, warn)
    if lead:
        totals = summary.RunTotals(start, max(start, config.steps), time.perf_counter() - setup_start,
                                   time.perf_counter() - loop_start, run.shape.tokens_per_step)
        sampling = summary.sampling_overrides(config, run.layout.mesh, devices[0].platform)
        for line in summary.finish_run(run_dir, totals, f"maxpar: {config.model_name or 'custom'}, {run_dir.name}",
                                       sampling, checkpointing=config.enable_checkpointing):
            log(line)
    return row


def _metrics_row(run: RunSetup, step: int, metrics: dict[str, Any], step_time_s: float,
                 peak: float | None) -> dict[str, Any]:
    """One metrics.jsonl line (eval_loss filled in by the caller on eval steps)."""
    return {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
            "learning_rate": float(metrics["learning_rate"]), "eval_loss": None,
            **throughput(run.config, tokens_per_step=run.shape.tokens_per_step, step_time_s=step_time_s,
                         num_devices=len(run.devices), peak=peak),
            **{key: float(value) for key, value in metrics.items()
               if key.startswith(("moe_", "mtp_", "z_loss", "dpo_"))},
            **{key: int(metrics[key]) for key in SKIPPED_COUNTS},
            **_source_tokens(run, metrics)}


SKIPPED_COUNTS = ("skipped_nonfinite", "skipped_spikes")  # the run's skipped updates so far, by cause


def skipped_counts(opt_state: Any) -> dict[str, int]:
    """The SKIPPED_COUNTS a (restored) train state's bad-step guard holds."""
    guard = jax.device_get(opt_state.guard)
    return {"skipped_nonfinite": int(guard.skipped_nonfinite), "skipped_spikes": int(guard.skipped_spikes)}


def _skipped_words(before: dict[str, int], row: dict[str, Any], spike_factor: float) -> str:
    """A line for the updates skipped since `before` (the counts at the previous row) ('' when none)."""
    new = {key: row[key] - before[key] for key in SKIPPED_COUNTS}
    if not any(new.values()):
        return ""
    causes = [f"{new['skipped_nonfinite']} with a NaN/Inf loss or gradient norm"] if new["skipped_nonfinite"] else []
    if new["skipped_spikes"]:
        causes.append(f"{new['skipped_spikes']} with a loss over {spike_factor:g} x its running average")
    total = sum(row[key] for key in SKIPPED_COUNTS)
    return (f"  skipped {sum(new.values())} update(s) by step {row['step']} ({'; '.join(causes)}): their batches "
            f"were used up, nothing else moved; {total} skipped in this run")


def _format_row(row: dict[str, Any]) -> str:
    parts = [f"step {row['step']}", f"loss {row['loss']:.4f}"]
    if row["eval_loss"] is not None:
        parts.append(f"eval_loss {row['eval_loss']:.4f}")
    parts += [f"lr {row['learning_rate']:.2e}", f"grad_norm {row['grad_norm']:.3f}",
              f"{row['step_time_s'] * 1e3:.0f} ms/step", f"{row['tokens_per_s']:,.0f} tok/s",
              f"{row['tflops_per_device']:.3f} TFLOP/s/device",
              "MFU unknown" if row["mfu"] is None else f"MFU {row['mfu']:.1%}"]
    if row.get("moe_load_balance_loss") is not None:
        parts += [f"balance {row['moe_load_balance_loss']:.3f}", f"dropped {row['moe_dropped_fraction']:.1%}"]
    if row.get("mtp_loss") is not None:
        parts.append(f"mtp_loss {row['mtp_loss']:.4f}")
    if row.get("z_loss") is not None:
        parts.append(f"z_loss {row['z_loss']:.3f}")
    if row.get("dpo_reward_accuracy") is not None:
        parts.append(f"reward accuracy {row['dpo_reward_accuracy']:.2f} margin {row['dpo_reward_margin']:.3f}")
    skipped = sum(row.get(key, 0) for key in SKIPPED_COUNTS)
    if skipped:
        parts.append(f"skipped {skipped}")
    return "  ".join(parts)


USAGE = "usage: python -m maxpar.train CONFIG.yml [key=value ...]\nkeys (defaults in configs/base.yml):"


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        stream = sys.stdout if argv else sys.stderr
        print(USAGE, file=stream)
        for key, kind, doc in describe_keys():
            print(f"  {key} ({kind}): {doc}", file=stream)
        return 0 if argv else 2
    try:
        run_config = load_run_config(argv)  # with the model of a checkpoint it starts from
        config = run_config.config
        host_devices.cpu_unless_accelerators()  # before JAX starts: libtpu's warnings where there is no TPU
        if config.compile_topology:  # compile for a TPU topology, report and exit: no local devices used
            from maxpar.plan.compile_report import compile_topology  # the planner's modules: only this command's

            preflight.check_output_directory(config)
            return compile_topology(config, run_directory(config))
        preflight.apply_simulated_devices(config)  # before JAX starts
        preflight.check_output_directory(config)
        distributed.setup(config)  # before any JAX device use
        if run_config.note and jax.process_index() == 0:
            print(run_config.note, flush=True)
        check_local_fit(config, jax.devices(), jax.local_devices())  # before anything is allocated
        malloc_note = malloc.tune(config.cpu_malloc_tuning, jax.default_backend())  # process-wide: the CLI's own
        if malloc_note and jax.process_index() == 0:
            print(f"maxpar: {malloc_note}", flush=True)
        train(config)
    except DataError as e:  # a document that cannot be read, at whatever step: a ConfigError named for what it is
        print(f"maxpar: data error: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"maxpar: config error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"maxpar: {e}", file=sys.stderr)
        return 1
    except checkpoint.CheckpointError as e:
        print(f"maxpar: checkpoint error: {e}", file=sys.stderr)
        return 1
    except storage.StorageError as e:  # a checkpoint save that failed on every attempt; the last metrics upload
        print(f"maxpar: storage error: {e}", file=sys.stderr)
        return STORAGE_EXIT_STATUS
    except Preempted as e:
        print(f"maxpar: {e}", file=sys.stderr)
        return PREEMPTED_EXIT_STATUS
    except KeyboardInterrupt:  # Ctrl-C before the training loop watches for it: nothing to save yet
        print("\nmaxpar: interrupted before training started; nothing was saved", file=sys.stderr)
        return INTERRUPTED_EXIT_STATUS
    except distributed.DistributedError as e:
        print(f"maxpar: {e}", file=sys.stderr)
        return 1
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() == 1:
            raise
        print(f"maxpar: {distributed.peer_failure_message(e)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
