"""Run an N-process maxpar job on this machine, wired like a multi-slice job on GKE.

    python -m launch.local --num_processes 2 --devices_per_process 4 -- \\
        configs/base.yml dcn_data_parallelism=2 ici_fsdp_parallelism=4

Every process gets its own simulated CPU devices and the environment contract of
`maxpar/host/distributed.py` (one host per slice: MEGASCALE_NUM_SLICES = N, MEGASCALE_SLICE_ID = rank, the
coordinator on 127.0.0.1 at a free port), so the `dcn_*` degrees apply across processes exactly as
across TPU slices. Output lines are prefixed with `[rank R]`; Gloo's "is connected to all its peers" lines
are dropped unless the config says log_level=debug. When any process exits non-zero the
others are stopped (SIGTERM, then SIGKILL after a grace period) and the launcher exits non-zero, its
last line naming the rank that failed first (a dead or hung coordinator, rank 0, included) after the
others' C++ stack dumps; a process that hangs is caught by the trainer's `distributed_heartbeat_timeout_s`. All processes share
one process group that the launcher kills on every way out, and on Linux each one also dies with the
launcher, so none is left behind.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import IO

from maxpar.core.config import ConfigError, load_config
from maxpar.host.devices import with_device_count

LOCALHOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class LaunchArgs:
    num_processes: int
    devices_per_process: int
    module: str
    args: tuple[str, ...]
    timeout_s: float
    grace_s: float


def parse_args(argv: Sequence[str]) -> LaunchArgs:
    """Command line -> LaunchArgs; argparse reports bad input with exit status 2."""
    parser = argparse.ArgumentParser(prog="python -m launch.local", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_processes", type=int, required=True, help="processes to start (= slices)")
    parser.add_argument("--devices_per_process", type=int, default=1, help="simulated CPU devices per process")
    parser.add_argument("--module", default="maxpar.train", help="module each process runs with `python -m`")
    parser.add_argument("--timeout_s", type=float, default=0, help="stop the whole job after this long (0 = never)")
    parser.add_argument("--grace_s", type=float, default=10,
                        help="seconds the processes get after SIGTERM (e.g. to save a checkpoint) before SIGKILL")
    parser.add_argument("args", nargs="*", help="arguments for every process (after --), e.g. CONFIG.yml key=value")
    parsed = parser.parse_args(argv)
    for name in ("num_processes", "devices_per_process"):
        if getattr(parsed, name) < 1:
            parser.error(f"--{name}={getattr(parsed, name)}: must be >= 1")
    if parsed.timeout_s < 0 or parsed.grace_s < 0:
        parser.error("--timeout_s and --grace_s must be >= 0")
    return LaunchArgs(parsed.num_processes, parsed.devices_per_process, parsed.module, tuple(parsed.args),
                      parsed.timeout_s, parsed.grace_s)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOCALHOST, 0))
        return sock.getsockname()[1]


def rank_env(base: Mapping[str, str], rank: int, num_processes: int, devices_per_process: int,
             port: int) -> dict[str, str]:
    """The environment of process `rank`: the base plus the multi-slice contract and its CPU devices."""
    env = {k: v for k, v in base.items() if k not in _CONTRACT}
    env.update({
        "JAX_COORDINATOR_ADDRESS": f"{LOCALHOST}:{port}",
        "JAX_COORDINATOR_BIND_ADDRESS": f"{LOCALHOST}:{port}",  # JAX's default listens on every interface
        "MEGASCALE_NUM_SLICES": str(num_processes),
        "MEGASCALE_SLICE_ID": str(rank),
        "XLA_FLAGS": with_device_count(base.get("XLA_FLAGS", ""), devices_per_process),
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",
    })
    return env


# Variables of the contract that must not leak in from the launcher's own environment.
_CONTRACT = ("JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_BIND_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS",
             "JAX_COORDINATOR_PORT", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "TPU_WORKER_HOSTNAMES",
             "TPU_WORKER_ID", "JOB_COMPLETION_INDEX")


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL if the launcher dies (Linux), so nothing outlives it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


# Gloo (the CPU collectives across processes) prints this on stdout from C++, unconditionally, for every group of
# processes a collective connects; no environment variable or log level turns it off, so the launcher drops it.
# Its threads print at once, so one line may hold pieces of several messages, and a message may span two lines.
_GLOO_CONNECTED = re.compile(r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
                             r"Expected number of connected peer ranks is : (\d+)")
_GLOO_PIECES = re.compile(r"(?:\[Gloo\]|Rank|\d+|is connected to|peer ranks\.|"
                          r"Expected number of connected peer ranks is :|\s)+")


def is_gloo_all_connected(line: str) -> bool:
    """Whether `line` is Gloo's message that a rank connected to every peer it expected, or pieces of such
    messages run together. A whole message that a rank connected to fewer is a real problem: that line is kept."""
    text = line.strip()
    if message := _GLOO_CONNECTED.fullmatch(text):
        return message.group(1) == message.group(2)
    return not text.isdigit() and bool(_GLOO_PIECES.fullmatch(text))


def shows_library_logs(args: Sequence[str]) -> bool:
    """Whether the processes' config asks for the libraries' logs on the terminal (log_level=debug); arguments
    that are not a maxpar config (another --module's) ask for nothing."""
    try:
        return load_config(list(args)).log_level == "debug"
    except (ConfigError, OSError, ValueError):
        return False


def _forward(rank: int, stream: IO[bytes], out: IO[str], lock: threading.Lock, quiet: bool) -> None:
    """Copy one process's output line by line, each line prefixed with its rank (`quiet`: without Gloo's
    all-connected lines)."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        if quiet and is_gloo_all_connected(line):
            continue
        with lock:
            out.write(f"[rank {rank}] {line}\n")
            out.flush()


# What a SIGABRT (exit 134, a C++ stack dump) from a rank means: JAX's distributed runtime aborts the process
# from C++ when its coordinator stops answering, which Python cannot intercept (jax.distributed.initialize
# in JAX 0.12 has no missed-heartbeat hook), so the launcher says it instead.
RUNTIME_ABORT = ("JAX's distributed runtime aborted it: it lost the coordinator (rank 0) or a peer, which died or hung; "
                 "the C++ stack dump above is that abort, and the first rank to fail says why")
# A healthy coordinator that sees a peer fail makes every rank fail, itself too, within moments; one that is
# still running this long after a peer's runtime aborted has stopped answering (hung, frozen, or stopped).
COORDINATOR_GRACE_S = 3.0


def _is_abort(code: int | None) -> bool:
    return code in (-signal.SIGABRT, 128 + signal.SIGABRT)


def _how(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def _exit_status(code: int) -> int:
    """Shell convention: a process killed by signal S counts as 128 + S."""
    return code if code > 0 else 128 - code


@dataclasses.dataclass(frozen=True, order=True)
class Exit:
    """One process's exit, `at` the `time.monotonic()` when the launcher's wait on it returned."""

    at: float
    rank: int
    code: int


def first_failure(exits: Iterable[Exit]) -> Exit | None:
    """The failure that happened first: a peer that a failed rank takes down exits moments later, and a lower rank
    seen failed at the same look must not be blamed for it."""
    return min((e for e in exits if e.code != 0), default=None)


def _report_exit(rank: int, proc: subprocess.Popen, exits: queue.Queue[Exit]) -> None:
    """Wait for one process and report its exit with the time it happened (to within a thread wake-up)."""
    code = proc.wait()
    exits.put(Exit(time.monotonic(), rank, code))


def _reported(exits: queue.Queue[Exit], timeout_s: float) -> list[Exit]:
    """The exits reported so far, waiting up to `timeout_s` for one if there are none yet."""
    try:
        got = [exits.get(timeout=timeout_s)]
    except queue.Empty:
        return []
    while not exits.empty():
        got.append(exits.get_nowait())
    return got


class Job:
    """The N processes of one local job, all in one process group."""

    def __init__(self, args: LaunchArgs, out: IO[str] = sys.stdout, err: IO[str] = sys.stderr):
        self.args, self.out, self.err = args, out, err
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        self.exits: queue.Queue[Exit] = queue.Queue()
        self.verdict: str | None = None  # why the job failed, said again as the launcher's last line

    def say(self, message: str) -> None:
        with self.lock:
            self.err.write(f"maxpar: {message}\n")
            self.err.flush()

    def start(self) -> None:
        port = free_port()
        command = [sys.executable, "-m", self.args.module, *self.args.args]
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        for rank in range(self.args.num_processes):
            group = 0 if rank == 0 else self.procs[0].pid
            env = rank_env(os.environ, rank, self.args.num_processes, self.args.devices_per_process, port)
            self.procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, process_group=group, preexec_fn=preexec))
        # Threads only after every fork: preexec_fn is not safe while other threads run.
        quiet = not shows_library_logs(self.args.args)
        for rank, proc in enumerate(self.procs):
            thread = threading.Thread(target=_forward, args=(rank, proc.stdout, self.out, self.lock, quiet),
                                      daemon=True)
            thread.start()
            self.threads.append(thread)
            threading.Thread(target=_report_exit, args=(rank, proc, self.exits), daemon=True).start()
        pids = ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(self.procs))
        self.say(f"{self.args.num_processes} process(es) x {self.args.devices_per_process} device(s), "
                 f"coordinator {LOCALHOST}:{port}; {pids}")

    def wait(self) -> int:
        """Exit status of the job: 0 when all succeed, else the first failure's (124 on timeout)."""
        deadline = time.monotonic() + self.args.timeout_s if self.args.timeout_s else None
        exited: list[Exit] = []
        while True:
            exited += _reported(self.exits, timeout_s=0.05)
            if failed := first_failure(exited):
                return self._failed(failed.rank, failed.code)
            if len(exited) == len(self.procs):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                self.say(f"the job did not finish within --timeout_s={self.args.timeout_s:g}; stopping it")
                return 124

    def _failed(self, rank: int, code: int) -> int:
        """Say which rank failed first and what that means for the others; returns the job's exit status."""
        if rank == 0:
            self.say(f"rank 0 (the coordinator) {_how(code)}; stopping the other processes")
            self.verdict = (f"the job failed because rank 0, the coordinator, {_how(code)}: the other ranks lost it, so "
                            f"any C++ stack dump (signal 6) of theirs above is JAX's distributed runtime aborting them "
                            f"for that; rank 0's own output says why it failed (e.g. a peer stopped sending heartbeats), "
                            f"unless it was killed")
        elif _is_abort(code) and self._coordinator_outlives_abort():
            self.say(f"rank {rank} {_how(code)}; rank 0 (the coordinator) is still running {COORDINATOR_GRACE_S:g} s "
                     f"later instead of failing with it, so it has hung; stopping the processes")
            self.verdict = (f"the job failed because rank 0, the coordinator, stopped answering (hung or frozen) while "
                            f"still running: rank {rank}'s JAX distributed runtime lost it and aborted (signal 6, the "
                            f"C++ stack dump above); what rank 0 printed once stopped (e.g. that rank {rank} stopped "
                            f"sending heartbeats) follows from its own hang")
        else:
            note = f" ({RUNTIME_ABORT})" if _is_abort(code) else ""
            self.say(f"rank {rank} {_how(code)}{note}; stopping the other processes")
            self.verdict = f"the job failed because rank {rank} {_how(code)}{note}"
        return _exit_status(code)

    def _coordinator_outlives_abort(self) -> bool:
        """After a peer's runtime aborted: is rank 0 still running COORDINATOR_GRACE_S later (so it is hung)?"""
        end = time.monotonic() + COORDINATOR_GRACE_S
        while time.monotonic() < end:
            if self.procs[0].poll() is not None:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL it after the grace period, and reap every process."""
        if not self.procs:
            return
        group = self.procs[0].pid
        for sig in (signal.SIGTERM, signal.SIGCONT):  # SIGCONT: a stopped (hung) process must see the SIGTERM
            _signal_group(group, sig)
        end = time.monotonic() + self.args.grace_s
        while time.monotonic() < end and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        _signal_group(group, signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        for thread in self.threads:
            thread.join(timeout=5)


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Interrupted(Exception):
    """The launcher itself got SIGINT or SIGTERM."""


def _raise_interrupted(signum: int, _frame) -> None:
    raise _Interrupted(signum)


def run(args: LaunchArgs) -> int:
    """Start the job, wait for it, and always leave no process behind."""
    job = Job(args)
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        job.start()
        return job.wait()
    except _Interrupted as e:
        job.say(f"got signal {e.args[0]}; stopping every process")
        return 128 + int(e.args[0])
    finally:
        job.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if job.verdict:  # after every rank's last output (often C++ stack dumps), so the cause is the last word
            job.say(job.verdict)


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
