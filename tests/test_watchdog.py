"""The step watchdog ends a stuck process with a clear message, and leaves a progressing one alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from helpers import REPO


def _run(body: str) -> tuple[subprocess.CompletedProcess, float]:
    script = textwrap.dedent("""
        import time
        from maxpar.training.guards import StepWatchdog
        with StepWatchdog(0.5) as watchdog:
    """) + textwrap.indent(textwrap.dedent(body), "    ") + "\nprint('finished')\n"
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    return result, time.monotonic() - start


@pytest.mark.slow
def test_a_stuck_process_is_stopped_with_a_clear_message():
    result, elapsed = _run("""
        watchdog.progress(7)
        time.sleep(30)  # stuck: no further progress
    """)
    assert result.returncode == 3, result.stderr
    assert "no training step finished in 0.5 s after step 7" in result.stderr
    assert "finished" not in result.stdout
    assert elapsed < 25


@pytest.mark.slow
def test_steady_progress_and_the_time_before_the_first_step_are_not_stuck():
    result, _ = _run("""
        time.sleep(1.5)  # compiling: not armed yet
        for step in range(15):
            watchdog.progress(step)
            time.sleep(0.1)
    """)
    assert result.returncode == 0, result.stderr
    assert "finished" in result.stdout
