"""XLA:TPU compiles maxpar's real train step for TPU topologies on this CPU machine (libtpu: the `tpu` extra, which
the `test` extra brings in; docs/tpu.md): each parallelism kind, DCN across two slices, a pipeline schedule and
MoE on the tiny model, and `compile_topology` through the trainer's command line: a fit (exit 0, the executable
written and refused by other devices in one line), an oversized config (exit 1 with its numbers), a bad name (2).

One topology per shape for the module (libtpu builds it once); each compile takes seconds on an idle core."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("libtpu", reason="libtpu is not installed (pip install 'maxpar[tpu]'): no TPU compiles")

from helpers import TINY  # noqa: E402

from maxpar import train as train_module  # noqa: E402
from maxpar.core.config import load_config  # noqa: E402
from maxpar.host.topology import parse_topology, topology_devices  # noqa: E402
from maxpar.plan.compile_report import TopologyReport, build_report  # noqa: E402
from maxpar.plan.hardware import load_hardware  # noqa: E402
from maxpar.plan.verify import compile_train_step  # noqa: E402

# The attention kinds compiled for TPU, every case below once per kind (attention=splash, the Pallas TPU kernel, is
# compiled under FSDP x TP and CP x EP x MoE in tests/test_splash.py).
ATTENTIONS = ["dot_product"]
MOE = ["num_experts=4", "num_experts_per_tok=2", "capacity_factor=0"]

# name -> (overrides, mesh axes the compiled step must run collectives over)
CASES = {
    "dp2_fsdp2_tp2": (["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"],
                      {"data", "fsdp", "tensor"}),
    "moe_ep2_cp2_ring_fsdp2": ([*MOE, "ici_expert_parallelism=2", "ici_context_parallelism=2",
                                "ici_fsdp_parallelism=2", "context_parallel_strategy=ring"],
                               {"expert", "context", "fsdp"}),
    "1f1b_stage2_fsdp4": (["ici_stage_parallelism=2", "ici_fsdp_parallelism=4", "pipeline_schedule=1f1b",
                           "num_pipeline_microbatches=4"], {"stage", "fsdp"}),
}


@pytest.fixture(scope="module")
def v5p_16():
    """8 TPU v5p chips (v5:2x2x2), one slice."""
    return topology_devices(parse_topology("v5p-16"))


@pytest.fixture(scope="module")
def v5p_8_twice():
    """Two slices of 4 TPU v5p chips joined by DCN."""
    return topology_devices(parse_topology("v5p-8"), num_slices=2)


def test_libtpu_leaves_no_worker_id_behind(v5p_16):
    """libtpu sets TPU_WORKER_ID to its warning text while it describes a topology; processes this one starts would
    inherit it (and maxpar's multi-host contract reads it as a worker id)."""
    from maxpar.host.topology import _process_environment

    assert "TPU_WORKER_ID" not in _process_environment() and "CLOUD_TPU_TASK_ID" not in _process_environment()


def compiled_report(devices, *overrides: str) -> TopologyReport:
    config = load_config(["configs/base.yml", *TINY, "dataset_type=synthetic", "per_device_batch_size=2",
                          *overrides])
    return build_report(config, compile_train_step(config, devices), "test", load_hardware("tpu-v5p"))


def collective_axes(report: TopologyReport) -> set[str]:
    return {axis for s in report.collectives for axis in s.axes.split("+")}


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("case", CASES)
def test_each_parallelism_compiles_for_tpu(v5p_16, case, attention):
    overrides, axes = CASES[case]
    if attention == "dot_product" and any(o.startswith("ici_context") for o in overrides):
        attention = "blockwise"  # context parallelism's attention: blockwise (or a kernel that takes offsets)
    report = compiled_report(v5p_16, *overrides, f"attention={attention}")
    assert report.device_kind == "TPU v5" and report.num_devices == 8
    assert 0 < report.memory.peak < report.memory.capacity and report.fits
    assert axes <= collective_axes(report), report.collectives
    assert "irregular" not in collective_axes(report)
    assert report.cost is not None and report.cost.flops > 0 and report.cost.seconds > 0
    assert report.cost.loop_body_once and report.cost.mfu is None  # scanned layers: XLA counts the body once


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_two_slices_put_data_parallelism_on_dcn(v5p_8_twice, attention):
    report = compiled_report(v5p_8_twice, "ici_fsdp_parallelism=4", "dcn_data_parallelism=2",
                             f"attention={attention}")
    assert report.mesh == "data=1x2 fsdp=4" and report.dcn_axes == ("data",)
    data = [s for s in report.collectives if "data" in s.axes.split("+")]
    assert data and all(s.kind == "all-reduce" for s in data)  # the gradients' reduction across slices


def test_compile_topology_fits_writes_the_executable_which_other_devices_refuse(tmp_path, capsys):
    step_file = tmp_path / "step.bin"
    common = ["configs/base.yml", *TINY, "dataset_type=synthetic", "per_device_batch_size=2",
              f"base_output_directory={tmp_path}"]
    status = train_module.main([*common, "run_name=compile", "compile_topology=v5p-16",
                                f"compiled_trainstep_file={step_file}"])
    out = capsys.readouterr()
    assert status == 0, out
    assert "maxpar: fits: peak" in out.out and "of 95.00 GiB HBM per chip" in out.out
    assert "collective-permute" in out.out or "all-gather" in out.out
    assert "Logging before InitGoogle" not in out.err + out.out  # libtpu's start-up lines: libraries.log
    report = json.loads((tmp_path / "compile" / "compile_report.json").read_text())
    assert report["fits"] and report["num_devices"] == 8 and report["mesh"] == "fsdp=8"
    assert step_file.stat().st_size > 0
    # The CPU devices of this process are not the 8 TPU v5 chips it was compiled for: one line, exit 2.
    status = train_module.main([*common, "run_name=load", "steps=1", f"compiled_trainstep_file={step_file}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert err[-1].startswith("maxpar: config error: compiled_trainstep_file=") and "8 TPU v5 device(s)" in err[-1]
    assert "cpu device(s)" in err[-1]


def test_compile_topology_that_does_not_fit_exits_1_with_its_numbers(tmp_path, capsys):
    status = train_module.main(["configs/base.yml", *TINY, "dataset_type=synthetic", "compile_topology=v5p-8",
                                "max_target_length=32768", "per_device_batch_size=8", "remat_policy=none",
                                f"base_output_directory={tmp_path}", "run_name=big"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "maxpar: does not fit: XLA:TPU needs" in out and "GiB of HBM" in out and "over" in out
    assert "remat_policy=full" in out and "attention=blockwise" in out  # what to try


def test_unknown_topology_lists_the_valid_names(tmp_path, capsys):
    status = train_module.main(["configs/base.yml", *TINY, "compile_topology=v5p-12",
                                f"base_output_directory={tmp_path}"])
    err = capsys.readouterr().err
    assert status == 2
    assert "compile_topology='v5p-12': no v5p slice of that size; valid: v5p-N" in err
