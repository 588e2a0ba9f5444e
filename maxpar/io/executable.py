"""`compiled_trainstep_file`: a compiled train step kept on disk, so that a run starts without compiling.

The file holds JAX's serialized executable (`jax.experimental.serialize_executable`), its argument and result
trees, and what it was compiled for: device kind and count, platform, mesh, topology name and the config. A run
loads it only when its own devices are of that kind and number and its config equals that one in every key that
enters the step (a learning rate or a loss weight is a constant of the program: a changed one would otherwise be
ignored without a word); anything else is one line naming both. The file is a pickle of an executable: load only
files you made (JAX's own warning for serialized executables).
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Sequence
from typing import Any

from etils import epath
from omegaconf import OmegaConf

from maxpar.core import storage
from maxpar.core.config import Config, ConfigError, to_yaml

# The keys that do not enter the compiled train step: where a run writes and what it reads and loads, how often it
# logs, evaluates and saves, how its processes start, sampling, planning and compiling. Every other key shapes the
# program or is a constant in it.
RUN_ONLY_KEYS = frozenset({
    "run_name", "base_output_directory", "seed", "max_new_tokens", "temperature", "top_k", "top_p", "log_period",
    "log_level", "eval_interval", "eval_steps", "eval_fraction", "checkpoint_period", "enable_checkpointing",
    "async_checkpointing", "max_checkpoints_to_keep", "save_attempts", "save_retry_delay_s", "save_retry_max_delay_s",
    "local_checkpoint_directory", "local_checkpoint_period", "load_parameters_path", "load_full_state_path",
    "stop_on_nan", "skip_memory_check", "num_simulated_devices", "cpu_malloc_tuning", "peak_flops_per_device",
    "profiler", "profiler_start_step", "profiler_steps", "dataset_type", "dataset_path", "grain_file_type",
    "dataset_text_field", "hf_path", "hf_data_files", "hf_train_split", "hf_eval_split", "tokenizer_path",
    "chat_template_path", "coordinator_address", "num_processes", "process_id", "distributed_init_timeout_s",
    "distributed_heartbeat_timeout_s", "step_timeout_s", "hardware", "num_devices", "compile_topology",
    "compile_topology_num_slices", "compiled_trainstep_file"})

FORMAT = "maxpar-compiled-train-step/1"


@dataclasses.dataclass(frozen=True)
class CompiledFor:
    """What a serialized train step was compiled for."""

    platform: str
    device_kind: str
    num_devices: int
    mesh: str           # the run layout's mesh, e.g. "fsdp=64x2"
    topology: str       # compile_topology's name, or "local" for the devices of the process that compiled it
    config_yaml: str    # the config it was compiled from

    def describe(self) -> str:
        where = f"{self.topology}: " if self.topology != "local" else ""
        return f"{where}{self.num_devices} {self.device_kind} device(s), mesh {self.mesh}"


def save_executable(compiled: Any, path: str, compiled_for: CompiledFor) -> epath.Path:
    """Write `compiled` (a jax.stages.Compiled) with its provenance to `path` (local or gs://)."""
    from jax.experimental import serialize_executable
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    target = storage.path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(pickle.dumps({"format": FORMAT, "compiled_for": dataclasses.asdict(compiled_for),
                                     "payload": payload, "in_tree": in_tree, "out_tree": out_tree}))
    return target


def read_header(path: str) -> tuple[CompiledFor, dict[str, Any]]:
    """(what the file was compiled for, its contents); ConfigError when it is missing or not such a file."""
    source = storage.path(path)
    key = "compiled_trainstep_file"
    if not source.exists():
        raise ConfigError(f"{key}={path!r}: no such file (write one with compile_topology=NAME {key}=PATH)")
    try:
        contents = pickle.loads(source.read_bytes())
    except Exception as e:  # unpickling raises many kinds
        raise ConfigError(f"{key}={path!r}: not a compiled train step ({type(e).__name__}: {e})") from None
    if not isinstance(contents, dict) or contents.get("format") != FORMAT:
        raise ConfigError(f"{key}={path!r}: not a maxpar compiled train step ({FORMAT})")
    return CompiledFor(**contents["compiled_for"]), contents


def changed_keys(compiled_from: str, config: Config) -> list[str]:
    """`key=this run's value (compiled with: its value)` for each key outside RUN_ONLY_KEYS in which `config` differs
    from the config (YAML) a step was compiled from."""
    theirs, ours = (OmegaConf.to_container(OmegaConf.create(text)) for text in (compiled_from, to_yaml(config)))
    return [f"{key}={ours.get(key)!r} (compiled with {theirs.get(key)!r})"
            for key in sorted(ours.keys() | theirs.keys())
            if key not in RUN_ONLY_KEYS and ours.get(key) != theirs.get(key)]


def load_executable(path: str, devices: Sequence[Any], mesh_description: str, config: Config) -> Any:
    """The train step of `path`, loaded onto `devices`, whose kind, number and mesh must be the ones it was
    compiled for, as must `config`'s keys that enter the step."""
    compiled_for, contents = read_header(path)
    here = CompiledFor(devices[0].platform, devices[0].device_kind, len(devices), mesh_description, "local", "")
    if (compiled_for.device_kind, compiled_for.num_devices, compiled_for.mesh) != (
            here.device_kind, here.num_devices, here.mesh):
        raise ConfigError(f"compiled_trainstep_file={path!r} was compiled for {compiled_for.describe()}; this run "
                          f"has {here.describe()}: compile it for these devices, or set compiled_trainstep_file=''")
    changed = changed_keys(compiled_for.config_yaml, config)
    if changed:
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        raise ConfigError(f"compiled_trainstep_file={path!r} was compiled from another config: "
                          f"{'; '.join(changed[:4])}{more}; compile it again with these keys, or set "
                          f"compiled_trainstep_file=''")
    from jax.experimental import serialize_executable
    return serialize_executable.deserialize_and_load(contents["payload"], contents["in_tree"], contents["out_tree"],
                                                     backend=devices[0].client, execution_devices=list(devices))
