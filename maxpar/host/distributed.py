"""Joining a multi-process job (several hosts, several slices) with JAX's own distributed runtime.

Why a pure spec: what goes wrong in multi-host runs is *which* coordinator, process count and id a
process believes in. `distributed_spec(config, env)` decides that from the config keys and the
environment without starting anything, so every case is testable; `initialize(spec)` only calls JAX.

Environment contract (the variables GKE sets for TPU JobSets and XPK workloads; `launch.local` and the
manifests of `launch.jobset` set the same ones):

    JAX_COORDINATOR_ADDRESS        host or host:port of process 0's coordinator (wins over the next)
    MEGASCALE_COORDINATOR_ADDRESS  host of process 0 (slice 0, worker 0); a port in it is ignored
    JAX_COORDINATOR_PORT           coordinator port when the address has none (default 8482)
    MEGASCALE_NUM_SLICES           number of slices (default 1)
    MEGASCALE_SLICE_ID             this process's slice, 0 .. slices-1 (default 0)
    TPU_WORKER_HOSTNAMES           comma-separated hosts of this slice: hosts per slice = their count (default 1)
    TPU_WORKER_ID                  this host's index within its slice (default: JOB_COMPLETION_INDEX, else 0)
    JOB_COMPLETION_INDEX           set by Kubernetes in every pod of an Indexed Job (each JobSet replica is one)

process count = slices x hosts per slice; process id = slice id x hosts per slice + worker id. The
config keys `coordinator_address`, `num_processes` and `process_id` override the environment;
`coordinator_address=auto` leaves everything to `jax.distributed.initialize()`'s own cluster detection
(TPU VMs, Slurm, Open MPI). One process needs no distributed runtime and starts none.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from maxpar.core.config import Config, ConfigError

DEFAULT_COORDINATOR_PORT = 8482  # JAX's default coordinator port on TPU
AUTO = "auto"
_HOST_PORT = re.compile(r"(?:\[[^\]]+\]|[^:\[\]]+):(\d+)")


class DistributedError(RuntimeError):
    """Joining or running the multi-process job failed; the trainer prints it and exits with status 1."""


@dataclasses.dataclass(frozen=True)
class EnvTopology:
    """What the environment says about the job: where process 0 is and where this process sits."""

    coordinator: str | None
    num_slices: int = 1
    slice_id: int = 0
    hosts_per_slice: int = 1
    worker_id: int = 0

    @property
    def num_processes(self) -> int:
        return self.num_slices * self.hosts_per_slice

    @property
    def process_id(self) -> int:
        return self.slice_id * self.hosts_per_slice + self.worker_id


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    """Arguments for `jax.distributed.initialize`; `coordinator_address=None` means JAX detects them."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    init_timeout_s: int
    heartbeat_timeout_s: int

    def describe(self) -> str:
        if self.coordinator_address is None:
            return "joining the job found by JAX's cluster detection"
        return (f"process {self.process_id} of {self.num_processes} joining coordinator {self.coordinator_address} "
                f"(waits up to {self.init_timeout_s} s for all processes; a peer silent for "
                f"{self.heartbeat_timeout_s} s stops the job)")


def _env_int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigError(f"environment variable {name}={text!r}: expected an integer >= {minimum}")
    return value


def _env_coordinator(env: Mapping[str, str]) -> str | None:
    """host:port of process 0 from JAX_COORDINATOR_ADDRESS or MEGASCALE_COORDINATOR_ADDRESS, else None."""
    port = _env_int(env, "JAX_COORDINATOR_PORT", DEFAULT_COORDINATOR_PORT, 1)
    jax_address = env.get("JAX_COORDINATOR_ADDRESS", "").strip()
    if jax_address:
        return jax_address if _HOST_PORT.fullmatch(jax_address) else f"{jax_address}:{port}"
    megascale = env.get("MEGASCALE_COORDINATOR_ADDRESS", "").strip()
    if megascale:
        host = megascale.rsplit(":", 1)[0] if _HOST_PORT.fullmatch(megascale) else megascale
        return f"{host}:{port}"
    return None


def env_topology(env: Mapping[str, str]) -> EnvTopology:
    """Read the environment contract (see the module docstring); missing variables take their defaults."""
    num_slices = _env_int(env, "MEGASCALE_NUM_SLICES", 1, 1)
    slice_id = _env_int(env, "MEGASCALE_SLICE_ID", 0, 0)
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    hosts_per_slice = max(len(hosts), 1)
    worker_name = "TPU_WORKER_ID" if env.get("TPU_WORKER_ID", "").strip() else "JOB_COMPLETION_INDEX"
    worker_id = _env_int(env, worker_name, 0, 0)
    if slice_id >= num_slices:
        raise ConfigError(f"environment variable MEGASCALE_SLICE_ID={slice_id}: must be < MEGASCALE_NUM_SLICES="
                          f"{num_slices}")
    if worker_id >= hosts_per_slice:
        raise ConfigError(f"environment variable {worker_name}={worker_id}: must be < the {hosts_per_slice} host(s) "
                          f"per slice listed in TPU_WORKER_HOSTNAMES")
    return EnvTopology(_env_coordinator(env), num_slices, slice_id, hosts_per_slice, worker_id)


