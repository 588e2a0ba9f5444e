"""maxpar.tools.test_cost reads pytest's JUnit XML (with tests/conftest.py's per-test CPU seconds), ranks the tests
and modules, and its record decides the development tier (conftest's `recorded_as_costly`)."""

from __future__ import annotations

from types import SimpleNamespace

import conftest
from maxpar.tools import results_page, test_cost

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_cheap" time="0.5">
  <properties><property name="cpu_s" value="0.4"/></properties></testcase>
<testcase classname="tests.test_a" name="test_costly[fsdp8]" time="30.0">
  <properties><property name="cpu_s" value="12.5"/></properties></testcase>
<testcase classname="tests.test_b.TestGroup" name="test_in_a_class" time="9.0">
  <properties><property name="cpu_s" value="7.0"/></properties><failure message="x"/></testcase>
<testcase classname="tests.test_b" name="test_skipped" time="0.0"><skipped message="no"/></testcase>
</testsuite></testsuites>
"""


def test_ranks_tests_and_modules_by_cpu_seconds_and_records_each_test_by_node_id(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT, encoding="utf-8")
    costs = test_cost.read_junit(path)
    assert [(c.module, c.name, c.outcome) for c in costs] == [
        ("tests/test_a.py", "test_cheap", "passed"), ("tests/test_a.py", "test_costly[fsdp8]", "passed"),
        ("tests/test_b.py", "TestGroup.test_in_a_class", "failed"), ("tests/test_b.py", "test_skipped", "skipped")]
    assert costs[2].nodeid == "tests/test_b.py::TestGroup::test_in_a_class"
    assert [c.name for c in test_cost.costliest(costs, 2)] == ["test_costly[fsdp8]", "TestGroup.test_in_a_class"]
    assert [(m.module, m.tests, m.cpu_s) for m in test_cost.by_module(costs)] == [("tests/test_a.py", 2, 12.9),
                                                                             ("tests/test_b.py", 2, None)]
    figures = test_cost.figures(costs, 2, 40.0, "python -m pytest -q -n 2")
    assert figures["cpu_s_by_test"]["tests/test_a.py::test_costly[fsdp8]"] == 12.5
    assert figures["failed"] == 1 and [row["cpu_s"] for row in figures["rows"]] == [12.5, 7.0]


def test_the_development_tier_leaves_out_the_tests_recorded_as_costly(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT, encoding="utf-8")
    recorded = test_cost.figures(test_cost.read_junit(path), 20, None, "")["cpu_s_by_test"]
    items = [SimpleNamespace(nodeid=node) for node in
             ("tests/test_a.py::test_cheap", "tests/test_a.py::test_costly[fsdp8]",
              "tests/test_b.py::TestGroup::test_in_a_class", "tests/test_c.py::test_new")]
    costly = conftest.recorded_as_costly(items, recorded, limit=6.0)
    assert [item.nodeid for item in costly] == ["tests/test_a.py::test_costly[fsdp8]",
                                                "tests/test_b.py::TestGroup::test_in_a_class"]


def test_the_record_keeps_every_test_for_conftest_and_the_page_shows_the_costliest(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT, encoding="utf-8")
    status = test_cost.main(["--junit", str(path), "--top", "2", "--wall_s", "40", "--load_start", "1", "2", "3",
                             "--record", str(tmp_path / "results")])
    assert status == 0
    written = results_page.load_records(tmp_path / "results")
    assert [results_page.problems(r) for r in written] == [[]]
    assert written[0]["figures"]["cpu_s_by_test"]["tests/test_a.py::test_cheap"] == 0.4
    page = results_page.render(written)
    assert "| tests/test_a.py::test_costly[fsdp8] | 12.5 | 30 |" in page  # the costliest, as a table
    assert "test_cheap" not in page  # every test's seconds stay in the record
