"""`python -m maxpar.tools.bench_checkpoint --checkpoint`: what a checkpoint save costs the training loop.

The loop calls `checkpoint.save` right after a step. With async checkpointing the call returns once
the state is copied off the device and the data position captured; the files are written while
later steps run. This times, for the default tiny model (configs/models/tiny.yml) on synthetic data
and the devices JAX sees, plain steps, steps that end in a save (the step plus that call), and the
steps right after a save (which share the machine with the background write), for async saving and,
for contrast, synchronous saving. It uses the real trainer pieces (`setup_run`, the compiled step,
`checkpoint.make_manager` / `checkpoint.save`). Numbers are printed (and, with --record DIR, written as a
`maxpar.tools.records` record), never asserted.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
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
    parser.add_argument("--checkpoint", action="store_true", help="time checkpoint saves (the only mode)")
    parser.add_argument("--steps", type=int, default=48, help="timed steps")
    parser.add_argument("--period", type=int, default=4, help="save every N steps, alternately async and sync")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    records.add_record_option(parser)
    args = parser.parse_args(argv)
    if args.period < 3 or args.steps < 2 * args.period:
        parser.error("need --period >= 3 and --steps >= 2 x --period")
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


if __name__ == "__main__":
    sys.exit(main())
