"""Regression: checkpoints resume exactly after kill -9 and SIGTERM, and restore onto other meshes.

    python end_to_end/checkpoint.py [--steps 40] [--period 8] [--seed 0]

On 8 simulated CPU devices with the micro model (maxpar/tools/testbed.py) and a small generated corpus:

1. an uninterrupted FSDP(8) run of `--steps` steps (the reference);
2. the same command killed with SIGKILL at a random step and restarted: every per-step loss must be
   bitwise identical to the reference, and metrics.jsonl must read as one run;
3. the same with SIGTERM: exit status 75 and a checkpoint of the step it stopped at, then exact resume;
4. the reference's first checkpoint restored onto FSDP(4)xTP(2), DP(2)xFSDP(4), 1 device and unrolled
   layers: the restored state must equal the FSDP(8) restore exactly, and the following steps' losses
   must match the reference within --rtol.

Prints the figures and a final PASS/FAIL line; exits non-zero on FAIL.
"""

from __future__ import annotations

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=8)

import argparse  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from verdict import exit_with  # noqa: E402 - end_to_end/verdict.py (this script's folder is sys.path[0])


import jax  # noqa: E402
import numpy as np  # noqa: E402

from maxpar.tools.testbed import (compilation_cache_env, logged_steps, read_metrics, start_training, micro_config,  # noqa: E402
                     train_command, wait_for_step, wait_until, write_corpus)
from maxpar import checkpoint  # noqa: E402
from maxpar.model import stack  # noqa: E402
from maxpar.train import setup_run, train  # noqa: E402
from maxpar.training.guards import PREEMPTED_EXIT_STATUS

MESHES = {  # name -> (overrides, devices); the global batch stays 8 rows
    "fsdp4_tp2": (("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"), 8),
    "dp2_fsdp4": (("ici_data_parallelism=2", "ici_fsdp_parallelism=4"), 8),
    "one": (("per_device_batch_size=8",), 1),
    "fsdp8_unrolled": (("scan_layers=false",), 8),
}


def run_overrides(corpus: str, args: argparse.Namespace) -> list[str]:
    return ["dataset_type=text", f"dataset_path={corpus}", "per_device_batch_size=1", f"steps={args.steps}",
            f"checkpoint_period={args.period}", "enable_checkpointing=true", "max_checkpoints_to_keep=0"]


def interrupted_run(out: Path, name: str, sig: signal.Signals, stop_after: int, args: argparse.Namespace,
                    corpus: str) -> dict:
    """Run the CLI, send `sig` once step `stop_after` is logged (and a checkpoint is complete), rerun to the end."""
    command = train_command(*run_overrides(corpus, args), f"base_output_directory={out}", f"run_name={name}")
    run_dir, env = out / name, compilation_cache_env(out / "jax_cache")
    first = start_training(command, out / f"{name}.1.log", env)
    wait_for_step(first, run_dir, stop_after)
    wait_until(first, lambda: any(p.name.isdigit() for p in (run_dir / "checkpoints").glob("*")),
               "a checkpoint was complete")
    first.send_signal(sig)
    status = first.wait(timeout=300)
    stopped_at = max(logged_steps(run_dir))
    second = start_training(command, out / f"{name}.2.log", env)
    final_status = second.wait(timeout=600)
    log = (out / f"{name}.2.log").read_text(errors="replace")
    resumed = re.search(r"resumed from checkpoint at step (\d+)", log)
    return {"status": status, "stopped_at": stopped_at, "final_status": final_status,
            "resumed_from": int(resumed[1]) if resumed else None, "rows": read_metrics(run_dir),
            "tail": log[-2000:]}


def exactness_failures(name: str, result: dict, reference: list[dict], expected_status: int, steps: int) -> list[str]:
    rows = result["rows"]
    failures = []
    if result["status"] != expected_status:
        failures.append(f"{name}: first run exited {result['status']}, expected {expected_status}")
    if result["final_status"] != 0 or result["resumed_from"] is None:
        failures.append(f"{name}: restart exited {result['final_status']} without resuming:\n{result['tail']}")
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        failures.append(f"{name}: metrics.jsonl steps are {[r['step'] for r in rows]}, not 1..{steps} once each")
    unequal = [r["step"] for r, e in zip(rows, reference) if r["loss"] != e["loss"]]
    if unequal:
        failures.append(f"{name}: losses differ from the uninterrupted run at steps {unequal}")
    return failures


def restore_state(run_dir: Path, config, devices, step: int):
    run = setup_run(config, devices)
    manager = checkpoint.make_manager(run_dir, config)
    try:
        target = run.restore_target()
        return jax.tree.map(np.asarray, checkpoint.resume_step(manager, step, target, iter(run.train_data)))
    finally:
        manager.close()


