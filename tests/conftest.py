"""Every test: 8 simulated CPU devices, one JAX compilation cache and one store of shared references for the session,
each test's CPU seconds in the JUnit XML, and a schedule that starts the costliest modules first.

Devices, cache and store are set before JAX initializes, through the environment, so the training processes that
tests start get them too, and so do pytest-xdist's workers (README runs the suite with `-n 2`): they inherit the
main process's environment and share its directories.

Why the compilation cache: most tests compile the same few tiny-model programs again and again (a run, its resumed
half, the same step on another test's mesh); reading the executable back instead of recompiling it took
tests/test_records.py from 144 s to 76 s. The directory is new for each session and removed after it, so no session
reads another's entries, unless you name your own: `JAX_COMPILATION_CACHE_DIR=~/.cache/maxpar-tests python -m pytest
...` keeps the compiled programs between your local runs (docs/architecture.md, "Tests"); CI never sets it. JAX writes
an entry without a lock: one read while another process is still writing it fails to decompress, and JAX warns and
compiles instead.

The shared store (`tests/helpers.shared`, `shared_dir`): a value or directory several modules need (a one-device
reference, a converted Hugging Face model and its logits) is built once per session, by whichever worker asks first,
under a file lock, and read back by every other test and worker.
"""

import atexit
import json
import os
import resource
import shutil
import tempfile
from pathlib import Path

import pytest

from maxpar.host.devices import simulate_cpu_devices
from maxpar.host.topology import set_libtpu_environment

# XLA:CPU's LLVM backend without optimization: the suite's programs are tiny and run once or a few times, so compiling
# them dominates its cost, and -O0 compiles a tiny model's sharded train step in about half the CPU time (its
# initialization in a fifth). Sharding, partitioning and the collectives are decided before LLVM, so every
# equivalence and --verify check sees the same program structure; the arithmetic is IEEE either way (no fast math),
# though an element-wise function may round differently (tests/test_activations.py's remat test allows 4e-6), and a
# reference and the run compared with it are compiled alike.
FAST_COMPILE = "--xla_backend_optimization_level=0"

simulate_cpu_devices(8)
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:  # the user's own level stands
    os.environ["XLA_FLAGS"] += f" {FAST_COMPILE}"
# The TPU-topology tests (tests/test_tpu_compile.py) load libtpu, which takes a machine-wide lock unless this allows
# several loads: pytest-xdist's workers, and other processes compiling for TPU beside the suite.
set_libtpu_environment()

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # set: a worker of this session, or the user's own cache
    _CACHE = tempfile.mkdtemp(prefix="maxpar-tests-jax-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# The tests' gs:// paths all reach the GCS emulator, which speaks only the JSON API. gcsfs, unless told otherwise before
# it is imported, first asks every bucket's layout over gRPC and waits a minute for an answer, for each operation
# (maxpar sets this for its own processes when STORAGE_EMULATOR_HOST is set: maxpar/core/storage.py); this
# process's gcsfs clients (tests/gcs.py, the trainer run in process) skip the probe too.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

if "MAXPAR_TESTS_SHARED_DIR" not in os.environ:  # set: a worker of this session
    _SHARED = tempfile.mkdtemp(prefix="maxpar-tests-shared-")
    atexit.register(shutil.rmtree, _SHARED, ignore_errors=True)
    os.environ["MAXPAR_TESTS_SHARED_DIR"] = _SHARED

# The fast tier, `python -m pytest -q -m fast` (docs/architecture.md, "Tests"): the modules whose every test is a
# pure unit test, run in this process: no training run, no compiled train step, no subprocess. A module joins by
# name here; a test that breaks the rule goes into a module that is not listed.
FAST = {
    "test_activations", "test_architecture", "test_attention", "test_blockwise", "test_cadence", "test_chat",
    "test_data", "test_devices", "test_run_messages", "test_test_cost",
    "test_logs", "test_mesh", "test_mixture", "test_moe", "test_op_schedule", "test_optimizer", "test_optimizers",
    "test_pipeline_schedule", "test_plan", "test_plan_hlo", "test_results_page", "test_topology", "test_tpu_hlo",
    "test_fp8_dots",
}


RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


# The development tier, `python -m pytest -q -n 2 -m "not slow"` (README; docs/architecture.md, "Tests"): every test
# but those marked slow by hand (subprocesses, multi-process jobs, long training runs) and those that cost more than
# this many CPU seconds in the newest test_cost record. A new test runs in it until a record says it is costly; the
# full suite (CI) runs them all.
DEV_TIER_MAX_CPU_S = 3.0


def recorded_costs(figure: str) -> dict[str, float]:
    """CPU seconds by test module (figure "cpu_s_by_module", keys test_x.py) or by test ("cpu_s_by_test", keys
    pytest's node ids), each from the newest test_cost record that has it (`python -m maxpar.tools.test_cost --record
    docs/results` writes one, for the whole suite or the modules it ran); {} when none does."""
    costs: dict[str, float] = {}
    for path in sorted(RESULTS.glob("test_cost-*.json")):  # the names sort by date: newer ones overwrite
        costs.update(json.loads(path.read_text(encoding="utf-8"))["figures"].get(figure) or {})
    return costs


def recorded_as_costly(items: list[pytest.Item], costs: dict[str, float], limit: float) -> list[pytest.Item]:
    """The items whose recorded CPU seconds exceed `limit` (an unrecorded one counts as cheap)."""
    return [item for item in items if costs.get(item.nodeid, 0.0) > limit]


def costliest_modules_first(items: list[pytest.Item], costs: dict[str, float]) -> None:
    """Order the modules by their recorded cost, the costliest first, keeping each module's own order of tests.
    pytest-xdist (--dist=loadscope --no-loadscope-reorder, pyproject.toml) hands whole modules to whichever worker
    is free in this order: the longest first, so the two workers finish together (the long modules do not start
    last, while the other worker idles). A module without a recorded cost (a new one) counts as the costliest: one
    that is cheap costs nothing at the front, one that is costly would cost its whole length at the end."""
    unknown = max(costs.values(), default=0.0) + 1.0
    items.sort(key=lambda item: -(costs.get(item.path.name) or unknown))  # a stable sort


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.stem in FAST:
            item.add_marker(pytest.mark.fast)
    for item in recorded_as_costly(items, recorded_costs("cpu_s_by_test"), DEV_TIER_MAX_CPU_S):
        item.add_marker(pytest.mark.slow)
    costliest_modules_first(items, recorded_costs("cpu_s_by_module"))


# ---------------------------------------------------------------- what each test costs

def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all its threads) and of the children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


CPU_START = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    item.stash[CPU_START] = cpu_seconds()
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item, call):
    """A test's CPU seconds (setup, call and teardown, so a module fixture counts where it is built) as the property
    `cpu_s` of its <testcase> in `--junitxml`: `python -m maxpar.tools.test_cost` ranks them."""
    if call.when == "teardown" and CPU_START in item.stash:
        item.user_properties.append(("cpu_s", round(cpu_seconds() - item.stash[CPU_START], 2)))
