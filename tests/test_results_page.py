"""docs/performance.md is the records in docs/results/ rendered: every record is complete, and the page is current."""

from __future__ import annotations

import json

import pytest

from maxpar.tools import records, results_page

RECORDS = results_page.load_records()


@pytest.mark.parametrize("record", RECORDS, ids=[r["_file"] for r in RECORDS])
def test_every_record_has_the_required_fields(record):
    assert results_page.problems(record) == []


def test_performance_page_is_generated_from_the_records():
    assert results_page.PAGE.read_text(encoding="utf-8") == results_page.render(RECORDS), (
        "docs/performance.md is out of date: run python -m maxpar.tools.results_page")


def test_written_record_is_complete_and_renders_as_a_gpu_table(tmp_path):
    row = {"name": "attention=cudnn_flash_causal", "device_kind": "NVIDIA H100 80GB HBM3", "tokens_per_step": 8192,
           "compile_s": 41.2, "step_s": 0.412, "tokens_per_s": 19883.5, "tflops_per_device": 412.3, "mfu": 0.417,
           "peak_device_gib": 61.4, "final_loss": 10.1}
    refused = {"name": "per_device_batch_size=16", "out_of_memory": "RESOURCE_EXHAUSTED"}
    path = records.write_record(tmp_path, "bench_gpu", ["python", "-m", "maxpar.tools.bench", "--gpu"],
                                {"run": "maxpar bench --gpu", "rows": [row, refused]}, records.load_average(),
                                accelerator=row["device_kind"])
    assert path.name.startswith("bench_gpu-") and path.suffix == ".json"
    written = results_page.load_records(tmp_path)
    assert [results_page.problems(r) for r in written] == [[]]
    assert written[0]["machine"]["accelerator"] == "NVIDIA H100 80GB HBM3"
    assert json.loads(path.read_text())["command"] == "python -m maxpar.tools.bench --gpu"

    page = results_page.render(written)
    section = page[page.index("## GPU levers"):page.index("## Checkpoint saves")]
    assert "| setting | GPU | tokens/step | compile s | step s (median) | tokens/s | TFLOP/s/device | MFU |" in section
    assert ("| attention=cudnn_flash_causal | NVIDIA H100 80GB HBM3 | 8,192 | 41.2 | 0.412 | 19,884 | 412.3 | "
            "41.7% | 61.4 | 10.1000 |  |") in section
    assert "| per_device_batch_size=16 |" in section and "RESOURCE_EXHAUSTED |" in section


def test_a_record_without_its_fields_is_reported():
    assert results_page.problems({"name": "x", "date": "yesterday"}) == [
        "missing commit", "missing machine", "missing load_average", "missing command", "missing figures",
        "date 'yesterday' is not ISO 8601", "load_average needs start and end",
        "machine needs cpu, cores, accelerator, python and jax"]
