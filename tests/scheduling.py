"""The order xdist hands out the suite's modules: the longest first, so no long module starts last and becomes
the run's tail. With `--dist loadscope` a module, or a test class, is one unit of work; `--no-loadscope-reorder`
keeps them in collection order (by default xdist puts the scopes with the most tests first, which sent the
differential test's two one-test halves, 75-100 s each, last). The seconds come from a recorded run; refresh
them after a change that moves a module's time:

    python -m pytest --junitxml=/tmp/suite.xml && python -m tests.scheduling /tmp/suite.xml"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

SECONDS_FILE = Path(__file__).with_name("module_seconds.json")


def module_seconds() -> dict[str, float]:
    return dict(json.loads(SECONDS_FILE.read_text())) if SECONDS_FILE.exists() else {}


def longest_first(items: list[pytest.Item]) -> None:
    """Reorder in place, stable: modules by recorded seconds, longest first; a module without a record keeps
    its place after those that have one."""
    seconds = module_seconds()
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))


def record(junit_xml: Path) -> dict[str, float]:
    """Seconds per module from a junit report (setup and teardown are inside each case's time)."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).iter("testcase"):
        module = case.get("classname", "").split(".")
        while module and not module[-1].startswith("test_"):
            module.pop()  # a test class's name follows its module's
        if module:
            totals["/".join(module) + ".py"] += float(case.get("time", "0"))
    return {name: round(total, 1) for name, total in sorted(totals.items(), key=lambda kv: -kv[1]) if total >= 1}


if __name__ == "__main__":
    recorded = record(Path(sys.argv[1]))
    SECONDS_FILE.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"{len(recorded)} modules, {sum(recorded.values()):.0f} s in all, written to {SECONDS_FILE}")
