"""`epibus statusline` against a real `epibus up` driven through the command line: the figures a known workload
leaves (read back through `mesh inbox`, `mesh pending` and `briefing` as well), what it says once the node is
stopped or killed, and that a broken snapshot or outbox still gives one line and exit code 0."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_mesh_processes import env_for, epibus
from tests.e2e.test_node_kill import Up
from tests.support import eventually_sync, last_json, start_node_process, stop_node_process

pytestmark = pytest.mark.slow
PROJECT = "demo"
SHA = "c" * 40


def statusline(home: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "epibus", "statusline", *args],
        env=env_for(home) | (env or {}),
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""
    assert len(result.stdout.splitlines()) == 1  # one line, whatever it says
    return result


def facts(home: Path, *args: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(statusline(home, "--json", *args).stdout)
    return found


def figures(home: Path, agent: str, *args: str) -> tuple[Any, ...]:
    f = facts(home, "--agent", agent, *args)
    return f["node"], f["outbox"]["waiting"], f["inbox"], f["ack"], f["unknowns"]


@pytest.fixture
def node_home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "home"
    process, status = start_node_process(home, "--mirror", "off")
    try:
        assert status["status"] == "running"
        yield home
    finally:
        stop_node_process(process)


def propose_to_bob(home: Path, title: str) -> str:
    args = ("mesh", "propose", "-p", PROJECT, "--title", title, "--summary", "s", "--to", "bob", "--agent", "alice")
    task: str = last_json(epibus(home, *args, "--json"))["task_id"]
    epibus(home, "mesh", "accept", task, "--agent", "coord", "--json")
    return task


def publish_unknown(home: Path, question: str) -> str:
    args = ("publish", "unknown", "-p", PROJECT, "--question", question, "--impact", "0.5", "--agent", "alice")
    artifact: str = last_json(epibus(home, *args, "--json"))["artifact_id"]
    return artifact


def test_the_statusline_shows_the_inbox_acknowledgements_and_unknowns_a_known_workload_leaves(node_home: Path) -> None:
    home = node_home
    epibus(home, "mesh", "coordinators", "add", "coord", "-p", PROJECT, "--agent", "coord", "--json")
    propose_to_bob(home, "rotate the web logs")  # accepted: in bob's inbox, and in alice's (decided)
    done = propose_to_bob(home, "trim the cache")
    epibus(home, "mesh", "start", done, "--agent", "bob", "--json")
    epibus(home, "mesh", "complete", done, "--sha", SHA, "--agent", "bob", "--json")  # alice is to acknowledge
    publish_unknown(home, "why does the cache miss at midnight?")
    answered = publish_unknown(home, "who rotates the keys?")
    epibus(home, "resolve", answered, "-p", PROJECT, "--as", "stale", "--agent", "alice", "--json")

    expected = {"alice": ("up", 0, 2, 1, 1), "bob": ("up", 0, 1, 0, 1), "coord": ("up", 0, 0, 0, 1)}
    eventually_sync(lambda: {a: figures(home, a, "-p", PROJECT) for a in expected} == expected, timeout_s=20)
    # The same figures by the commands that list them.
    for agent, (_, _, inbox, ack, _) in expected.items():
        listed = last_json(epibus(home, "mesh", "inbox", "-p", PROJECT, "--agent", agent, "--json"))["tasks"]
        assert len(listed) == inbox
        pending = last_json(epibus(home, "mesh", "pending", "-p", PROJECT, "--json"))["tasks"]
        assert len([t for t in pending if t["proposer"] == agent]) == ack
    briefed = last_json(epibus(home, "briefing", "-p", PROJECT, "--json"))
    assert len(briefed["open_unknowns"]) == 1

    line = statusline(home, "--agent", "alice", "-p", PROJECT).stdout.strip()
    assert line == "epibus up · outbox 0 · inbox 2 · ack 1 · unknowns 1 (demo)"
    assert statusline(home, "--agent", "alice").stdout.strip() == "epibus up · outbox 0 · inbox 2 · ack 1 · unknowns 1"
    assert figures(home, "alice", "-p", "elsewhere") == ("up", 0, 0, 0, 0)  # another project has none of these
    env = {"EPIBUS_AGENT": "bob", "EPIBUS_PROJECT": PROJECT}
    assert json.loads(statusline(home, "--json", env=env).stdout)["inbox"] == 1
    # An agent without a key under this home is not counted by the node: its figures are unknown, never 0.
    stranger = statusline(home, "--agent", "stranger", "-p", PROJECT).stdout.strip()
    assert stranger == "epibus up · outbox 0 · inbox ? · ack ? · unknowns 1 (demo)"


def test_a_stopped_node_reads_as_down_with_the_events_an_offline_publish_left_in_the_outbox(tmp_path: Path) -> None:
    home = tmp_path / "home"
    process, _ = start_node_process(home, "--mirror", "off")
    try:
        eventually_sync(lambda: facts(home, "--agent", "alice")["node"] == "up", timeout_s=20)
    finally:
        stop_node_process(process)
    assert statusline(home).stdout.strip() == "epibus down · outbox 0 waiting"
    publish_unknown(home, "is anyone there?")
    publish_unknown(home, "still nobody?")
    assert statusline(home, "--agent", "alice", "-p", PROJECT).stdout.strip() == "epibus down · outbox 2 waiting"
    found = facts(home, "--agent", "alice")
    assert (found["node"], found["outbox"], found["inbox"], found["unknowns"]) == (
        "down",
        {"waiting": 2, "parked": 0},
        None,
        None,
    )


def test_a_killed_node_whose_snapshot_is_still_fresh_reads_as_down_never_up(tmp_path: Path) -> None:
    runner = Up(tmp_path / "home")
    try:
        runner.start()
        eventually_sync(lambda: facts(runner.home)["node"] == "up", timeout_s=20)
        runner.kill_group()
    finally:
        runner.close()
    assert (runner.home / "node.json").exists()  # left behind by the kill, naming a dead process
    found = facts(runner.home)
    assert found["node"] == "down"
    assert found["snapshot_age_s"] < 10  # fresh enough, but its writer is gone
    assert statusline(runner.home).stdout.strip() == "epibus down · outbox 0 waiting"


def test_a_corrupt_snapshot_or_outbox_gives_one_line_and_exit_code_zero(tmp_path: Path) -> None:
    home = tmp_path / "home"
    process, _ = start_node_process(home, "--mirror", "off")
    stop_node_process(process)
    (home / "status.json").write_text('{"format": 1, "pid": ')
    assert statusline(home).stdout.strip() == "epibus down · outbox 0 waiting · status ?"
    found = facts(home)
    assert found["status_readable"] is False
    assert any("status.json is not JSON" in p for p in found["problems"])
    (home / "outbox.db").write_bytes(b"not an sqlite file " * 100)
    for side in ("outbox.db-wal", "outbox.db-shm"):
        (home / side).unlink(missing_ok=True)
    assert statusline(home).stdout.strip() == "epibus down · outbox ? · status ?"
    found = facts(home)
    assert found["outbox"] is None
    assert len(found["problems"]) == 2
