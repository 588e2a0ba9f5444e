"""Every test: 8 simulated CPU devices, and one persistent JAX compilation cache for the session. Both are set
before JAX initializes, through the environment, so the training processes that tests start get them too, and
so do pytest-xdist's workers (README runs the suite with `-n 2`): they inherit the main process's environment
and share its cache.

Why the cache: most tests compile the same few tiny-model programs again and again (a run, its resumed
half, the same step on another test's mesh); reading the executable back instead of recompiling it took
tests/test_records.py from 144 s to 76 s. The directory is new for each session and removed after it, so
no session reads another's entries. JAX writes an entry without a lock: one read while another process is
still writing it fails to decompress, and JAX warns and compiles instead.
"""

import atexit
import os
import shutil
import tempfile

import pytest

from maxpar.host.devices import simulate_cpu_devices
from maxpar.host.topology import set_libtpu_environment

simulate_cpu_devices(8)
# The TPU-topology tests (tests/test_tpu_compile.py) load libtpu, which takes a machine-wide lock unless this allows
# several loads: pytest-xdist's workers, and other processes compiling for TPU beside the suite.
set_libtpu_environment()

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # set: a worker of this session, or the user's own cache
    _CACHE = tempfile.mkdtemp(prefix="maxpar-tests-jax-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# The fast tier, `python -m pytest -q -m fast` (docs/architecture.md, "Tests"): the modules whose every test is a
# pure unit test, run in this process: no training run, no compiled train step, no subprocess. A module joins by
# name here; a test that breaks the rule goes into a module that is not listed.
FAST = {
    "test_activations", "test_architecture", "test_attention", "test_blockwise", "test_cadence", "test_chat",
    "test_data", "test_devices", "test_run_messages",
    "test_logs", "test_mesh", "test_mixture", "test_moe", "test_op_schedule", "test_optimizer", "test_optimizers",
    "test_pipeline_schedule", "test_plan", "test_plan_hlo", "test_results_page", "test_topology", "test_tpu_hlo",
    "test_fp8_dots",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.stem in FAST:
            item.add_marker(pytest.mark.fast)
