"""The mesh across processes, as agents would run it: a node (`epibus up`), a coordinator service, watchers and
one-shot CLI commands, each its own process, meeting only through NATS."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import cli_env, eventually_sync, journal_rows_of_kind, last_json, run_epibus

pytestmark = pytest.mark.slow
PROJECT = "fleet"


def env_for(home: Path) -> dict[str, str]:
    return cli_env(home)


def epibus(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run_epibus(home, *args, check=check, timeout_s=90)


def error_json(result: subprocess.CompletedProcess[str]) -> Any:
    """The error a failed command reports with --json: one JSON object on stderr, nothing on stdout."""
    assert result.stdout == "", result.stdout
    return json.loads(result.stderr.strip().splitlines()[-1])


def spawn(home: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "epibus", *args],
        env=env_for(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def stop(process: subprocess.Popen[str]) -> str:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    return out + err


def first_line(process: subprocess.Popen[str]) -> Any:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, f"process exited with {process.poll()}: {process.stderr.read() if process.stderr else ''}"
    return json.loads(line)


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(params=["edge"])
def node_home(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """`epibus up` with its embedded nats-server, journal and vector mirror, in its own process."""
    home = tmp_path / "home"
    process = spawn(home, "up", "--json", "--mirror", request.param)
    try:
        status = first_line(process)
        assert status["status"] == "running"
        yield home
    finally:
        stop(process)


@pytest.fixture
def coordinator(node_home: Path) -> Iterator[subprocess.Popen[str]]:
    epibus(node_home, "mesh", "coordinators", "add", "coord", "-p", PROJECT, "--agent", "coord", "--json")
    process = spawn(
        node_home,
        "mesh",
        "coordinate",
        "-p",
        PROJECT,
        "--policy",
        "auto-accept:operational",
        "--agent",
        "coord",
        "--json",
    )
    try:
        assert first_line(process)["status"] == "coordinating"
        yield process
    finally:
        stop(process)


def git_repo(path: Path) -> str:
    git = ["git", "-C", str(path), "-c", "user.email=bob@example.com", "-c", "user.name=bob"]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    (path / "logrotate.conf").write_text("weekly\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "rotate logs weekly"], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


def test_propose_accept_start_complete_acknowledge_across_processes(
    node_home: Path, coordinator: subprocess.Popen[str], tmp_path: Path
) -> None:
    home = node_home
    bob_log = tmp_path / "bob.jsonl"
    bob_watch = spawn(
        home, "mesh", "inbox", "--watch", "-p", PROJECT, "--agent", "bob", "--out", str(bob_log), "--json"
    )
    try:
        proposed = last_json(
            epibus(
                home,
                "mesh",
                "propose",
                "-p",
                PROJECT,
                "--title",
                "rotate the web logs",
                "--summary",
                "nginx logs fill /var within a week",
                "--to",
                "bob",
                "--deadline",
                "2h",
                "--agent",
                "alice",
                "--json",
            )
        )
        task = proposed["task_id"]
        assert proposed["state"] == "proposed"
        eventually_sync(
            lambda: any(n["task_id"] == task and n["action"] == "accept" for n in lines(bob_log)), timeout_s=30
        )
        assigned = next(n for n in lines(bob_log) if n["action"] == "accept")
        assert (assigned["actor"], assigned["why"]) == ("coord", "assigned to you: start it")

        sha = git_repo(tmp_path / "repo")
        epibus(home, "mesh", "start", task, "--agent", "bob", "--json")
        absent = "f" * 40
        refused = epibus(
            home,
            "mesh",
            "complete",
            task,
            "--sha",
            absent,
            "--repo",
            str(tmp_path / "repo"),
            "--agent",
            "bob",
            "--json",
            check=False,
        )
        assert refused.returncode == 1
        assert f"complete.sha='{absent}': is not a commit in" in error_json(refused)["error"]
        assert last_json(epibus(home, "mesh", "show", task, "--json"))["state"] == "working"  # nothing written
        done = last_json(
            epibus(
                home,
                "mesh",
                "complete",
                task,
                "--sha",
                sha,
                "--repo",
                str(tmp_path / "repo"),
                "--note",
                "weekly now",
                "--agent",
                "bob",
                "--json",
            )
        )
        assert done["state"] == "completed"

        pending = last_json(epibus(home, "mesh", "pending", "-p", PROJECT, "--json"))["tasks"]
        assert [(t["task_id"], t["sha"]) for t in pending] == [(task, sha)]
        assert last_json(epibus(home, "stats", "--json"))["mesh_pending"] == {PROJECT: 1}
        inbox = last_json(epibus(home, "mesh", "inbox", "-p", PROJECT, "--agent", "alice", "--json"))["tasks"]
        assert [(t["task_id"], t["why"]) for t in inbox] == [(task, "completed: check the commit and acknowledge it")]

        wrong = epibus(home, "mesh", "ack", task, "--agent", "bob", "--json", check=False)
        assert wrong.returncode == 1
        assert "only its proposer (alice) may" in error_json(wrong)["error"]
        epibus(home, "mesh", "ack", task, "--agent", "alice", "--json")
        assert last_json(epibus(home, "mesh", "pending", "-p", PROJECT, "--json"))["tasks"] == []
        assert last_json(epibus(home, "stats", "--json"))["mesh_pending"] == {}
    finally:
        stop(bob_watch)

    journal = f"sqlite:///{home / 'journal.db'}"

    def five_rows() -> list[tuple[str, dict[str, Any], str, str]] | None:
        found = journal_rows_of_kind(journal, PROJECT, "task")
        return found if len(found) == 5 else None

    rows = eventually_sync(five_rows, timeout_s=30)
    assert [(body["action"], actor) for _, body, actor, _ in rows] == [
        ("propose", "alice"),
        ("accept", "coord"),
        ("start", "bob"),
        ("complete", "bob"),
        ("acknowledge", "alice"),
    ]
    assert rows[3][1]["sha"] == sha
    assert rows[1][1]["policy"] == "auto-accept:operational"

    tailed = epibus(home, "tail", "-p", PROJECT, "-k", "task", "--from-start", "-n", "5", "--json").stdout
    assert [json.loads(line)["body"]["action"] for line in tailed.splitlines()] == [b["action"] for _, b, _, _ in rows]

    shown = last_json(epibus(home, "mesh", "show", task, "--json"))
    assert [s["message_id"] for s in shown["steps"]] == [r[0] for r in rows]

    def recalled() -> list[dict[str, Any]]:
        hits = last_json(epibus(home, "recall", "log rotation on the web servers", "-p", PROJECT, "--json"))["hits"]
        return [h for h in hits if h["kind"] == "task"] if len(hits) >= 5 else []

    hits = eventually_sync(recalled, timeout_s=60)
    assert {h["event_id"] for h in hits} == {r[0] for r in rows}
    out = stop(coordinator)
    assert '"accept": 1' in out


@pytest.mark.parametrize("node_home", ["off"], indirect=True)
def test_decline_change_and_bad_input_from_the_command_line(node_home: Path) -> None:
    home = node_home
    unknown = epibus(
        home,
        "mesh",
        "propose",
        "-p",
        "nobody",
        "--title",
        "t",
        "--summary",
        "s",
        "--agent",
        "alice",
        "--json",
        check=False,
    )
    assert unknown.returncode == 1
    assert "no coordinators" in error_json(unknown)["error"]
    epibus(home, "mesh", "coordinators", "add", "coord", "-p", PROJECT, "--agent", "coord")
    listed = last_json(epibus(home, "mesh", "coordinators", "list", "-p", PROJECT, "--json"))
    assert listed["coordinators"] == ["coord"]

    def propose(title: str) -> str:
        args = ["mesh", "propose", "-p", PROJECT, "--title", title, "--summary", "s", "--to", "bob", "--category"]
        return str(last_json(epibus(home, *args, "strategic", "--agent", "alice", "--json"))["task_id"])

    first, second = propose("move to a new cloud"), propose("split the monolith")
    intruder = epibus(home, "mesh", "accept", first, "--agent", "alice", "--json", check=False)
    assert intruder.returncode == 1
    assert (
        f"may not accept task {first} (proposed): only the coordinators of project {PROJECT} (coord)"
        in error_json(intruder)["error"]
    )
    no_reason = epibus(home, "mesh", "decline", first, "--agent", "coord", check=False)
    assert no_reason.returncode != 0
    assert "--reason" in no_reason.stderr
    epibus(home, "mesh", "decline", first, "--reason", "not this year", "--agent", "coord")
    again = epibus(home, "mesh", "accept", first, "--agent", "coord", "--json", check=False)
    assert "declined (a terminal state: it has no exit)" in error_json(again)["error"]

    changed = last_json(
        epibus(
            home,
            "mesh",
            "change",
            second,
            "--title",
            "extract the billing service",
            "--category",
            "tactical",
            "--reason",
            "smaller first step",
            "--agent",
            "coord",
            "--json",
        )
    )
    assert changed["state"] == "changed"
    assert len(changed["events"]) == 2
    child = last_json(epibus(home, "mesh", "show", second, "--json"))["child_id"]
    shown = last_json(epibus(home, "mesh", "show", child, "--json"))
    assert (shown["state"], shown["proposal"]["parent_id"], shown["proposal"]["proposer"]) == (
        "proposed",
        second,
        "alice",
    )
    assert shown["proposal"]["title"] == "extract the billing service"
    outbox = last_json(epibus(home, "mesh", "outbox", "-p", PROJECT, "--agent", "alice", "--json"))["tasks"]
    assert {t["task_id"]: t["state"] for t in outbox} == {first: "declined", second: "changed", child: "proposed"}
    bad_sha = epibus(home, "mesh", "complete", child, "--sha", "abc", "--agent", "bob", "--json", check=False)
    assert "40 or 64 lowercase hex" in error_json(bad_sha)["error"]


@pytest.mark.parametrize("node_home", ["off"], indirect=True)
def test_a_watcher_killed_and_restarted_mid_stream_misses_and_repeats_nothing(
    node_home: Path, coordinator: subprocess.Popen[str], tmp_path: Path
) -> None:
    home = node_home
    log = tmp_path / "bob.jsonl"
    watch = ["mesh", "inbox", "--watch", "-p", PROJECT, "--agent", "bob", "--out", str(log), "--json"]
    watcher = spawn(home, *watch)
    n = 12
    gate = tmp_path / "second-half"  # the producer holds its second half until the watcher is dead
    producer = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, str(n), PROJECT, str(gate)],
        env=env_for(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        eventually_sync(lambda: len(lines(log)) >= 5, timeout_s=60)
        watcher.kill()  # SIGKILL mid-stream: no chance to clean up
        watcher.wait(timeout=10)
        assert len(lines(log)) < 2 * n, "the watcher was killed after the stream ended; the test proves nothing"
        gate.touch()
        time.sleep(0.5)
        watcher = spawn(home, *watch)
        out, err = producer.communicate(timeout=120)
        assert producer.returncode == 0, err
        task_ids = json.loads(out)
        eventually_sync(lambda: len(lines(log)) >= 2 * n, timeout_s=60)
        time.sleep(1.0)  # anything repeated would arrive now
    finally:
        stop(watcher)
        if producer.poll() is None:
            producer.kill()
    notes = lines(log)
    assert [r for r, c in Counter(note["revision"] for note in notes).items() if c > 1] == []
    assert Counter((note["task_id"], note["action"]) for note in notes) == Counter(
        {(t, a): 1 for t in task_ids for a in ("propose", "accept")}
    )


# A proposer in its own process: n proposals to bob, one after another; the second half waits for the gate file,
# so the watcher is always killed mid-stream however fast this machine is.
PRODUCER = """
import asyncio, json, sys
from pathlib import Path
from bus.client.client import connect
from mesh.agent import MeshAgent

async def main(n, project, gate):
    async with connect(agent="alice") as client:
        mesh = MeshAgent(client)
        ids = []
        for i in range(n):
            if i == n // 2:
                for _ in range(2400):  # at most 120 s
                    if gate.exists():
                        break
                    await asyncio.sleep(0.05)
            outcome = await mesh.propose(project, f"job {i}", "s", category="operational", agents=["bob"])
            ids.append(outcome.record.task_id)
            await asyncio.sleep(0.2)
        print(json.dumps(ids))

asyncio.run(main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])))
"""
