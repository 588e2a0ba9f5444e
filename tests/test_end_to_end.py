"""CI runs the fast end-to-end regression scripts: each must end with PASS and exit 0.

The slow ones (convergence, sharding matrix, checkpoint, multi-slice) run in `end_to_end/run_all.sh`;
the sharded-equivalence, checkpoint, multi-process and `--verify` tests of this suite cover their
ground in smaller form, and tests/test_golden_shardings.py runs the golden-shardings check.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import REPO

pytestmark = pytest.mark.slow  # the end-to-end scripts, each a process: left out of the development tier

FAST = {"determinism": [],
        "moe_balance": ["--steps", "2", "--rows", "2", "--length", "16", "dataset_type=synthetic", "emb_dim=32",
                        "num_query_heads=2", "num_kv_heads=1", "head_dim=16", "mlp_dim=32", "num_decoder_layers=1"]}


@pytest.mark.parametrize("script", list(FAST))
def test_fast_end_to_end_script_passes(script):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(REPO / "end_to_end" / f"{script}.py"), *FAST[script]], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines and lines[-1].startswith("PASS"), (
        f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def test_a_crashing_script_ends_with_fail_and_a_nonzero_exit():
    """end_to_end/verdict.py keeps the contract when a script crashes (here: an unknown config key)."""
    done = subprocess.run([sys.executable, str(REPO / "end_to_end" / "determinism.py"), "no_such_key=1"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stdout.strip().splitlines()[-1].startswith("FAIL: crashed with ConfigError: unknown config key")
