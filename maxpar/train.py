"""`python -m maxpar.train CONFIG.yml [key=value ...]`: the training loop.

config -> mesh -> sharded state -> jitted step -> loop with logging, eval and
checkpoints. Everything device-dependent starts here, never while parsing config.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import grain
import jax
import numpy as np
import optax
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from tqdm import tqdm

from maxpar.core import storage
from maxpar.core.config import EXPLICIT_BACKWARD, Config, ConfigError, describe_keys, load_config, model_config, to_yaml
from maxpar.core.layout import BatchShape, RunLayout, check_devices
from maxpar.core.mesh import build_mesh, local_mesh_shape
from maxpar.core.op_schedule import OpSchedule
from maxpar.core.schedule import Schedule
from maxpar.host import distributed, malloc, preflight
from maxpar.io import checkpoint, local_checkpoint, logs
from maxpar.io.data.errors import DataError
from maxpar.io.data.mixture import SOURCE_TOKENS
from maxpar.io.data.pipeline import SourceData, open_datasets
from maxpar.io.metrics import (MetricsWriter, parameter_counts, peak_flops, rewind_metrics, throughput,
                               training_flops_per_token)
from maxpar.model import Transformer
from maxpar.plan.fit import check_local_fit
from maxpar.training import summary
from maxpar.training.cadence import StepTimer, cadence
from maxpar.training.guards import (INTERRUPTED_EXIT_STATUS, PREEMPTED_EXIT_STATUS, STORAGE_EXIT_STATUS, LossCheck,
                                    Preempted, PreemptionWatch, StepsInFlight, StepWatchdog)
from maxpar.training.optimizer import make_optimizer
from maxpar.training.profiler import StepProfiler, profile_window
from maxpar.training.train_step import compile_train_step, create_state, jit_eval_step, layout_check


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Assemble global arrays from each process's rows."""
    return {key: jax.make_array_from_process_local_data(sharding, value) for key, value in local.items()}


def run_directory(config: Config) -> epath.Path:
    name = config.run_name or distributed.same_on_all_processes(time.strftime("run_%Y%m%d_%H%M%S"))
    return storage.path(config.base_output_directory) / name


def _evaluate(eval_step, params, dataset_factory, steps: int, sharding) -> float:
    """Mean loss over the first `steps` batches of a fresh eval iterator (comparable over time)."""
    iterator = iter(dataset_factory())
    totals = [eval_step(params, global_batch(next(iterator), sharding)) for _ in range(steps)]
    loss_sum = sum(float(t["loss_sum"]) for t in totals)
    tokens = sum(float(t["tokens"]) for t in totals)
    return loss_sum / max(tokens, 1.0)


def _eval_losses(run: RunSetup, eval_step, params) -> dict[str, float]:
    """eval_loss; a mixture's eval_loss/NAME for each source with held-out documents too, and as eval_loss their
    mean weighted by the mixture's weights: the held-out loss in the proportions the run trains on."""
    config = run.config
    if not run.sources:
        return {"eval_loss": _evaluate(eval_step, params, run.eval_data, config.eval_steps, run.in_sharding)}
    evaluated = [s for s in run.sources if s.eval]
    losses = {s.name: _evaluate(eval_step, params, s.eval, config.eval_steps, run.in_sharding) for s in evaluated}
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
    def pipeline(self) -> Schedule | None:
        return self.layout.pipeline

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
        """Ahead-of-time compiled train step for this run's state and batch layout."""
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


def _print_header(run: RunSetup, run_dir: epath.Path, peak: float | None, log: Callable[[str], None]) -> None:
    config, devices = run.config, run.devices
    counts = parameter_counts(run.abstract_state.params, config.num_experts_per_tok)
    mesh_desc = run.layout.mesh.describe()
    log(f"maxpar: run {run_dir}" + ("" if config.run_name else f" (to resume it later: run_name={run_dir.name})"))
    log(f"  model {config.model_name or 'custom'}: {counts['total']:,} parameters "
        f"({counts['non_embedding']:,} non-embedding, {counts['active']:,} active per token), "
        f"{config.num_decoder_layers} layers, emb {config.emb_dim}")
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
    if run.pipeline is not None:
        if config.pipeline_schedule in EXPLICIT_BACKWARD:  # the backward is scheduled too: maxpar.core.op_schedule
            ops = OpSchedule(config.pipeline_schedule, run.pipeline.num_stages, run.pipeline.num_microbatches,
                             run.pipeline.num_repeats)
            log(f"  {ops.describe()}")
        else:
            log(f"  {run.pipeline.describe()}")
        log(f"    layers per stage: {run.pipeline.assignment()}")
    log(f"  library logs (absl, Orbax, JAX): {library_log(run_dir)}"
        + (" (one file per process)" if jax.process_count() > 1 else "")
        + ("; also printed here (log_level=debug)" if config.log_level == "debug" else ""))


