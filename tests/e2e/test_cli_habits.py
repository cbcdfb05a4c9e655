"""The CLI as a person uses it against a real node: ids shortened as git shortens commits, tables read on an
80-column terminal and pasted from, and `--wait indexed` before a recall."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_cli import as_json, epibus, error_json
from tests.support import start_node_process, stop_node_process

pytestmark = pytest.mark.slow
PROJECT = "habits"
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
ID_PREFIX = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}(?:-[0-9a-f]{1,4}){0,3}(?:-[0-9a-f]{1,12})?")


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("habits") / "epibus-home"
    process, status = start_node_process(home)
    assert str(status["mirror"]).startswith("edge")
    try:
        yield home
    finally:
        stop_node_process(process)


def publish(home: Path, text: str, *extra: str, wait: str = "indexed") -> dict[str, Any]:
    claim = ["--text", text, "--impact", "0.6", "--confidence", "0.7", "--subject", "ops", "--wait", wait]
    return dict(as_json(epibus(home, "publish", "finding", "-p", PROJECT, *claim, *extra, "--json")))


def narrow(home: Path, *args: str, columns: int = 80) -> str:
    """A command's table output as an 80-column terminal gets it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"EPIBUS_HOME": str(home)}
    result = subprocess.run(
        [sys.executable, "-m", "epibus", *args],
        env=env | {"COLUMNS": str(columns)},
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def assert_ids_on_one_line(output: str, ids: set[str]) -> dict[str, str]:
    """Every id appears on one line of at most 80 columns, whole or as a prefix of 13 characters or more that
    no other id shown shares (as git abbreviates), never folded: the characters after what is shown are not on
    the next line. Returns what each id is shown as."""
    lines = output.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    shown_as: dict[str, str] = {}
    for whole in ids:
        found = [m.group() for line in lines for m in ID_PREFIX.finditer(line) if whole.startswith(m.group())]
        assert found, (whole, output)
        shortest = min(found, key=len)
        assert len(shortest) >= 13, shortest
        assert not any(other.startswith(shortest) for other in ids - {whole}), (shortest, output)
        rest = whole[len(shortest) :]
        assert not rest or not any(line.strip().startswith(rest[:6]) for line in lines), (whole, output)
        shown_as[whole] = shortest
    return shown_as


def test_indexed_then_recalled_at_once_and_ids_by_prefix(mirrored: Path) -> None:
    home = mirrored
    cold = publish(home, "the cache is cold after every deploy")
    assert cold["level"] == "indexed"
    hits = as_json(epibus(home, "recall", "a deployment empties the cache", "-p", PROJECT, "--json"))["hits"]
    assert [h["artifact_id"] for h in hits] == [cold["artifact_id"]]  # no waiting: indexed means recall finds it
    others = [publish(home, text, wait="journaled")["artifact_id"] for text in ("disks fill at night", "dns flaps")]
    ids = {cold["artifact_id"], *others}

    # A prefix (copied with its dashes, or typed without) acts on the whole id, which is what is written.
    whole = cold["artifact_id"]
    prefix = whole[:18]
    verified = as_json(epibus(home, "verify", prefix, "-p", PROJECT, "--agent", "bob", "--json"))
    assert verified["artifact_id"] == whole
    rows = as_json(epibus(home, "events", "--artifact-id", whole[:18].replace("-", ""), "--json"))
    assert {r["artifact_id"] for r in rows} == {whole}
    assert [r["kind"] for r in rows] == ["verified", "finding"]
    audit = {a["artifact_id"]: a for a in as_json(epibus(home, "audit", "-p", PROJECT, "--journal", "node", "--json"))}
    assert audit[whole]["trust"] == "verified"
    assert audit[whole]["verifications"][0]["verifier"] == "bob"

    # UUIDv7 ids made moments apart share their first digits: the short prefix is ambiguous, listed whole.
    ambiguous = epibus(home, "lineage", whole[:4], "-p", PROJECT, "--json", check=False)
    assert ambiguous.returncode == 1
    error = error_json(ambiguous)
    assert error["type"] == "AmbiguousId"
    assert f"ARTIFACT_ID='{whole[:4]}' is ambiguous: 3 artifacts in project '{PROJECT}' start with it" in error["error"]
    assert set(UUID.findall(error["error"])) == ids
    missing = epibus(home, "resolve", "ffff0000", "-p", PROJECT, "--as", "stale", check=False)
    assert missing.returncode == 1
    assert missing.stderr.startswith(
        f"error: NotFound: artifact 'ffff0000' not found; no artifact id in project '{PROJECT}' starts with it"
    )
    elsewhere = epibus(home, "verify", prefix, "-p", "other", "--json", check=False)
    assert "no artifact id in project 'other' starts with it" in error_json(elsewhere)["error"]

    # On an 80-column terminal every id is on one line, abbreviated when the row would not fit otherwise, and
    # what is pasted from a table works; at 120 columns they are whole.
    listed = narrow(home, "artifacts", "-p", PROJECT)
    for output in (listed, narrow(home, "events", "-p", PROJECT), narrow(home, "recall", "deploys", "-p", PROJECT)):
        assert_ids_on_one_line(output, ids)
    assert_ids_on_one_line(narrow(home, "lineage", whole, "-p", PROJECT), {whole})
    pasted = assert_ids_on_one_line(listed, ids)[whole]
    shown = as_json(epibus(home, "lineage", pasted, "-p", PROJECT, "--json"))
    assert shown["artifact"]["artifact_id"] == whole
    assert all(i in narrow(home, "artifacts", "-p", PROJECT, columns=120) for i in ids)


def test_task_ids_by_prefix(mirrored: Path) -> None:
    home = mirrored
    epibus(home, "mesh", "coordinators", "add", "coord", "-p", PROJECT, "--agent", "coord")
    proposed = as_json(
        epibus(home, "mesh", "propose", "-p", PROJECT, "--title", "t", "--summary", "s", "--agent", "bob", "--json")
    )
    task = str(proposed["task_id"])
    shown = as_json(epibus(home, "mesh", "show", task[:18], "--json"))
    assert shown["proposal"]["task_id"] == task
    cancelled = as_json(epibus(home, "mesh", "cancel", task[:18].replace("-", ""), "--agent", "bob", "--json"))
    assert cancelled["task_id"] == task
    assert as_json(epibus(home, "mesh", "show", task, "-p", PROJECT, "--json"))["state"] == "canceled"
    unknown = epibus(home, "mesh", "show", "ffff0000", "-p", PROJECT, "--json", check=False)
    assert unknown.returncode == 1
    assert error_json(unknown)["type"] == "NotFound"
    assert f"no task id in project '{PROJECT}' starts with it" in error_json(unknown)["error"]
    table = narrow(home, "mesh", "outbox", "--agent", "bob")
    assert_ids_on_one_line(table, {task})


def test_wait_indexed_on_a_node_without_a_mirror_says_so_and_the_event_is_published(tmp_path: Path) -> None:
    home = tmp_path / "epibus-home"
    process, status = start_node_process(home, "--mirror", "off")
    try:
        assert status["mirror"] == "off"
        refused = epibus(
            home,
            "publish",
            "finding",
            "-p",
            PROJECT,
            *("--text", "no mirror here", "--impact", "0.5", "--confidence", "0.5", "--subject", "s"),
            *("--wait", "indexed", "--timeout", "30", "--json"),
            check=False,
            timeout=25,  # at once, not after the 30 s wait
        )
        assert refused.returncode == 1
        error = error_json(refused)
        assert error["type"] == "ConfigError"
        assert "not indexed: this node has no mirror" in error["error"]
        (event_id,) = UUID.findall(error["error"])
        rows = as_json(epibus(home, "events", "-p", PROJECT, "--json"))
        assert [r["event_id"] for r in rows] == [event_id]
        assert [r["text"] for r in rows] == ["no mirror here"]
    finally:
        stop_node_process(process)
