"""What the test suite costs: the costliest tests and the modules by CPU seconds, from pytest's JUnit XML.

    python -m maxpar.tools.test_cost                      # runs README's command (-n 2) and ranks its tests
    python -m maxpar.tools.test_cost -- -n 2 -m "not slow"  # the same for other pytest arguments
    python -m maxpar.tools.test_cost --junit run.xml      # ranks a run you already have
    ... --record docs/results                             # and writes a test_cost record

A test's CPU seconds are user + system time of its worker process and the processes it waited for, over its setup,
call and teardown (tests/conftest.py writes them into the XML as the property `cpu_s`), so a module fixture counts
in the first test that builds it. CPU seconds follow the work; wall seconds follow the machine's load as well. The
20 costliest are where the next cost regression shows.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from maxpar.tools import records

README_ARGS = ["-n", "2"]


@dataclass(frozen=True)
class TestCost:
    module: str  # tests/test_x.py
    name: str  # the test within it, parameters included
    cpu_s: float | None  # None: the XML came from a run without tests/conftest.py's property
    wall_s: float
    outcome: str  # passed, failed, error, skipped

    @property
    def nodeid(self) -> str:
        """pytest's id of the test (tests/test_x.py::Class::test_y[param]), as tests/conftest.py looks it up."""
        return "::".join([self.module, *self.name.split(".")])

    @property
    def cost(self) -> float:
        return self.wall_s if self.cpu_s is None else self.cpu_s


def _module_and_name(case: ET.Element) -> tuple[str, str]:
    """tests/test_x.py and the test's name, from the <testcase>'s dotted classname (tests.test_x[.Class])."""
    parts = case.get("classname", "").split(".")
    module_parts = parts[:next((i + 1 for i, p in enumerate(parts) if p.startswith("test_")), len(parts))]
    name = ".".join([*parts[len(module_parts):], case.get("name", "")])
    return "/".join(module_parts) + ".py", name


def read_junit(path: Path) -> list[TestCost]:
    """Every <testcase> of a pytest --junitxml file."""
    costs = []
    for case in ET.parse(path).getroot().iter("testcase"):
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        module, name = _module_and_name(case)
        cpu = properties.get("cpu_s")
        costs.append(TestCost(module, name, None if cpu is None else float(cpu), float(case.get("time", 0)),
                              {"failure": "failed"}.get(outcome, outcome)))
    return costs


@dataclass(frozen=True)
class ModuleCost:
    module: str
    tests: int
    cpu_s: float | None
    wall_s: float


def by_module(costs: Sequence[TestCost]) -> list[ModuleCost]:
    """Each module's tests summed, costliest first."""
    grouped: dict[str, list[TestCost]] = collections.defaultdict(list)
    for cost in costs:
        grouped[cost.module].append(cost)
    modules = [ModuleCost(module, len(tests),
                          None if any(t.cpu_s is None for t in tests) else round(sum(t.cpu_s for t in tests), 1),
                          round(sum(t.wall_s for t in tests), 1))
               for module, tests in grouped.items()]
    return sorted(modules, key=lambda m: -(m.wall_s if m.cpu_s is None else m.cpu_s))


def costliest(costs: Sequence[TestCost], top: int) -> list[TestCost]:
    return sorted(costs, key=lambda c: -c.cost)[:top]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def report(costs: Sequence[TestCost], top: int, modules: int) -> None:
    cpu_total = sum(c.cpu_s or 0 for c in costs)
    print(f"{len(costs)} tests, {cpu_total:.0f} CPU s, {sum(c.wall_s for c in costs):.0f} s of test time "
          f"(summed over workers)\n\nthe {top} costliest tests:")
    records.print_table(("CPU s", "wall s", "test"), [(_seconds(c.cpu_s), _seconds(c.wall_s), f"{c.module}::{c.name}")
                                                      for c in costliest(costs, top)])
    print(f"\nthe {modules} costliest modules:")
    records.print_table(("CPU s", "wall s", "tests", "module"),
                        [(_seconds(m.cpu_s), _seconds(m.wall_s), str(m.tests), m.module)
                         for m in by_module(costs)[:modules]])
    failed = [c for c in costs if c.outcome in ("failed", "error")]
    if failed:
        print(f"\n{len(failed)} failed: " + ", ".join(f"{c.module}::{c.name}" for c in failed[:10]))


