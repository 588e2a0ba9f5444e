"""profiler=xplane: a jax.profiler trace of the requested steps under RUN/profile/."""

from __future__ import annotations

import gzip
import json

import jax
import pytest

from helpers import micro_config
from maxpar.core.config import ConfigError
from maxpar.train import train


def synthetic_config(*overrides):
    return micro_config("dataset_type=synthetic", "per_device_batch_size=2", "log_period=10", *overrides)


def traced_steps(perfetto_trace) -> set[int]:
    """The step numbers of the StepTraceAnnotation("train") markers in a Perfetto trace."""
    events = json.loads(gzip.decompress(perfetto_trace.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    return {int(e["args"]["step_num"]) for e in events
            if e.get("name") == "train" and "step_num" in e.get("args", {})}


def test_trace_of_the_requested_steps(tmp_path):
    config = synthetic_config("steps=4", "profiler=xplane", "profiler_start_step=2", "profiler_steps=2")
    train(config, devices=jax.devices()[:1], run_dir=tmp_path)
    xplanes = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert len(xplanes) == 1 and xplanes[0].stat().st_size > 0
    perfetto = list((tmp_path / "profile").rglob("perfetto_trace.json.gz"))
    assert len(perfetto) == 1
    assert traced_steps(perfetto[0]) == {2, 3}


def test_no_trace_without_profiler(tmp_path):
    # The same config as the traced run but the profiler: its compiled step comes from the compilation cache.
    train(synthetic_config("steps=4"), devices=jax.devices()[:1], run_dir=tmp_path)
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize("window", [["profiler_start_step=4", "profiler_steps=2"],
                                    ["profiler_start_step=0"], ["profiler_steps=0"]])
def test_bad_step_range_is_a_config_error(window):
    with pytest.raises(ConfigError, match="profiler"):
        synthetic_config("steps=4", "profiler=xplane", *window)


def test_unknown_profiler_is_a_config_error():
    with pytest.raises(ConfigError, match="profiler"):
        synthetic_config("profiler=nsys")
