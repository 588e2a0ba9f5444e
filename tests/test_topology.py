"""TPU topology names (MaxText's spellings) resolved to libtpu's slice shapes, and what JAX starts on a machine with
libtpu but no accelerator: pure functions, no libtpu needed."""

from __future__ import annotations

import pytest

from maxpar.core.config import ConfigError
from maxpar.host import devices
from maxpar.host.topology import parse_topology
from maxpar.plan.compile_report import exceeded_hbm


@pytest.mark.parametrize("name, libtpu, chips, devices_per_slice", [
    ("v5p-8", "v5:2x2x1", 4, 4), ("v5p-16", "v5:2x2x2", 8, 8), ("v5p-64", "v5:2x4x4", 32, 32),
    ("v5p-256", "v5:4x4x8", 128, 128), ("v5p-640", "v5:4x4x20", 320, 320), ("v5p-1152", "v5:4x12x12", 576, 576),
    ("v5p-4096", "v5:8x16x16", 2048, 2048), ("v4-128", "v4:4x4x4", 64, 64), ("v4-8", "v4:2x2x1", 4, 4),
    ("v5e-256", "v5e:16x16", 256, 256), ("v5e-8", "v5e:2x4", 8, 8), ("v5e-1", "v5e:1x1", 1, 1),
    ("v5litepod-16", "v5e:4x4", 16, 16), ("v6e-256", "v6e:16x16", 256, 256), ("v6e-128", "v6e:8x16", 128, 128),
    ("tpu7x-8", "tpu7x:2x2x1", 4, 8), ("tpu7x-128", "tpu7x:4x4x4", 64, 128),
])
def test_cloud_names_resolve_to_libtpu_slices(name, libtpu, chips, devices_per_slice):
    spec = parse_topology(name)
    assert (spec.libtpu_topology, spec.chips, spec.devices_per_slice) == (libtpu, chips, devices_per_slice)
    assert spec.chips_per_host_bounds == ((1, 1, 1) if chips == 1 else (2, 2, 1))


@pytest.mark.parametrize("name", ["v5p-12", "v5p-96", "v5e-512", "v6e-3", "v9-8", "v5p", "tpu", "v4-0"])
def test_other_names_are_config_errors_listing_the_valid_ones(name):
    with pytest.raises(ConfigError, match=r"compile_topology=.*valid: v5p-N and v4-N"):
        parse_topology(name)


def test_xla_tpu_out_of_memory_is_read_into_numbers():
    new = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for "
           "HLO temporaries (780.30G) exceeds available HBM (95.73G). HLO module: jit_train_step.")
    found = exceeded_hbm(new)
    assert found.what == "HLO temporaries"
    assert found.needed == pytest.approx(780.30 * 2 ** 30) and found.capacity == pytest.approx(95.73 * 2 ** 30)
    assert exceeded_hbm("Used 120.5G of 95.74G hbm. Exceeded hbm capacity by 24.8G.").needed == 120.5 * 2 ** 30
    assert exceeded_hbm("INVALID_ARGUMENT: something else") is None


def test_cpu_only_where_libtpu_sees_no_accelerator(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: object())  # libtpu installed
    monkeypatch.setattr(devices, "tpu_chips_attached", lambda: True)
    assert devices.cpu_unless_accelerators() is None  # a TPU VM: JAX starts its TPU backend
    monkeypatch.setattr(devices, "tpu_chips_attached", lambda: False)
    monkeypatch.setattr(devices.os.path, "exists", lambda path: path == "/dev/nvidia0")
    assert devices.cpu_unless_accelerators() is None  # a GPU machine: its plugin decides
    monkeypatch.setattr(devices.os.path, "exists", lambda path: False)
    assert devices.cpu_unless_accelerators() == "cpu" and devices.os.environ["JAX_PLATFORMS"] == "cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert devices.cpu_unless_accelerators() is None  # the user's choice stands