def run_pytest(pytest_args: Sequence[str], junit: Path) -> tuple[int, float]:
    """(exit status, wall seconds) of `python -m pytest -q ARGS --junitxml=junit` in the repository."""
    start = time.perf_counter()
    status = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args,
                             f"--junitxml={junit}"], cwd=records.REPO).returncode
    return status, time.perf_counter() - start


def figures(costs: Sequence[TestCost], top: int, wall_s: float | None, command: str) -> dict:
    return {
        "run": f"{command}: each test's CPU seconds (user+sys of its worker and the processes it waited for, setup "
               "and teardown included, so a module fixture counts in the first test that builds it) and wall "
               "seconds; 8 simulated CPU devices per worker. Wall time follows the machine's load, CPU time much "
               "less.",
        "wall_s": None if wall_s is None else round(wall_s, 1),
        "tests": len(costs),
        "failed": sum(c.outcome in ("failed", "error") for c in costs),
        "cpu_s_total": round(sum(c.cpu_s or 0 for c in costs), 1),
        "test_wall_s_total": round(sum(c.wall_s for c in costs), 1),
        "cpu_s_by_module": {m.module.removeprefix("tests/"): m.cpu_s for m in by_module(costs)},
        # tests/conftest.py leaves the tests above its DEV_TIER_MAX_CPU_S out of the development tier (-m "not slow")
        "cpu_s_by_test": {c.nodeid: c.cpu_s for c in costs if c.cpu_s is not None},
        "rows": [{"test": f"{c.module}::{c.name}", "cpu_s": c.cpu_s, "wall_s": round(c.wall_s, 1)}
                 for c in costliest(costs, top)],
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else None
    ours = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m maxpar.tools.test_cost", description=__doc__.splitlines()[0],
                                     epilog="Arguments after -- go to pytest (default: README's -n 2).")
    parser.add_argument("--junit", type=Path, help="rank this JUnit XML instead of running the suite")
    parser.add_argument("--top", type=int, default=20, help="how many tests to list (default 20)")
    parser.add_argument("--modules", type=int, default=15, help="how many modules to list (default 15)")
    parser.add_argument("--wall_s", type=float, help="with --junit: the run's wall seconds, for the record")
    parser.add_argument("--load_start", type=float, nargs=3, metavar="LOAD",
                        help="with --junit: the 1/5/15-minute load averages when the run began, for the record")
    records.add_record_option(parser)
    args = parser.parse_args(ours)
    if args.junit and pytest_args is not None:
        parser.error("--junit ranks a finished run: give no pytest arguments after --")
    load_start = args.load_start or records.load_average()
    status, wall_s = 0, args.wall_s
    command = ["python", "-m", "pytest", "-q", *(pytest_args or README_ARGS)]
    with tempfile.TemporaryDirectory() as scratch:
        junit = args.junit
        if junit is None:
            junit = Path(scratch) / "junit.xml"
            status, wall_s = run_pytest(pytest_args or README_ARGS, junit)
            print(f"\npytest exited {status} after {wall_s:.0f} s wall; load average {load_start} at start, "
                  f"{records.load_average()} at end\n")
        if not junit.is_file():
            print(f"maxpar: no JUnit XML at {junit}", file=sys.stderr)
            return 2
        costs = read_junit(junit)
    report(costs, args.top, args.modules)
    if args.record:
        shown = " ".join(command) if args.junit is None else f"python -m maxpar.tools.test_cost --junit {args.junit}"
        path = records.write_record(args.record, "test_cost", ["python", "-m", "maxpar.tools.test_cost", *argv],
                                    figures(costs, args.top, wall_s, shown), load_start)
        print(f"\nrecord: {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
