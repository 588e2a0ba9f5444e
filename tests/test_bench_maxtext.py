"""The side-by-side benchmark's plumbing (log parsing, the table, the SKIP path); its timings are never asserted."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "end_to_end" / "bench_maxtext.py"


@pytest.fixture(scope="module")
def bm():
    sys.path.insert(0, str(SCRIPT.parent))  # its `from verdict import exit_with`
    try:
        spec = importlib.util.spec_from_file_location("bench_maxtext", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPT.parent))


MAXTEXT_LOG = """\
I1124 06:51:03.859976 140 checkpointing.py:803] No existing checkpoints found, not restoring checkpoint.
I1124 06:51:12.615581 140 max_utils.py:823] [train] Total estimated memory size: 0.0 GB
I1124 06:51:14.515880 140 metric_logger.py:265] completed step: 0, seconds: 0.343, TFLOP/s/device: 0.025
I1124 06:51:15.476008 140 metric_logger.py:265] completed step: 1, seconds: 0.835, TFLOP/s/device: 0.010
I1124 06:51:16.408923 140 metric_logger.py:265] completed step: 2, seconds: 0.720, TFLOP/s/device: 0.012
"""


def test_maxtext_log_gives_compile_time_and_steps(bm):
    assert bm.maxtext_compile_seconds(MAXTEXT_LOG) == pytest.approx(8.755605)
    assert bm.maxtext_compile_seconds("no timestamps here") is None
    steps = {int(m[1]): float(m[2]) for m in bm.MAXTEXT_STEP.finditer(MAXTEXT_LOG)}
    assert steps == {0: 0.343, 1: 0.835, 2: 0.720}
    assert bm.steady([steps[k] for k in sorted(steps)], warmup=1) == pytest.approx(0.7775)
    assert bm.steady([0.5], warmup=1) is None


def test_table_reports_the_ratio_and_keeps_missing_runs_visible(bm):
    runs = {("fsdp8", "full"): {"maxpar": [{"step_s": 0.4, "compile_s": 3.0, "peak_rss_mib": 900, "load_1m": 1.0},
                                           {"step_s": 0.45, "compile_s": 3.0, "peak_rss_mib": 900, "load_1m": 1.0}],
                                "maxtext": [{"step_s": 0.5, "compile_s": 7.0, "peak_rss_mib": 1000, "load_1m": 3.0},
                                            {"step_s": 0.5, "compile_s": 7.0, "peak_rss_mib": 1000, "load_1m": 3.0}]},
            ("one", "minimal"): {"maxpar": [{"step_s": None, "compile_s": None, "peak_rss_mib": 10, "load_1m": 1.0}],
                                 "maxtext": [{"step_s": 0.9, "compile_s": 7.0, "peak_rss_mib": 1000, "load_1m": 1.0}]}}
    table, rows = bm.summarize(runs)
    assert rows[0]["ratio"] == pytest.approx(0.85) and rows[1]["ratio"] is None
    assert rows[0]["round_ratios"] == pytest.approx([0.8, 0.9]) and rows[1]["round_ratios"] == [None]
    assert "| fsdp8 | full | 0.425 | 0.500 | 0.85 | 0.80 / 0.90 | 1.18x |" in table
    assert "| one | minimal | n/a | 0.900 | n/a | n/a | n/a |" in table


def test_without_maxtext_it_says_how_to_get_it_and_skips():
    done = subprocess.run([sys.executable, str(SCRIPT), "--maxtext_python", "/nonexistent/python"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pip install --no-deps maxtext" in done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith("SKIP: MaxText not available")
