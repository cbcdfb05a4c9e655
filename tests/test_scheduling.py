"""The suite's own scheduling: modules with a recorded time are handed out longest first."""

from __future__ import annotations

from pathlib import Path

from tests.scheduling import record


def test_a_junit_report_becomes_seconds_per_module_with_test_classes_folded_in(tmp_path: Path) -> None:
    report = tmp_path / "suite.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.e2e.test_a" name="test_one" time="3.5"/>'
        '<testcase classname="tests.e2e.test_a.TestHalf" name="test_two" time="2.0"/>'
        '<testcase classname="tests.bus.test_b" name="test_three" time="0.4"/>'
        '<testcase classname="tests.bus.test_c" name="test_four" time="1.5"/>'
        "</testsuite></testsuites>"
    )
    assert record(report) == {"tests/e2e/test_a.py": 5.5, "tests/bus/test_c.py": 1.5}
