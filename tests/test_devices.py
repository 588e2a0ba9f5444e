"""Simulated CPU devices: the XLA flags that make them (maxpar/host/devices.py), with room for their collectives to
wait on a loaded machine, and the line that explains XLA's abort when a collective waits longer still."""

from __future__ import annotations

import os
import time

import jax

from maxpar.host.devices import CollectiveTimeouts, late_collective_words, with_device_count
from maxpar.training.guards import SlowStepNote, StepWatchdog

TERMINATE = "--xla_cpu_collective_call_terminate_timeout_seconds"
WARN = "--xla_cpu_collective_call_warn_stuck_timeout_seconds"


def test_simulated_devices_get_long_collective_timeouts_unless_the_flags_set_them():
    flags = with_device_count("--xla_force_host_platform_device_count=2 --xla_foo", 8)
    assert flags.split() == ["--xla_foo", "--xla_force_host_platform_device_count=8", f"{WARN}=60", f"{TERMINATE}=540"]
    assert CollectiveTimeouts.of(flags).abort_s == 600
    own = with_device_count(f"{TERMINATE}=900", 4)
    assert own.split().count(f"{TERMINATE}=900") == 1 and f"{TERMINATE}=540" not in own
    assert CollectiveTimeouts.of(own) == (60, 900)
    assert CollectiveTimeouts.of("--xla_foo") == (20, 40)  # XLA's own: the abort 60 s after the first arrival


def test_this_jaxlib_accepts_the_timeouts():
    """conftest.py simulates the tests' devices through with_device_count: an XLA flag this jaxlib did not know
    would have aborted JAX's start."""
    assert f"{TERMINATE}=540" in os.environ["XLA_FLAGS"]
    assert len(jax.devices()) == 8


def test_a_step_slower_than_half_the_timeout_is_explained_once_and_goes_on(capsys):
    with StepWatchdog(0, SlowStepNote(0.2, late_collective_words(CollectiveTimeouts(20, 40)))) as watchdog:
        watchdog.progress(4)
        time.sleep(1.0)
    err = capsys.readouterr().err
    assert err.count("maxpar: step 5 has run") == 1 and "without finishing; if XLA then aborts (exit 134" in err
    assert "of 40 seconds exceeded" in err and "waited 60 s" in err and f"{TERMINATE}=N" in err