def distributed_spec(config: Config, env: Mapping[str, str]) -> DistributedSpec | None:
    """How this process joins its job, or None when it runs alone. Config keys win over the environment."""
    timeouts = dict(init_timeout_s=config.distributed_init_timeout_s,
                    heartbeat_timeout_s=config.distributed_heartbeat_timeout_s)
    if config.coordinator_address == AUTO:
        return DistributedSpec(None, None, None, **timeouts)
    topology = env_topology(env)
    num_processes = config.num_processes if config.num_processes != -1 else topology.num_processes
    process_id = config.process_id if config.process_id != -1 else topology.process_id
    coordinator = config.coordinator_address or topology.coordinator
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"process_id={process_id} must be in [0, num_processes={num_processes}) "
                          f"(from the config keys or MEGASCALE_SLICE_ID/TPU_WORKER_ID)")
    if num_processes == 1:
        return None
    if coordinator is None:
        raise ConfigError(f"num_processes={num_processes} needs the coordinator's address: set "
                          f"coordinator_address=HOST:PORT, or JAX_COORDINATOR_ADDRESS / MEGASCALE_COORDINATOR_ADDRESS")
    if not _HOST_PORT.fullmatch(coordinator):
        raise ConfigError(f"coordinator_address={coordinator!r}: expected HOST:PORT (e.g. 10.0.0.2:8482), or 'auto'")
    return DistributedSpec(coordinator, num_processes, process_id, **timeouts)


def initialize(spec: DistributedSpec | None) -> None:
    """Start JAX's distributed runtime per `spec` (nothing for None). Must run before any JAX device use.

    CPU collectives across processes need gloo. The heartbeat timeout is also the shutdown timeout: a
    peer that dies or hangs stops every other process within that bound instead of leaving it waiting.
    """
    if spec is None or jax.distributed.is_initialized():  # already joined: main() may run twice in one process
        return
    print(f"maxpar: {spec.describe()}", file=sys.stderr, flush=True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {}
    if spec.coordinator_address is not None:
        kwargs = dict(coordinator_address=spec.coordinator_address, num_processes=spec.num_processes,
                      process_id=spec.process_id)
    try:
        jax.distributed.initialize(**kwargs, initialization_timeout=spec.init_timeout_s,
                                   heartbeat_timeout_seconds=spec.heartbeat_timeout_s,
                                   shutdown_timeout_seconds=spec.heartbeat_timeout_s)
    except (RuntimeError, ValueError) as e:
        raise DistributedError(f"could not start the distributed runtime ({spec.describe()}): {e}") from None


def setup(config: Config, env: Mapping[str, str] | None = None) -> DistributedSpec | None:
    """Join the job `config` and the environment describe; returns what was joined (None: one process)."""
    spec = distributed_spec(config, os.environ if env is None else env)
    initialize(spec)
    return spec


def peer_failure_message(error: BaseException) -> str:
    """A clear line for a collective that failed in a multi-process job (usually a peer died)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (f"process {jax.process_index()} of {jax.process_count()}: a cross-process operation failed: {first}. "
            f"Another process probably died or hung; its own log says why. Stopping.")


def same_on_all_processes(text: str, max_bytes: int = 256) -> str:
    """Process 0's `text` on every process (e.g. a timestamped run name), so that all write to one place."""
    if jax.process_count() == 1:
        return text
    from jax.experimental import multihost_utils
    data = text.encode()
    if len(data) > max_bytes:
        raise ValueError(f"text of {len(data)} bytes is longer than max_bytes={max_bytes}")
    padded = np.frombuffer(data.ljust(max_bytes, b"\0"), np.uint8)
    agreed = np.asarray(multihost_utils.broadcast_one_to_all(padded))
    return agreed.astype(np.uint8).tobytes().rstrip(b"\0").decode()


# ---------------------------------------------------------------- data iterator state across process counts

def resplit_iterator_states(saved: Sequence[Mapping[str, Any]], current: Mapping[str, Any], process_index: int,
                            process_count: int) -> dict[str, Any]:
    """This process's data iterator state, from the states that a different number of processes saved.

    Why this works: row j of every global batch comes from lane j whatever the process count
    (maxpar/io/data/text.py), and a text iterator's state is its lanes' states in order ("parents").
    Concatenating the saved lanes in process order and cutting them into `process_count` blocks gives
    each process the lanes it now owns. Step-indexed states (synthetic data) are equal everywhere.
    """
    if all(isinstance(s.get("parents"), list) for s in saved) and isinstance(current.get("parents"), list):
        lanes = [lane for state in saved for lane in state["parents"]]
        per_process = len(current["parents"])
        if len(lanes) != per_process * process_count:
            raise ConfigError(f"the checkpoint's data state has {len(lanes)} lanes (global batch rows) but this run "
                              f"has {per_process * process_count}; resume with the same global batch size")
        return {**current, "parents": lanes[process_index * per_process:(process_index + 1) * per_process]}
    if all(state == saved[0] for state in saved):
        return dict(saved[0])
    raise ConfigError(f"the checkpoint's data iterator states, saved by {len(saved)} processes, cannot be re-split "
                      f"for {process_count} processes")


_STATE_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


def read_data_state(directory: epath.Path, current: Mapping[str, Any], process_index: int,
                    process_count: int) -> dict[str, Any]:
    """This process's iterator state from a checkpoint's `data` item (Grain's `process_I-of-N.json` files),
    re-split with `resplit_iterator_states` when another number of processes saved it."""
    own = directory / f"process_{process_index}-of-{process_count}.json"
    if own.is_file():
        return json.loads(own.read_text())
    found = {int(m.group(1)): int(m.group(2)) for p in directory.glob("process_*-of-*.json")
             if (m := _STATE_FILE.fullmatch(p.name))}
    saved_count = max(found.values(), default=0)
    if not found or set(found.values()) != {saved_count} or sorted(found) != list(range(saved_count)):
        raise ConfigError(f"{directory}: expected the data iterator states process_I-of-N.json of all N processes, "
                          f"found {sorted(p.name for p in directory.glob('*.json')) or 'none'}")
    saved = [json.loads((directory / f"process_{i}-of-{saved_count}.json").read_text()) for i in range(saved_count)]
    return resplit_iterator_states(saved, current, process_index, process_count)
