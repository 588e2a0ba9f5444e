"""Imports point one way, down an explicit list of layers (docs/architecture.md, "The import rule")."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "maxpar"
# Every module of maxpar/ and launch/ belongs to the most specific unit (a module or package) named here. A module
# imports only units of its own or an earlier layer, and no units import each other in a cycle. The package's folders
# are the layers: core/ (what a run is), pipeline/, model/, training/ (the step and the loop's policies), io/ and host/
# beside them, plan/, then the entry points (train, generate, convert, tools) and launch/.
LAYERS = [
    # core/, bottom up: user paths (local or gs://), axis names, the pipeline schedules (the config's values among
    # them), config, mesh, sharding rules, the explicit-backward op tables, run layout
    ["maxpar.core.storage"], ["maxpar.core.axes"], ["maxpar.core.schedule"], ["maxpar.core.config"],
    ["maxpar.core.mesh"], ["maxpar.core.sharding"], ["maxpar.core.op_schedule"], ["maxpar.core.layout"],
    ["maxpar.pipeline"],  # the SPMD loop over stages: generic, so the model imports it
    ["maxpar.model"],
    # training/: the guards (the step's bad-step test among them), Muon, the optimizer, which parameters train, DPO's
    # loss, the jitted step, then the loop's policies and its summary
    ["maxpar.training.guards"], ["maxpar.training.muon"], ["maxpar.training.optimizer"], ["maxpar.training.trainable"],
    ["maxpar.training.dpo"], ["maxpar.training.train_step"],
    ["maxpar.training.cadence", "maxpar.training.profiler", "maxpar.training.summary"],
    ["maxpar.io", "maxpar.host"],  # beside the spine: data, checkpoints, metrics, logs; the process and its host
    ["maxpar.plan"],  # the planner
    ["maxpar.train"],  # the loop: checks the planner's memory fit before it runs
    ["maxpar.convert", "maxpar.generate", "maxpar.tools"],  # above the loop
    ["launch"],
]
UNITS = {unit: layer for layer, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# Every module but the empty package markers (__init__.py files with nothing in them).
MODULES = {module_name(p): p for top in ("maxpar", "launch") for p in sorted((ROOT / top).rglob("*.py"))
           if p.name != "__init__.py" or p.read_text().strip()}


def imports(path: Path) -> set[str]:
    """The maxpar and launch modules `path` imports, function-local and relative imports included."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(filter(None, [base, node.module]))
            found |= {f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names}
    return found & MODULES.keys()


def unit_of(module: str) -> str | None:
    return max((u for u in UNITS if module == u or module.startswith(u + ".")), key=len, default=None)


def within(module: str, groups: list[str]) -> bool:
    return any(module == g or module.startswith(g + ".") for g in groups)


def test_every_module_is_in_a_layer():
    assert len(UNITS) == sum(map(len, LAYERS)), "a unit named twice in LAYERS"
    missing = [module for module in MODULES if unit_of(module) is None]
    assert not missing, (f"{missing}: add each to LAYERS in tests/test_architecture.py and to the module map in "
                         f"docs/architecture.md")


def edges() -> list[tuple[str, str, str, str]]:
    """(module, its unit, imported module, its unit) for every import between classified modules."""
    return [(module, unit_of(module), imported, unit_of(imported)) for module, path in MODULES.items()
            for imported in imports(path) if unit_of(module) and unit_of(imported)]


def test_imports_point_down_the_layers():
    wrong = [f"{module} imports {imported}, a later layer" for module, unit, imported, other in edges()
             if UNITS[other] > UNITS[unit]]
    assert not wrong, "\n".join(wrong)


def test_units_import_each_other_without_a_cycle():
    graph = {unit: set() for unit in UNITS}
    for _, unit, _, other in edges():
        graph[unit] |= {other} - {unit}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"an import cycle: {' -> '.join(e.args[1])}") from None


# ---------------------------------------------------------------- one reader of parallelism

