"""Regression: a 2-process job over DCN trains exactly like 1 process, resumes across process counts,
and stops within the heartbeat bound when a process dies or hangs.

    python end_to_end/multislice.py [--steps 10] [--rtol 1e-5] [key=value ...]

On CPU over localhost, with `python -m launch.local`:
  1. 1 process x 8 devices  (ici_data_parallelism=2 ici_fsdp_parallelism=4)
  2. 2 processes x 4 devices (dcn_data_parallelism=2 ici_fsdp_parallelism=4), checkpoint half-way
  3. 1 process x 8 devices resumed from run 2's half-way checkpoint
  4. run 2's job again, rank 1 killed (SIGKILL) after step 3; then again with rank 1 hung (SIGSTOP)
  5. run 2's job for 200 steps, preempted (SIGTERM to the launcher) after step 3: both ranks must stop
     at the same step with a checkpoint; the same command then resumes, and its losses must equal an
     uninterrupted run's
Prints the per-step losses, their differences and the timings, then a PASS/FAIL line; exits
non-zero on FAIL. Data: the default corpus (this Python's standard library), float32, a tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]
from verdict import exit_with  # end_to_end/verdict.py

REPO = prepare(devices=None)  # every run is a child process with its own devices

from maxpar.tools.testbed import MICRO_MODEL  # noqa: E402

MODEL = ["model_name=micro", *MICRO_MODEL, "max_target_length=64", "dtype=float32", "weight_dtype=float32",
         "warmup_steps=2", "learning_rate=3e-3", "log_period=1", "eval_interval=-1", "per_device_batch_size=1"]
ONE = ["ici_data_parallelism=2", "ici_fsdp_parallelism=4"]
TWO = ["dcn_data_parallelism=2", "ici_fsdp_parallelism=4"]
HEARTBEAT_S = 10
GRACE_S = 3


class Job:
    """`python -m launch.local ...` in the background, its output kept line by line."""

    def __init__(self, processes: int, devices: int, config_args: list[str], grace_s: float = GRACE_S):
        self.lines: list[str] = []
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launch.local", "--num_processes", str(processes), "--devices_per_process",
             str(devices), "--grace_s", str(grace_s), "--timeout_s", "900", "--", "configs/base.yml", *config_args],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> re.Match | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            time.sleep(0.1)
        return None

    def finish(self, timeout: float = 900) -> tuple[int, float]:
        code = self.proc.wait(timeout=timeout)
        time.sleep(0.2)  # let the reader thread drain the pipe
        return code, time.perf_counter() - self.start

    def tail(self, n: int = 30) -> str:
        return "\n".join(line for line in self.lines[-n:])


def metrics(run_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def mean_step_ms(rows: dict[int, dict]) -> float:
    """Mean step time after the first step (which includes warm-up)."""
    times = [row["step_time_s"] for step, row in rows.items() if step > min(rows)]
    return 1e3 * sum(times) / max(len(times), 1)


def train(name: str, processes: int, devices: int, args: list[str], failures: list[str]) -> None:
    if failures:  # an earlier run failed, so this one's inputs are missing
        return
    job = Job(processes, devices, args)
    code, seconds = job.finish()
    print(f"  {name:<38} {seconds:6.1f} s")
    if code:
        failures.append(f"{name} exited with status {code}:\n{job.tail()}")


def stop_one(how: str, args: list[str], failures: list[str]) -> None:
    """Start the 2-process job, then kill or stop rank 1 after step 3; the launcher must exit non-zero in time."""
    job = Job(2, 4, args)
    pid = job.wait_for(r"rank 1 pid (\d+)", 60)
    if pid is None or job.wait_for(r"^\[rank 0\] step 3 ", 600) is None:
        failures.append(f"{how}: the job did not reach step 3:\n{job.tail()}")
        job.proc.kill()
        return
    start = time.perf_counter()
    os.kill(int(pid.group(1)), signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    code, _ = job.finish(timeout=HEARTBEAT_S + GRACE_S + 120)
    seconds = time.perf_counter() - start
    bound = HEARTBEAT_S + GRACE_S + 15
    verdict = "ok" if code != 0 and seconds < bound else "FAIL"
    print(f"  rank 1 {how:<6}: launcher exit status {code} after {seconds:5.1f} s (bound {bound} s) {verdict}")
    if verdict != "ok":
        failures.append(f"{how}: exit status {code} after {seconds:.1f} s")


def preempt_and_resume(common: list[str], out: Path, failures: list[str]) -> None:
    """SIGTERM the 2-process job after step 3; rerunning the same command must continue it exactly."""
    args = [*common, *TWO, "steps=200", "checkpoint_period=1000"]
    train("2 x 4, 200 steps, uninterrupted", 2, 4, [*args, "run_name=whole", "enable_checkpointing=false"], failures)
    if failures:
        return
    job = Job(2, 4, [*args, "run_name=preempted"], grace_s=120)
    if job.wait_for(r"^\[rank 0\] step 3 ", 600) is None:
        failures.append(f"preemption: the job did not reach step 3:\n{job.tail()}")
        job.proc.kill()
        return
    job.proc.send_signal(signal.SIGTERM)
    code, _ = job.finish(timeout=300)
    stops = {int(m.group(1)): int(m.group(2)) for line in job.lines
             if (m := re.search(r"\[rank (\d)\].*preempted \(SIGTERM\) after step (\d+): checkpoint step", line))}
    written = sorted(int(p.name) for p in (out / "preempted" / "checkpoints").glob("[0-9]*"))
    print(f"  preempted after step 3: launcher exit status {code}; ranks stopped at {stops}; checkpoints {written}")
    if code == 0 or sorted(stops) != [0, 1] or len(set(stops.values())) != 1 or written != [stops[0]]:
        failures.append(f"preemption: expected both ranks to stop at one checkpointed step:\n{job.tail()}")
        return
    train(f"same command again: resumes at step {stops[0] + 1}", 2, 4, [*args, "run_name=preempted"], failures)
    if failures:
        return
    whole, resumed = ({s: r["loss"] for s, r in metrics(out / name).items()} for name in ("whole", "preempted"))
    worst = max(abs(resumed[s] - whole[s]) / abs(whole[s]) for s in whole) if sorted(resumed) == sorted(whole) else None
    print(f"  preempted + resumed vs uninterrupted, 200 steps: max relative loss difference {worst}")
    if worst is None or worst > 0:
        failures.append(f"preemption: resumed losses differ from the uninterrupted run ({worst})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rtol", type=float, default=1e-5, help="per-step losses must agree to this")
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = parser.parse_args()
    failures: list[str] = []
    half = args.steps // 2
    with tempfile.TemporaryDirectory() as out:
        common = [*MODEL, f"steps={args.steps}", f"base_output_directory={out}", f"checkpoint_period={half}",
                  "max_checkpoints_to_keep=0", *args.overrides]
        print("runs (wall time, including start-up and compilation):")
        train("1 process x 8 devices", 1, 8, [*common, *ONE, "run_name=one", "enable_checkpointing=false"], failures)
        train("2 processes x 4 devices (DCN data)", 2, 4, [*common, *TWO, "run_name=two"], failures)
        if not failures:
            checkpoints = Path(out) / "two" / "checkpoints"
            shutil.copytree(checkpoints / str(half), Path(out) / "resumed" / "checkpoints" / str(half))
        train(f"1 x 8 resumed from 2 x 4 at step {half}", 1, 8, [*common, *ONE, "run_name=resumed"], failures)
        preempt_and_resume(common, Path(out), failures)
        if failures:
            print("FAIL: " + "; ".join(failures))
            return 1
        rows = {name: metrics(Path(out) / name) for name in ("one", "two", "resumed")}
    one, two, res = ({step: row["loss"] for step, row in rows[name].items()} for name in ("one", "two", "resumed"))
    print(f"mean step time after step 1: 1 x 8 {mean_step_ms(rows['one']):.0f} ms, "
          f"2 x 4 {mean_step_ms(rows['two']):.0f} ms")
    if sorted(two) != sorted(one) or sorted(res) != list(range(half + 1, args.steps + 1)):
        print(f"FAIL: logged steps differ: 1 x 8 {sorted(one)}, 2 x 4 {sorted(two)}, resumed {sorted(res)}")
        return 1
    print("\nstep   1 x 8 loss    2 x 4 loss    |diff|      resumed - 2 x 4")
    for step in sorted(one):
        resumed = f"{abs(res[step] - two[step]):.2e}" if step in res else ""
        print(f"{step:>4}   {one[step]:.7f}     {two[step]:.7f}     {abs(two[step] - one[step]):.2e}    {resumed}")
    worst = max([abs(two[s] - one[s]) / abs(one[s]) for s in one] + [abs(res[s] - two[s]) / abs(two[s]) for s in res])
    print(f"max relative difference {worst:.2e} (tolerance {args.rtol:g})")
    if worst > args.rtol:
        failures.append(f"losses differ (max relative difference {worst:.2e})")
    print("\nfailures (2 processes x 4 devices, heartbeat timeout "
          f"{HEARTBEAT_S} s, launcher grace {GRACE_S} s):")
    with tempfile.TemporaryDirectory() as out:
        endless = [*MODEL, *TWO, "steps=100000", "enable_checkpointing=false", f"base_output_directory={out}",
                   "run_name=endless", f"distributed_heartbeat_timeout_s={HEARTBEAT_S}"]
        stop_one("killed", endless, failures)
        stop_one("hung", endless, failures)
    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print(f"PASS: 2 x 4 over DCN equals 1 x 8 (max relative loss difference {worst:.1e}), resumes across process "
          f"counts and after a preemption, and a dead or hung process stops the job within the bound")
    return 0


if __name__ == "__main__":
    exit_with(main)