def initial_state(run: RunSetup, manager: Any, iterator: Any, log: Callable[[str], None], local: Any = None) -> Any:
    """Where training starts: this run's newest usable checkpoint in either tier (restoring `iterator` too), else
    load_full_state_path, else load_parameters_path (fresh optimizer), else a fresh init."""
    config = run.config
    target = run.restore_target()
    warn = checkpoint.warn_stderr if jax.process_index() == 0 else (lambda _: None)
    found = local_checkpoint.resume_tiers(manager, local, target, iterator, warn) if manager else None
    if found is not None:
        state, tier = found
        log(f"  resumed from checkpoint at step {int(state.step)} ({tier})")
        return state
    if config.load_full_state_path:
        state = checkpoint.load_full_state(config.load_full_state_path, target, warn)
        log(f"  started from the full state at step {int(state.step)} of {config.load_full_state_path}; "
            f"the data starts from its beginning")
        return state
    if config.load_parameters_path:
        params = checkpoint.load_parameters(config.load_parameters_path, target, warn)
        log(f"  started from the parameters of {config.load_parameters_path}; fresh optimizer state, step 0")
        return checkpoint.state_from_params(params, run.tx, target)
    return create_state(run.model, run.tx, run.layout, run.mesh)


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
    _print_header(run, run_dir, peak, log)

    iterator = iter(run.train_data)
    manager = checkpoint.make_manager(run_dir, config) if config.enable_checkpointing else None
    local = local_checkpoint.make_local_manager(run_dir.name, config) if manager else None
    warn = checkpoint.warn_stderr if lead else (lambda _: None)
    saver = checkpoint.Saver.of(manager, config, warn) if manager else None
    writer, bar = None, None
    profiler = StepProfiler(profile_window(config), run_dir, log)
    try:
        with PreemptionWatch() as preemption, StepWatchdog(config.step_timeout_s) as watchdog:
            state = initial_state(run, manager, iterator, log, local)
            start = int(state.step)
            if lead and rewind_metrics(run_dir / "metrics.jsonl", start):
                log(f"  metrics.jsonl: dropped the rows after step {start}; they are logged again from here")

            compile_start = time.perf_counter()
            step_fn = run.compile_train_step()
            log(f"  compiled the train step in {time.perf_counter() - compile_start:.1f} s")
            has_eval = run.eval_data or any(s.eval for s in run.sources)
            eval_fn = jit_eval_step(run.model, run.layout, run.mesh) if has_eval else None

            writer = MetricsWriter(run_dir, enabled=lead)
            if lead:
                (run_dir / "config.yml").write_text(to_yaml(config), encoding="utf-8")
            bar = tqdm(total=config.steps, initial=start, disable=None if lead else True, unit="step",
                       dynamic_ncols=True)
            row: dict[str, Any] = {}
            when = cadence(config, has_eval_data=eval_fn is not None, checkpointing=manager is not None)
            timer, losses = StepTimer(), LossCheck(enabled=config.stop_on_nan)
            in_flight = StepsInFlight()  # a stop requested now waits for about one step, not for all dispatched
            skipped_before = skipped_counts(state.opt_state)  # the updates skipped before the last row (or start)

            def log_step(step: int, metrics: dict[str, Any], params: Any = None, late: bool = False) -> dict[str, Any]:
                """Read, evaluate (given `params`) and write one metrics row, and a line for the updates skipped since
                the previous row. A row read `late` ends the timer's window where the step ended: the next step is
                already running."""
                row = _metrics_row(run, step, jax.device_get(metrics), timer.per_step(), peak)
                if late:
                    timer.restart()
                if params is not None:
                    row.update(_eval_losses(run, eval_fn, params))
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
                    row = log_step(step, metrics, state.params if due.eval else None)
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
                                       sampling):
            log(line)
    return row


def _metrics_row(run: RunSetup, step: int, metrics: dict[str, Any], step_time_s: float,
                 peak: float | None) -> dict[str, Any]:
    """One metrics.jsonl line (eval_loss filled in by the caller on eval steps)."""
    return {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
            "learning_rate": float(metrics["learning_rate"]), "eval_loss": None,
            **throughput(run.config, tokens_per_step=run.shape.tokens_per_step, step_time_s=step_time_s,
                         num_devices=len(run.devices), peak=peak),
            **{key: float(value) for key, value in metrics.items() if key.startswith(("moe_", "mtp_", "z_loss"))},
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
        config = load_config(argv)
        preflight.apply_simulated_devices(config)  # before JAX starts
        preflight.check_output_directory(config)
        distributed.setup(config)  # before any JAX device use
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