# The modules that read the ici_/dcn_*_parallelism degrees and name the physical mesh axes; every other module
# asks the run layout (maxpar/core/layout.py: `RunLayout`, `ModelLayout`), so that no module re-derives what it holds.
PARALLELISM_READERS = ["maxpar.core.axes", "maxpar.core.config", "maxpar.core.mesh", "maxpar.core.layout"]
PHYSICAL = frozenset({"data", "fsdp", "tensor", "expert", "stage", "context"})  # maxpar.core.axes.Physical
# (module, literal): strings that spell an axis name but name something else.
NOT_AN_AXIS = {
    ("maxpar.io.checkpoint", "data"): "the Orbax item holding the data iterator's state",
    ("maxpar.io.local_checkpoint", "data"): "the Orbax item holding the data iterator's state",
    ("maxpar.convert.architectures", "expert"): "the expert index in a Hugging Face tensor name",
    ("maxpar.tools.bench", "fsdp"): "a strategy-name prefix (dp, fsdp, tp, ep) mapped to its config key",
}


def parallelism_reads(tree: ast.Module) -> list[tuple[int, str, str | None]]:
    """(line, what, the literal or None) for every `*_parallelism` attribute, getattr of a `*_parallelism` name,
    and physical axis named by a string literal (docstrings aside)."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.endswith("_parallelism"):
            found.append((node.lineno, f".{node.attr}", None))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) > 1 and "_parallelism" in ast.unparse(node.args[1])):
            found.append((node.lineno, f"getattr(..., {ast.unparse(node.args[1])})", None))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in PHYSICAL
              and id(node) not in docstrings):
            found.append((node.lineno, repr(node.value), node.value))
    return found


def test_only_config_mesh_and_layout_read_parallelism():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        if within(module, PARALLELISM_READERS):
            continue
        for line, what, literal in parallelism_reads(ast.parse(path.read_text())):
            if (module, literal) not in NOT_AN_AXIS:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {what}")
    assert not wrong, ("read the run layout (maxpar/core/layout.py) instead of the parallelism keys or a physical axis "
                       "name:\n" + "\n".join(wrong))


# ---------------------------------------------------------------- one reader of the schedule kind

# The modules that turn `pipeline_schedule` into the schedule that runs (`Schedule.kind`, `ExecutorLayout.ops`): the
# config validates the key, the layout resolves it once, the two schedule modules define the kinds and tables. Every
# other module asks the layout (`RunLayout.schedule`, `RunLayout.ops`, `ModelLayout.executor`), so no module
# rebuilds an op table or re-decides whether the backward is explicit.
SCHEDULE_DECIDERS = ["maxpar.core.schedule", "maxpar.core.config", "maxpar.core.op_schedule", "maxpar.core.layout"]


def schedule_decisions(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) for every use of EXPLICIT_BACKWARD, construction of an OpSchedule, and comparison of a
    `pipeline_schedule` attribute with anything."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "EXPLICIT_BACKWARD":
            found.append((node.lineno, "EXPLICIT_BACKWARD"))
        elif isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "OpSchedule":
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Compare) and any(isinstance(n, ast.Attribute) and n.attr == "pipeline_schedule"
                                                   for n in [node.left, *node.comparators]):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_only_the_layout_decides_which_schedule_runs():
    wrong = [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}" for path in sorted(PACKAGE.rglob("*.py"))
             if not within(module_name(path), SCHEDULE_DECIDERS)
             for line, what in schedule_decisions(ast.parse(path.read_text()))]
    assert not wrong, ("ask the run layout which schedule runs (RunLayout.schedule.kind / .explicit_backward, "
                       "RunLayout.ops, ModelLayout.executor) instead of the config key:\n" + "\n".join(wrong))


def test_the_physical_axis_names_are_the_enum():
    """PHYSICAL is `maxpar.core.axes.Physical` (read without importing maxpar)."""
    tree = ast.parse((PACKAGE / "core" / "axes.py").read_text())
    enum = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Physical")
    values = {s.value.value for s in enum.body if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant)}
    assert values == PHYSICAL


# ---------------------------------------------------------------- functions a reader can hold at once

MAX_FUNCTION_LINES = 60  # the executors and the step: where a long function hides state passed by position
SHORT_FUNCTION_UNITS = ["maxpar.pipeline", "maxpar.training"]


def test_the_pipeline_and_training_functions_are_short():
    long = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.name} ({node.end_lineno - node.lineno + 1} "
            f"lines)" for module, path in MODULES.items() if within(module, SHORT_FUNCTION_UNITS)
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"split these into named pieces (at most {MAX_FUNCTION_LINES} lines each):\n" + "\n".join(long)
