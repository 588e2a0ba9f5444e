"""Imports point one way: each spine module imports only the modules before it (docs/architecture.md, "The import rule")."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "maxpar"
# The spine in order; a module may import only modules of earlier (or its own) layers.
SPINE = [
    ["maxpar.axes"], ["maxpar.config"], ["maxpar.mesh"], ["maxpar.sharding"], ["maxpar.pipeline.schedule"],
    ["maxpar.layout"], ["maxpar.pipeline.spmd"], ["maxpar.model"], ["maxpar.optimizer"], ["maxpar.train_step"],
    ["maxpar.cadence", "maxpar.guards", "maxpar.profiler"], ["maxpar.train", "maxpar.preflight", "maxpar.summary"],
]
LOOP = SPINE[-1]  # the entry point: may use the planner (fit before you run) and the tools (simulated devices)
# Import the spine's lower part.
BESIDE = ["maxpar.data", "maxpar.metrics", "maxpar.distributed", "maxpar.checkpoint", "maxpar.logs"]
ABOVE = ["maxpar.plan", "maxpar.convert", "maxpar.tools", "maxpar.generate"]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
    found |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    for node in ast.walk(tree):  # `from maxpar import checkpoint` names a module too
        if isinstance(node, ast.ImportFrom) and node.module == "maxpar":
            found |= {f"maxpar.{a.name}" for a in node.names}
    return {name for name in found if name.startswith("maxpar.")}


def layer_of(module: str) -> int | None:
    for index, layer in enumerate(SPINE):
        if any(module == m or module.startswith(m + ".") for m in layer):
            return index
    return None


def within(module: str, groups: list[str]) -> bool:
    return any(module == g or module.startswith(g + ".") for g in groups)


def test_spine_modules_import_only_earlier_layers():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        own = layer_of(module)
        if own is None:
            continue
        for imported in imports(path):
            other = layer_of(imported)
            if within(imported, BESIDE + ABOVE) and module not in LOOP:
                wrong.append(f"{module} imports {imported}, which sits beside or above the spine")
            elif other is not None and other > own:
                wrong.append(f"{module} imports {imported}, a later layer")
    assert not wrong, "\n".join(wrong)


def test_modules_beside_the_spine_import_nothing_above_it():
    wrong = [f"{module_name(p)} imports {i}" for p in sorted(PACKAGE.rglob("*.py"))
             if within(module_name(p), BESIDE) for i in imports(p)
             if within(i, ABOVE) or within(i, LOOP)]
    assert not wrong, "\n".join(wrong)