def canonical_host(state, config):
    """Host arrays in the canonical (stacked) layout, so scanned and unrolled restores compare leaf by leaf."""
    if config.scan_layers:
        return state
    return state.replace(params=stack.to_canonical(state.params, config, stack=np.stack),
                         opt_state=stack.to_canonical(state.opt_state, config, stack=np.stack))


def max_abs_difference(a, b) -> float:
    return max(float(np.max(np.abs(x - y), initial=0.0)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def resharding(out: Path, reference_dir: Path, reference: list[dict], args: argparse.Namespace, corpus: str
               ) -> tuple[list[str], list[str]]:
    """(table lines, failures) for restoring the reference's first checkpoint onto each mesh and training on."""
    step = args.period
    base = restore_state(reference_dir, micro_config(*run_overrides(corpus, args)), jax.devices(), step)
    lines, failures = [], []
    for name, (overrides, num_devices) in MESHES.items():
        config = micro_config(*run_overrides(corpus, args), *overrides)
        devices = jax.devices()[:num_devices]
        state_diff = max_abs_difference(canonical_host(restore_state(reference_dir, config, devices, step), config),
                                        base)
        run_dir = out / f"reshard_{name}"
        shutil.copytree(reference_dir / "checkpoints" / str(step), run_dir / "checkpoints" / str(step))
        train(config, devices=devices, run_dir=run_dir)
        got = [r["loss"] for r in read_metrics(run_dir)]
        want = [r["loss"] for r in reference[step:]]
        loss_diff = max(abs(g - w) for g, w in zip(got, want))
        rel_diff = max(abs(g - w) / abs(w) for g, w in zip(got, want))
        lines.append(f"{name:<15} {state_diff:>16.3g} {loss_diff:>16.3g} {rel_diff:>16.3g}")
        if state_diff != 0.0:
            failures.append(f"{name}: restored state differs from the FSDP(8) restore by {state_diff:g}")
        if len(got) != len(want) or rel_diff > args.rtol:
            failures.append(f"{name}: losses after the restore differ by up to {rel_diff:.3g} relative (> {args.rtol})")
    return lines, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="steps of every run")
    parser.add_argument("--period", type=int, default=8, help="checkpoint_period")
    parser.add_argument("--seed", type=int, default=0, help="chooses the steps at which the runs are stopped")
    parser.add_argument("--rtol", type=float, default=1e-5, help="relative loss tolerance after a resharded restore")
    args = parser.parse_args()
    if not args.period + 2 <= args.steps - args.period:
        parser.error("need --steps >= 2 x --period + 2, so that a stop can land between checkpoints")
    rng = random.Random(args.seed)
    kill_at, term_at = (rng.randint(args.period + 1, args.steps - args.period) for _ in range(2))

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        corpus = write_corpus(out / "corpus")
        command = train_command(*run_overrides(corpus, args), f"base_output_directory={out}", "run_name=reference")
        reference_process = start_training(command, out / "reference.log", compilation_cache_env(out / "jax_cache"))
        if reference_process.wait(timeout=600):
            print((out / "reference.log").read_text()[-3000:])
            print("FAIL: the reference run exited with an error")
            return 1
        reference = read_metrics(out / "reference")

        killed = interrupted_run(out, "killed", signal.SIGKILL, kill_at, args, corpus)
        preempted = interrupted_run(out, "preempted", signal.SIGTERM, term_at, args, corpus)
        failures = (exactness_failures("kill -9", killed, reference, -signal.SIGKILL, args.steps)
                    + exactness_failures("SIGTERM", preempted, reference, PREEMPTED_EXIT_STATUS, args.steps))
        if preempted["resumed_from"] != preempted["stopped_at"]:
            failures.append(f"SIGTERM: stopped after step {preempted['stopped_at']} but resumed from "
                            f"{preempted['resumed_from']}")
        table, reshard_failures = resharding(out, out / "reference", reference, args, corpus)
        failures += reshard_failures

    print(f"maxpar checkpoint regression: tiny model, {args.steps} steps, checkpoint every {args.period}, "
          f"8 CPU devices")
    for name, result in (("kill -9", killed), ("SIGTERM", preempted)):
        equal = sum(r["loss"] == e["loss"] for r, e in zip(result["rows"], reference))
        print(f"  {name:<8} stopped after step {result['stopped_at']} (exit {result['status']}), resumed from step "
              f"{result['resumed_from']}; {equal}/{args.steps} losses bitwise equal to the uninterrupted run")
    print(f"  restore of FSDP(8) step {args.period}:  max |state diff|  max |loss diff|  max rel loss diff")
    for line in table:
        print(f"  {line}")
    if failures:
        for failure in failures:
            print(f"  - {failure}")
        print(f"FAIL: {len(failures)} check(s) failed (listed above)")
        return 1
    print("PASS: exact resume after kill -9 and SIGTERM; identical state and matching losses on every mesh")
    return 0


if __name__ == "__main__":
    exit_with(main)
