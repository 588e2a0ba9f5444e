"""`python -m maxpar.tools.bench_checkpoint --checkpoint`: what a checkpoint save costs the training loop.

The loop calls `checkpoint.save` right after a step. With async checkpointing the call returns once
the state is copied off the device and the data position captured; the files are written while
later steps run. This times, for the default tiny model (configs/models/tiny.yml) on synthetic data
and the devices JAX sees, plain steps, steps that end in a save (the step plus that call), and the
steps right after a save (which share the machine with the background write), for async saving and,
for contrast, synchronous saving. It uses the real trainer pieces (`setup_run`, the compiled step,
`checkpoint.make_manager` / `checkpoint.save`). `--tiers` times, for the default model and a ~100M one, a
synchronous save and a full restore to local disk and to a bucket (gcp-storage-emulator on loopback, objects on
disk: the `test` extra), and the step-time overhead of async saves to each, interleaved. Numbers are printed (and, with --record DIR, written as a
`maxpar.tools.records` record), never asserted.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from maxpar.tools import records

REPO = Path(__file__).resolve().parents[2]
BASE_CONFIG = REPO / "configs" / "base.yml"
RUN = ("dataset_type=synthetic", "eval_interval=-1", "enable_checkpointing=true", "max_checkpoints_to_keep=2")


def time_steps(steps: int, period: int, warmup: int, extra: Sequence[str]) -> dict[str, Any]:
    """Median seconds of plain steps, of steps that end in an async or a sync save, and of the steps after.

    One run saves alternately through an async and a sync manager, so that both modes are timed under
    the same machine load (a shared CPU's load drifts between separate runs).
    """
    import jax

    from maxpar.io import checkpoint
    from maxpar.core.config import load_config
    from maxpar.train import global_batch, setup_run
    from maxpar.training.train_step import create_state

    config = load_config([str(BASE_CONFIG), *RUN, f"steps={warmup + steps}", *extra])
    run = setup_run(config)
    state = create_state(run.model, run.tx, run.layout, run.mesh)
    step_fn = run.compile_train_step()
    iterator = iter(run.train_data)
    times: dict[str, list[float]] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as directory:
        managers = {mode: checkpoint.make_manager(Path(directory) / mode,
                                                  dataclasses.replace(config, async_checkpointing=mode == "async"))
                    for mode in ("async", "sync")}
        for manager in managers.values():  # first-call setup, untimed
            checkpoint.save(manager, 0, state, iterator, config, run.shape.global_rows)
            manager.wait_until_finished()
        previous = "plain"
        for step in range(1, warmup + steps + 1):
            batch = global_batch(next(iterator), run.in_sharding)
            jax.block_until_ready(batch)
            start = time.perf_counter()
            state, metrics = step_fn(state, batch)
            jax.block_until_ready((state, metrics))
            stepped = time.perf_counter()
            mode = ("async", "sync")[(step // period) % 2] if step % period == 0 else None
            if mode:  # the call blocks for the device-to-host copy and the small items only when async
                checkpoint.save(managers[mode], step, state, iterator, config, run.shape.global_rows)
            end = time.perf_counter()
            if step > warmup:
                times[f"{mode} save" if mode else previous].append(end - start)
                if mode:
                    times[f"{mode} save call"].append(end - stepped)
            previous = f"after {mode} save" if mode else "plain"
        for manager in managers.values():
            manager.wait_until_finished()
            manager.close()
    return {"devices": len(run.devices), "tokens_per_step": run.shape.tokens_per_step,
            **{kind: statistics.median(values) for kind, values in times.items()}}


# ---------------------------------------------------------------- --tiers: local disk against a bucket

# A ~100M-parameter member of the default family (configs/models/tiny.yml's shape, scaled): 12 layers of emb 768.
MODELS = {"tiny": (), "100m": ("emb_dim=768", "num_query_heads=12", "num_kv_heads=4", "head_dim=64", "mlp_dim=2048",
                               "num_decoder_layers=12", "vocab_size=16384")}
BUCKET = "maxpar-bench"


def _state_bytes(state: Any) -> int:
    import jax
    return sum(leaf.nbytes for leaf in jax.tree.leaves((state.params, state.opt_state)))


def time_tiers(model: str, tiers: dict[str, str], rounds: int, block: int, extra: Sequence[str]) -> dict[str, Any]:
    """For one model and each tier (name -> directory, local or gs://): seconds of a synchronous save and of a full
    restore (as a resume validates one), and the time of a block of `block` steps that starts with an async save
    (the block ends when the save has completed) as a ratio to a block without one, blocks interleaved over the
    tiers `rounds` times so that every tier sees the same load."""
    import jax

    from maxpar.core.config import load_config
    from maxpar.io import checkpoint
    from maxpar.train import global_batch, setup_run
    from maxpar.training.train_step import create_state

    config = load_config([str(BASE_CONFIG), *RUN, *MODELS[model], "async_checkpointing=true", "max_checkpoints_to_keep=1",
                          f"steps={1 + rounds * (len(tiers) + 1) * block}", *extra])
    run = setup_run(config)
    state = create_state(run.model, run.tx, run.layout, run.mesh)
    step_fn = run.compile_train_step()
    iterator = iter(run.train_data)
    managers = {tier: checkpoint.make_manager(directory, config) for tier, directory in tiers.items()}
    figures: dict[str, Any] = {"model": model, "parameters": sum(x.size for x in jax.tree.leaves(state.params)),
                               "state_bytes": _state_bytes(state), "tokens_per_step": run.shape.tokens_per_step}

    def step(state):
        state, metrics = step_fn(state, global_batch(next(iterator), run.in_sharding))
        jax.block_until_ready((state, metrics))
        return state

    state = step(state)  # compiled and warm
    for tier, manager in managers.items():
        start = time.perf_counter()
        checkpoint.save(manager, 0, state, iterator, config, run.shape.global_rows)
        manager.wait_until_finished()
        figures[f"{tier} save s"] = time.perf_counter() - start
        start = time.perf_counter()
        jax.block_until_ready(checkpoint.resume_step(manager, 0, run.restore_target(), iter(run.train_data)))
        figures[f"{tier} restore s"] = time.perf_counter() - start
    blocks: dict[str, list[float]] = collections.defaultdict(list)
    saved = 0
    for _ in range(rounds):
        for tier in ("plain", *managers):
            start = time.perf_counter()
            for index in range(block):
                state = step(state)
                if index == 0 and tier in managers:
                    saved += 1
                    checkpoint.save(managers[tier], saved, state, iterator, config, run.shape.global_rows)
            if tier in managers:
                managers[tier].wait_until_finished()
            blocks[tier].append(time.perf_counter() - start)
    for manager in managers.values():
        manager.close()
    plain = statistics.median(blocks["plain"])
    figures.update({"block steps": block, "rounds": rounds, "plain block s": plain,
                    **{f"{tier} block ratio": statistics.median(blocks[tier]) / plain for tier in managers}})
    return figures


def tiers_table(results: Sequence[dict[str, Any]], tiers: Sequence[str]) -> str:
    lines = ["| model | parameters | state MB | tier | save s | save MB/s | restore s | restore MB/s | "
             "steps with an async save / without |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        megabytes = r["state_bytes"] / 1e6
        for tier in tiers:
            lines.append(f"| {r['model']} | {r['parameters'] / 1e6:.0f}M | {megabytes:.0f} | {tier} | "
                         f"{r[f'{tier} save s']:.2f} | {megabytes / r[f'{tier} save s']:.0f} | "
                         f"{r[f'{tier} restore s']:.2f} | {megabytes / r[f'{tier} restore s']:.0f} | "
                         f"{r[f'{tier} block ratio']:.2f}x |")
    return "\n".join(lines)


def run_tiers(models: Sequence[str], rounds: int, block: int, extra: Sequence[str]) -> dict[str, Any]:
    """`time_tiers` for each model, to a temporary local directory and to a bucket on an emulator started here."""
    from maxpar.core import storage
    from maxpar.tools.emulator import Server

    with tempfile.TemporaryDirectory() as directory:
        server = Server(BUCKET, Path(directory) / "emulator.log", data_dir=Path(directory) / "objects")
        os.environ[storage.EMULATOR] = server.start()
        try:
            tiers = {"local disk": str(Path(directory) / "local"), "bucket (emulator)": f"gs://{BUCKET}/bench"}
            results = [time_tiers(model, {t: f"{d}/{model}" for t, d in tiers.items()}, rounds, block, extra)
                       for model in models]
        finally:
            server.stop()
    return {"tiers": list(tiers), "models": results}


def table(r: dict[str, Any]) -> str:
    plain = r["plain"]
    lines = [f"plain step: {plain:.3f} s", "",
             "| save mode | step + save s | ratio to a plain step | of which the save call s | "
             "step after a save s | ratio |", "|---|---|---|---|---|---|"]
    for mode in ("async", "sync"):
        lines.append(f"| {mode} | {r[f'{mode} save']:.3f} | {r[f'{mode} save'] / plain:.2f}x | "
                     f"{r[f'{mode} save call']:.3f} | {r[f'after {mode} save']:.3f} | "
                     f"{r[f'after {mode} save'] / plain:.2f}x |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    load_start = records.load_average()
    parser = argparse.ArgumentParser(prog="python -m maxpar.tools.bench_checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", action="store_true", help="time what checkpoint saves cost the loop")
    parser.add_argument("--tiers", action="store_true", help="time saves, restores and async-save overhead to local "
                        "disk and to a bucket (an emulator on loopback, started here) for --models")
    parser.add_argument("--models", default="tiny,100m", help=f"with --tiers: comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--rounds", type=int, default=3, help="with --tiers: interleaved rounds of step blocks")
    parser.add_argument("--block", type=int, default=6, help="with --tiers: steps per block")
    parser.add_argument("--steps", type=int, default=48, help="timed steps")
    parser.add_argument("--period", type=int, default=4, help="save every N steps, alternately async and sync")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    records.add_record_option(parser)
    args = parser.parse_args(argv)
    if args.period < 3 or args.steps < 2 * args.period:
        parser.error("need --period >= 3 and --steps >= 2 x --period")
    if args.tiers:
        return _main_tiers(args, argv, load_start)
    result = time_steps(args.steps, args.period, args.warmup, args.set)
    print(f"maxpar checkpoint bench: tiny model, {result['tokens_per_step']:,} tokens/step on {result['devices']} "
          f"device(s); medians of {args.steps} steps, a save every {args.period} (async and sync alternately)")
    print(table(result))
    if args.record:
        path = records.write_record(args.record, "bench_checkpoint",
                                    ["python", "-m", "maxpar.tools.bench_checkpoint", *argv],
                                    {**result, "steps": args.steps, "period": args.period}, load_start)
        print(f"maxpar checkpoint bench: record {path}")
    return 0


def _main_tiers(args: argparse.Namespace, argv: Sequence[str], load_start: Sequence[float]) -> int:
    result = run_tiers(args.models.split(","), args.rounds, args.block, args.set)
    print(f"maxpar checkpoint bench: save and restore per tier; blocks of {args.block} steps, medians of "
          f"{args.rounds} interleaved rounds")
    print(tiers_table(result["models"], result["tiers"]))
    if args.record:
        path = records.write_record(args.record, "bench_checkpoint_tiers",
                                    ["python", "-m", "maxpar.tools.bench_checkpoint", *argv], result, load_start)
        print(f"maxpar checkpoint bench: record {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
