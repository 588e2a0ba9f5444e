"""Tests for maxpar.core.mesh: -1 fill at ICI/DCN level, the flat mesh on 8 CPU devices, hybrid meshes over granules."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from maxpar.core.config import ConfigError, load_config
from maxpar.core.mesh import (MeshShape, create_mesh, local_mesh_shape, num_slices_for, resolve_mesh_shape,
                              slice_granules)

REPO = Path(__file__).resolve().parents[1]
BASE = str(REPO / "configs" / "base.yml")
AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")  # base.yml's mesh_axes


def cfg(*overrides: str):
    return load_config([BASE, *overrides])


def degrees(shape: MeshShape) -> dict[str, int]:
    return dict(zip(shape.axis_names, shape.shape))


# ---------------------------------------------------------------- resolve_mesh_shape (pure)

@pytest.mark.parametrize("overrides, devices, slices, expected", [
    ([], 1, 1, {}),
    ([], 8, 1, {"fsdp": 8}),
    ([], 16, 1, {"fsdp": 16}),
    ([], 256, 1, {"fsdp": 256}),
    ([], 16, 2, {"fsdp": 8, "data": 2}),
    ([], 256, 4, {"fsdp": 64, "data": 4}),
    (["ici_tensor_parallelism=2"], 8, 1, {"fsdp": 4, "tensor": 2}),
    (["ici_tensor_parallelism=4"], 256, 1, {"fsdp": 64, "tensor": 4}),
    (["ici_data_parallelism=8", "ici_fsdp_parallelism=1"], 8, 1, {"data": 8}),
    (["ici_data_parallelism=-1", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=4"], 256, 1,
     {"data": 32, "fsdp": 2, "tensor": 4}),
    (["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"], 8, 1,
     {"data": 2, "fsdp": 2, "tensor": 2}),
    (["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "ici_stage_parallelism=2"], 16, 1,
     {"fsdp": 4, "tensor": 2, "stage": 2}),
    (["ici_expert_parallelism=-1", "ici_fsdp_parallelism=2"], 8, 1, {"fsdp": 2, "expert": 4}),
    # DCN fill on another axis, and DCN degrees on two axes
    (["dcn_data_parallelism=1", "dcn_fsdp_parallelism=-1"], 16, 2, {"fsdp": 16}),
    (["dcn_data_parallelism=-1", "dcn_fsdp_parallelism=2"], 32, 4, {"fsdp": 16, "data": 2}),
    (["dcn_data_parallelism=2", "dcn_tensor_parallelism=2", "ici_tensor_parallelism=2"], 16, 4,
     {"data": 2, "fsdp": 2, "tensor": 4}),
])
def test_resolve_mesh_shape(overrides, devices, slices, expected):
    shape = resolve_mesh_shape(cfg(*overrides), devices, slices)
    assert shape.axis_names == AXES
    full = {axis: expected.get(axis, 1) for axis in AXES}
    assert degrees(shape) == full
    assert int(np.prod(shape.shape)) == devices
    assert int(np.prod(shape.ici)) == devices // slices
    assert int(np.prod(shape.dcn)) == slices
    for axis in AXES:
        assert shape.degree(axis) == full[axis]


def test_ici_and_dcn_parts_are_kept_apart():
    shape = resolve_mesh_shape(cfg("dcn_data_parallelism=-1", "dcn_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
                               32, 4)
    assert dict(zip(AXES, shape.ici)) == {"data": 1, "stage": 1, "fsdp": 4, "context": 1, "expert": 1, "tensor": 2}
    assert dict(zip(AXES, shape.dcn)) == {"data": 2, "stage": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 1}
    assert shape.describe() == "data=1x2 fsdp=4x2 tensor=2"
    assert resolve_mesh_shape(cfg(), 1).describe() == "single device"


def test_shape_follows_mesh_axes_order():
    config = cfg("mesh_axes=[tensor,fsdp,data,expert,stage,context]", "ici_tensor_parallelism=2", "ici_data_parallelism=2",
                 "ici_fsdp_parallelism=-1")
    shape = resolve_mesh_shape(config, 16)
    assert shape.axis_names == ("tensor", "fsdp", "data", "expert", "stage", "context")
    assert shape.shape == (2, 4, 2, 1, 1, 1)


def test_product_mismatch_names_degrees_and_device_count():
    config = cfg("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    assert resolve_mesh_shape(config, 8).shape == (1, 1, 4, 1, 1, 2)
    with pytest.raises(ConfigError) as info:
        resolve_mesh_shape(config, 16)
    message = str(info.value)
    for part in ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "8", "16", "-1"):
        assert part in message, (part, message)


def test_dcn_mismatch_names_slices():
    with pytest.raises(ConfigError) as info:
        resolve_mesh_shape(cfg("dcn_data_parallelism=1"), 16, 2)
    message = str(info.value)
    assert "dcn" in message and "2 slices" in message and "1" in message
    with pytest.raises(ConfigError) as info:
        resolve_mesh_shape(cfg("dcn_data_parallelism=4"), 16, 2)
    assert "dcn_data_parallelism=4" in str(info.value)


def test_fill_that_cannot_divide():
    with pytest.raises(ConfigError) as info:
        resolve_mesh_shape(cfg("ici_tensor_parallelism=3"), 8)
    message = str(info.value)
    assert "ici_fsdp_parallelism=-1" in message and "ici_tensor_parallelism=3" in message and "8" in message
    with pytest.raises(ConfigError) as info:
        resolve_mesh_shape(cfg("ici_tensor_parallelism=16"), 8)  # larger than the slice
    assert "ici_tensor_parallelism=16" in str(info.value)
    with pytest.raises(ConfigError) as info:
        resolve_mesh_shape(cfg("dcn_fsdp_parallelism=3"), 24, 4)
    assert "dcn_data_parallelism=-1" in str(info.value) and "dcn_fsdp_parallelism=3" in str(info.value)


def test_devices_must_split_into_slices():
    with pytest.raises(ConfigError) as info:
        resolve_mesh_shape(cfg(), 10, 4)
    assert "10" in str(info.value) and "4" in str(info.value)


# ---------------------------------------------------------------- create_mesh on the 8 simulated CPU devices

def test_eight_cpu_devices():
    assert jax.device_count() == 8 and jax.process_count() == 1


@pytest.mark.parametrize("overrides, expected", [
    ([], {"fsdp": 8}),
    (["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"], {"fsdp": 4, "tensor": 2}),
    (["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"],
     {"data": 2, "fsdp": 2, "tensor": 2}),
    (["ici_data_parallelism=8", "ici_fsdp_parallelism=1"], {"data": 8}),
    (["mesh_axes=[tensor,expert,fsdp,stage,data,context]", "ici_tensor_parallelism=2"], {"fsdp": 4, "tensor": 2}),
])
def test_create_mesh(overrides, expected):
    config = cfg(*overrides)
    mesh = create_mesh(config)
    assert mesh.axis_names == config.mesh_axes
    assert dict(mesh.shape) == {axis: expected.get(axis, 1) for axis in config.mesh_axes}
    assert mesh.devices.shape == tuple(expected.get(axis, 1) for axis in config.mesh_axes)
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())
    assert local_mesh_shape(config, list(mesh.devices.flat)) == resolve_mesh_shape(config, 8)


def test_tensor_axis_is_fastest_varying():
    """With tensor last in mesh_axes, tensor-parallel partners are neighbouring devices."""
    mesh = create_mesh(cfg("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"))
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(4, 2)
    assert (ids[:, 1] - ids[:, 0] == 1).all()


def test_single_process_is_one_slice():
    devices = jax.devices()
    assert slice_granules(devices) == (1, True)
    assert num_slices_for(cfg(), devices) == 1
    assert num_slices_for(cfg("num_slices=1"), devices) == 1


def test_num_slices_one_gives_flat_mesh():
    mesh = create_mesh(cfg("num_slices=1"))
    assert dict(mesh.shape) == {"data": 1, "stage": 1, "fsdp": 8, "context": 1, "expert": 1, "tensor": 1}


def test_num_slices_mismatch_on_one_process():
    with pytest.raises(ConfigError) as info:
        create_mesh(cfg("num_slices=2"))
    assert "num_slices=2" in str(info.value) and "1 slice" in str(info.value)


def test_create_mesh_on_a_subset_of_devices():
    mesh = create_mesh(cfg("ici_tensor_parallelism=2"), jax.devices()[:4])
    assert dict(mesh.shape)["fsdp"] == 2 and dict(mesh.shape)["tensor"] == 2
    assert {d.id for d in mesh.devices.flat} == {d.id for d in jax.devices()[:4]}


def test_create_mesh_mismatch_raises_config_error():
    with pytest.raises(ConfigError, match="ici_tensor_parallelism=3"):
        create_mesh(cfg("ici_tensor_parallelism=3", "ici_fsdp_parallelism=1"))


# ---------------------------------------------------------------- hybrid meshes over fake multi-process devices

class FakeDevice:
    """What mesh_utils reads from a CPU device: id, platform, device_kind, process_index."""

    platform = "cpu"
    device_kind = "fake cpu"

    def __init__(self, id: int, process_index: int):
        self.id = id
        self.process_index = process_index

    def __repr__(self) -> str:
        return f"FakeDevice(id={self.id}, process={self.process_index})"


class FakeSliceDevice(FakeDevice):
    """A TPU-like device that reports its slice."""

    def __init__(self, id: int, slice_index: int):
        super().__init__(id, process_index=0)
        self.slice_index = slice_index


def two_processes() -> list[FakeDevice]:
    # Interleaved on purpose: a plain reshape of this list would mix the processes in every block.
    return [FakeDevice(i, i % 2) for i in range(8)]


def test_fake_granules_are_detected():
    devices = two_processes()
    assert slice_granules(devices) == (2, True)
    assert num_slices_for(cfg(), devices) == 2
    assert num_slices_for(cfg("num_slices=2"), devices) == 2
    assert num_slices_for(cfg("num_slices=1"), devices) == 1
    with pytest.raises(ConfigError, match="num_slices=4"):
        num_slices_for(cfg("num_slices=4"), devices)
    slices = [FakeSliceDevice(i, i // 2) for i in range(8)]
    assert slice_granules(slices) == (4, False)


def _process_of(mesh_devices: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda d: d.process_index)(mesh_devices)


def test_hybrid_mesh_data_over_processes():
    config = cfg("dcn_data_parallelism=2", "ici_fsdp_parallelism=4", "ici_data_parallelism=1")
    devices = two_processes()
    shape = resolve_mesh_shape(config, len(devices), num_slices_for(config, devices))
    assert dict(zip(shape.axis_names, shape.ici))["fsdp"] == 4
    assert dict(zip(shape.axis_names, shape.dcn))["data"] == 2
    mesh = create_mesh(config, devices)
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 4, "context": 1, "expert": 1, "tensor": 1}
    processes = _process_of(mesh.devices)
    for i in range(2):
        # The whole ICI block at data=i lies on process i.
        assert (processes[i] == i).all(), processes
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_hybrid_mesh_default_config_fills_dcn_data():
    """base.yml: dcn_data_parallelism=-1, ici_fsdp_parallelism=-1 -> data over processes, fsdp within."""
    mesh = create_mesh(cfg(), two_processes())
    assert dict(mesh.shape)["data"] == 2 and dict(mesh.shape)["fsdp"] == 4
    processes = _process_of(mesh.devices).reshape(2, 4)
    assert (processes == np.array([[0] * 4, [1] * 4])).all()


def test_hybrid_mesh_with_permuted_axes():
    config = cfg("mesh_axes=[tensor,fsdp,stage,context,expert,data]", "dcn_data_parallelism=2", "ici_fsdp_parallelism=2",
                 "ici_tensor_parallelism=2")
    mesh = create_mesh(config, two_processes())
    assert mesh.axis_names == ("tensor", "fsdp", "stage", "context", "expert", "data")
    assert mesh.devices.shape == (2, 2, 1, 1, 1, 2)
    processes = _process_of(mesh.devices)
    for i in range(2):
        assert (processes[..., i] == i).all(), processes


def test_hybrid_mesh_fsdp_across_processes():
    config = cfg("dcn_data_parallelism=1", "dcn_fsdp_parallelism=2", "ici_fsdp_parallelism=4")
    mesh = create_mesh(config, two_processes())
    assert dict(mesh.shape)["fsdp"] == 8
    processes = _process_of(mesh.devices).reshape(8)
    assert list(processes) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_hybrid_mesh_over_tpu_like_slices():
    devices = [FakeSliceDevice(i, slice_index=(i + 1) % 2) for i in range(8)]
    mesh = create_mesh(cfg("dcn_data_parallelism=2", "ici_fsdp_parallelism=4"), devices)
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    for i in range(2):
        assert (slices[i] == i).all(), slices


def test_num_slices_one_flattens_fake_processes():
    devices = two_processes()
    mesh = create_mesh(cfg("num_slices=1"), devices)
    assert dict(mesh.shape)["fsdp"] == 8 and dict(mesh.shape)["data"] == 1
    assert [d.id for d in mesh.devices.flat] == [d.id for d in devices]


def test_hybrid_degree_mismatch():
    with pytest.raises(ConfigError) as info:
        create_mesh(cfg("dcn_data_parallelism=4"), two_processes())
    assert "dcn_data_parallelism=4" in str(info.value) and "2 slices" in str(info.value)
