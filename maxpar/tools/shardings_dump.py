"""Golden parameter shardings: every parameter's logical axes and mesh PartitionSpec per preset strategy.

    python -m maxpar.tools.shardings_dump            # print the JSON
    python -m maxpar.tools.shardings_dump --check    # compare with tests/goldens/shardings.json; exit 1 on a diff
    python -m maxpar.tools.shardings_dump --update   # rewrite the golden file (an intended change)

The tiny default model on a mesh of 8 devices: the shardings are the run layout's
(`maxpar.core.layout.resolve_layout`, the trainer's and the planner's one source), resolved on an abstract
mesh, so a change to the rules, the presets or the model's logical axes shows up as a golden diff and no
device is needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import jax
import optax

from maxpar.core.config import Config, load_config
from maxpar.core.layout import is_spec
from maxpar.core.mesh import resolve_mesh_shape
from maxpar.tools.testbed import MICRO_MODEL
from maxpar.training.train_step import run_layout

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "goldens" / "shardings.json"
NUM_DEVICES = 8
# The tests' micro model (maxpar/tools/testbed.py).
MODEL = ["model_name=micro", *MICRO_MODEL, "max_target_length=32", "dtype=float32", "weight_dtype=float32"]
STRATEGIES: dict[str, tuple[str, list[str]]] = {
    "dp8": ("base.yml", ["ici_data_parallelism=8", "ici_fsdp_parallelism=1"]),
    "fsdp8": ("base.yml", ["ici_fsdp_parallelism=8"]),
    "fsdp4_tp2": ("base.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    "dp2_fsdp2_tp2": ("base.yml", ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"]),
    "fsdp_transpose": ("fsdp_transpose.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    "tp_sequence": ("tp_sequence.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    "tp_transpose": ("tp_transpose.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    "dp8_zero1": ("base.yml", ["ici_data_parallelism=8", "ici_fsdp_parallelism=1", "shard_optimizer_over_data=true"]),
    "dp2_fsdp2_tp2_zero1": ("base.yml", ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                                         "shard_optimizer_over_data=true"]),
    "pp2_fsdp4_circular_ag_per_repeat": ("base.yml", ["ici_stage_parallelism=2", "ici_fsdp_parallelism=4",
                                                      "num_decoder_layers=4", "num_pipeline_repeats=2",
                                                      "num_pipeline_microbatches=2", "pipeline_fsdp_ag_per_repeat=true"]),
    "pp2_fsdp2_tp2_circular": ("base.yml", ["ici_stage_parallelism=2", "ici_fsdp_parallelism=2",
                                            "ici_tensor_parallelism=2", "num_decoder_layers=4",
                                            "num_pipeline_repeats=2"]),
    "moe_ep2_pp2_dp2": ("base.yml", ["num_experts=8", "num_experts_per_tok=2", "ici_expert_parallelism=2",
                                     "ici_stage_parallelism=2", "ici_data_parallelism=2", "ici_fsdp_parallelism=1"]),
    "moe_ep4_fsdp2": ("base.yml", ["num_experts=8", "num_experts_per_tok=2", "ici_expert_parallelism=4",
                                   "ici_fsdp_parallelism=2"]),
    "cp4_fsdp2_ring": ("base.yml", ["ici_context_parallelism=4", "ici_fsdp_parallelism=2", "attention=blockwise",
                                    "context_parallel_strategy=ring"]),
    # Qwen3-MoE's shape: QK-norm scales (head_dim) beside heads split by TP, experts by EP.
    "qwen3_moe_ep2_fsdp2_tp2": ("base.yml", ["qk_norm=true", "num_experts=8", "num_experts_per_tok=2",
                                             "ici_expert_parallelism=2", "ici_fsdp_parallelism=2",
                                             "ici_tensor_parallelism=2"]),
}


def _spec(spec: Any) -> list[Any]:
    """A PartitionSpec as JSON: None, an axis name, or a list of axis names per dimension."""
    return [None if entry is None else str(entry) if isinstance(entry, str) else [str(e) for e in entry]
            for entry in spec]


def strategy_shardings(config: Config) -> dict[str, Any]:
    """{mesh: {axis: degree}, params: {path: {shape, logical, mesh}}} for `config` on 8 devices."""
    shape = resolve_mesh_shape(config, NUM_DEVICES)
    layout = run_layout(config, shape)
    leaves = jax.tree_util.tree_leaves_with_path(layout.state.abstract.params)
    logical_leaves = jax.tree_util.tree_leaves(layout.state.specs.params, is_leaf=is_spec)
    mesh_leaves = jax.tree_util.tree_leaves(layout.state_specs.params, is_leaf=is_spec)
    params = {}
    for (path, leaf), logical_spec, mesh_spec in zip(leaves, logical_leaves, mesh_leaves, strict=True):
        name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        params[name] = {"shape": list(leaf.shape), "logical": _spec(logical_spec), "mesh": _spec(mesh_spec)}
    result = {"mesh": {a: d for a, d in zip(shape.axis_names, shape.shape) if d > 1}, "params": params}
    if config.shard_optimizer_over_data:  # ZeRO-1: the moments are sharded apart from the parameters
        result["moments"] = moment_specs(layout.state.abstract, layout.state_specs)
    return result


def moment_specs(abstract: Any, specs: Any) -> dict[str, Any]:
    """The AdamW first moment's mesh PartitionSpec per parameter (the second moment's is the same)."""
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    adam_abstract = [x for x in jax.tree.leaves(abstract.opt_state, is_leaf=is_adam) if is_adam(x)][0]
    adam_specs = [x for x in jax.tree.leaves(specs.opt_state, is_leaf=is_adam) if is_adam(x)][0]
    leaves = jax.tree_util.tree_leaves_with_path(adam_abstract.mu)
    return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): _spec(spec)
            for (path, _), spec in zip(leaves, jax.tree_util.tree_leaves(adam_specs.mu, is_leaf=is_spec), strict=True)}


def dump() -> dict[str, Any]:
    return {name: strategy_shardings(load_config([str(REPO / "configs" / file), *MODEL, *overrides]))
            for name, (file, overrides) in STRATEGIES.items()}


def to_json(data: dict[str, Any]) -> str:
    """JSON with one line per parameter, so a golden diff in review reads line by line."""
    blocks = []
    for name, entry in data.items():
        params = ",\n".join(f"   {json.dumps(p)}: {json.dumps(v)}" for p, v in entry["params"].items())
        moments = ""
        if "moments" in entry:
            lines = ",\n".join(f"   {json.dumps(p)}: {json.dumps(v)}" for p, v in entry["moments"].items())
            moments = f',\n  "moments": {{\n{lines}\n  }}'
        blocks.append(f' {json.dumps(name)}: {{\n  "mesh": {json.dumps(entry["mesh"])},\n  "params": {{\n{params}\n  }}'
                      f'{moments}\n }}')
    return "{\n" + ",\n".join(blocks) + "\n}\n"


def diff(golden: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Readable differences, one line each (empty when equal)."""
    lines = []
    for name in sorted(set(golden) | set(current)):
        if name not in current:
            lines.append(f"{name}: strategy missing now (in golden)")
            continue
        if name not in golden:
            lines.append(f"{name}: new strategy (not in golden)")
            continue
        g, c = golden[name], current[name]
        if g["mesh"] != c["mesh"]:
            lines.append(f"{name}: mesh {g['mesh']} -> {c['mesh']}")
        for param in sorted(set(g["params"]) | set(c["params"])):
            gp, cp = g["params"].get(param), c["params"].get(param)
            if gp is None:
                lines.append(f"{name}: {param}: new parameter {cp}")
            elif cp is None:
                lines.append(f"{name}: {param}: parameter removed (was {gp})")
            else:
                for key in ("shape", "logical", "mesh"):
                    if gp[key] != cp[key]:
                        lines.append(f"{name}: {param}: {key} {gp[key]} -> {cp[key]}")
        gm, cm = g.get("moments", {}), c.get("moments", {})
        for param in sorted(set(gm) | set(cm)):
            if gm.get(param) != cm.get(param):
                lines.append(f"{name}: moments of {param}: {gm.get(param)} -> {cm.get(param)}")
    return lines


def check(path: Path = GOLDEN) -> list[str]:
    if not path.exists():
        return [f"{path} does not exist"]
    return diff(json.loads(path.read_text(encoding="utf-8")), dump())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help=f"compare with {GOLDEN.relative_to(REPO)}")
    group.add_argument("--update", action="store_true", help=f"rewrite {GOLDEN.relative_to(REPO)}")
    args = parser.parse_args(argv)
    if args.check:
        lines = check()
        for line in lines:
            print(line)
        if lines:
            print(f"FAIL: {len(lines)} sharding difference(s) from {GOLDEN.relative_to(REPO)}; if intended, "
                  f"regenerate with `python -m maxpar.tools.shardings_dump --update`")
            return 1
        print(f"PASS: shardings of {len(STRATEGIES)} strategies match {GOLDEN.relative_to(REPO)}")
        return 0
    data = dump()
    text = to_json(data)
    assert json.loads(text) == data
    if args.update:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text, encoding="utf-8")
        print(f"wrote {GOLDEN.relative_to(REPO)}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
