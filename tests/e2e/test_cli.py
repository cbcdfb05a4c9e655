"""`epibus up` as a real subprocess on the embedded defaults, driven by the CLI as a user would."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from bus.host.home import default_journal_url
from bus.host.ports import port_taken
from epibus.ops.disk_use import store_paths, store_sizes
from tests.support import eventually_sync, operator_credentials, run_epibus, start_node_process, stop_node_process

pytestmark = pytest.mark.slow


def epibus(home: Path, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run_epibus(home, *args, check=check, timeout_s=timeout)


def as_json(result: subprocess.CompletedProcess[str]) -> Any:
    """The last line of stdout as parsed JSON: an object or a list, as the command prints it."""
    return json.loads(result.stdout.strip().splitlines()[-1])


def error_json(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """The error a failed command reports with --json: one JSON object on stderr, nothing on stdout."""
    assert result.stdout == "", result.stdout
    return dict(json.loads(result.stderr.strip().splitlines()[-1]))


@pytest.fixture
def running_node(tmp_path: Path) -> Iterator[tuple[Path, dict[str, Any], subprocess.Popen[str]]]:
    home = tmp_path / "epibus-home"
    process, status = start_node_process(home)
    try:
        yield home, status, process
    finally:
        stop_node_process(process)


def test_up_publish_query_tail_stats_and_clean_stop(
    running_node: tuple[Path, dict[str, Any], subprocess.Popen[str]],
) -> None:
    home, status, process = running_node
    assert status["embedded_server"] is True
    # What the start spent its time on, part by part (a slow start names its slow part).
    assert {"server", "journal", "connect", "authority", "outbox", "mirror", "services", "loops"} <= set(
        status["startup_s"]
    )
    assert all(seconds >= 0 for seconds in status["startup_s"].values())
    assert status["server_version"].startswith("2.")
    assert (home / "node.json").exists()

    published = as_json(
        epibus(
            home,
            "publish",
            "finding",
            "--project",
            "demo",
            "--text",
            "cold cache on boot",
            "--impact",
            "0.6",
            "--confidence",
            "0.8",
            "--subject",
            "cache",
            "--evidence",
            "file:src/cache.py",
            "--wait",
            "journaled",
            "--json",
        )
    )
    assert published["level"] == "journaled"
    decision = as_json(
        epibus(
            home,
            "publish",
            "decision",
            "-p",
            "demo",
            "--choice",
            "warm it at boot",
            "--rationale",
            "a cold cache doubles p99",
            "--confidence",
            "0.7",
            "--reversibility",
            "exploratory",
            "--alternatives",
            "do nothing",
            "--alternatives",
            "bigger cache",
            "--wait",
            "journaled",
            "--json",
        )
    )

    rows = as_json(epibus(home, "events", "--project", "demo", "--json"))
    assert [r["event_id"] for r in rows] == [decision["event_id"], published["event_id"]]
    assert rows[1]["body"]["evidence"] == [{"kind": "file", "ref": "src/cache.py", "excerpt": None, "sha256": None}]
    assert rows[0]["body"]["alternatives"] == ["do nothing", "bigger cache"]
    assert as_json(epibus(home, "events", "--project", "demo", "--kind", "decision", "--json"))[0]["kind"] == "decision"

    tailed = epibus(home, "tail", "--from-start", "--count", "2", "--json").stdout.strip().splitlines()
    assert [json.loads(line)["event_id"] for line in tailed] == [published["event_id"], decision["event_id"]]

    reconciled = as_json(epibus(home, "reconcile", "--json"))
    assert reconciled["ok"] is True
    (report,) = reconciled["nodes"]
    assert report["stream_events"] == 2
    assert report["journal"]["clean"]
    assert report["mirror"]["clean"]
    vague = epibus(home, "verify", "--json", check=False)  # verify vouches for an artifact: it needs one
    assert vague.returncode == 1
    assert "Missing argument 'artifact_id'" in error_json(vague)["error"]
    stats = as_json(epibus(home, "stats", "--json"))
    assert stats["streams"]["EPI"]["messages"] == 2
    (journal_consumer,) = [c for name, c in stats["streams"]["EPI"]["consumers"].items() if name.startswith("journal-")]
    assert journal_consumer["pending"] == 0
    assert stats["streams"]["EPI_DLQ"]["messages"] == 0
    assert stats["outbox_depth"] == 0
    disk = {d["store"]: d for d in stats["disk"]}
    assert set(disk) == {"journal", "mirror", "nats", "outbox", "embedding cache", "models", "other"}
    assert all(disk[s]["bytes"] > 0 for s in ("journal", "mirror", "nats", "outbox", "embedding cache"))
    assert stats["disk_events"] == 2
    assert disk["journal"]["bytes_per_event"] == disk["journal"]["bytes"] / 2

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    assert process.stdout is not None
    assert json.loads(process.stdout.read().strip().splitlines()[-1])["status"] == "stopped"
    assert not (home / "node.json").exists()
    client_port = int(status["nats_url"].rsplit(":", 1)[1])
    assert not port_taken("127.0.0.1", client_port)  # the embedded server is gone too
    stopped = epibus(home, "stats", "--json", check=False)
    assert stopped.returncode == 1
    assert "no epibus node is running" in error_json(stopped)["error"]
    assert_store_sizes_match_du(home)


def assert_store_sizes_match_du(home: Path) -> None:
    """Each store's bytes, as stats counts them, are what `du` counts for its files (read with du, not with
    the code under test); together with `other` they are the whole home."""
    sizes = store_sizes(home, default_journal_url(home))
    for size, paths in zip(sizes, store_paths(home, default_journal_url(home)).values(), strict=False):
        present = [str(p) for p in paths if p.exists() or p.is_symlink()]
        du = subprocess.run(["du", "-s", "-B1", "-c", *present], capture_output=True, text=True, check=True)
        assert size.bytes == (int(du.stdout.splitlines()[-1].split()[0]) if present else 0), size
    whole = subprocess.run(["du", "-s", "-B1", str(home)], capture_output=True, text=True, check=True)
    assert sum(s.bytes for s in sizes) == int(whole.stdout.split()[0])


def test_bad_input_is_one_clear_line_a_nonzero_exit_and_nothing_written(
    running_node: tuple[Path, dict[str, Any], subprocess.Popen[str]],
) -> None:
    home, _, _ = running_node
    bad = epibus(
        home,
        "publish",
        "finding",
        "-p",
        "demo",
        "--text",
        "t",
        "--impact",
        "1.5",
        "--confidence",
        "0.5",
        "--subject",
        "s",
        check=False,
    )
    assert bad.returncode == 1
    assert bad.stderr.strip().count("\n") == 0
    assert "body.impact=1.5" in bad.stderr
    slug = epibus(home, "publish", "unknown", "-p", "Not A Slug", "--question", "q", "--impact", "0.1", check=False)
    assert slug.returncode == 1
    assert "project" in slug.stderr
    enum = epibus(
        home,
        "publish",
        "decision",
        "-p",
        "demo",
        "--choice",
        "c",
        "--rationale",
        "r",
        "--confidence",
        "0.5",
        "--reversibility",
        "maybe",
        check=False,
    )
    assert enum.returncode != 0
    assert "exploratory" in enum.stderr
    resolved = epibus(home, "resolve", "a1", "-p", "demo", "--as", "superseded", "--json", check=False)
    assert resolved.returncode == 1
    assert "superseded_by" in error_json(resolved)["error"]
    stats = as_json(epibus(home, "stats", "--json"))
    assert stats["streams"]["EPI"]["messages"] == 0
    assert stats["outbox_depth"] == 0


def test_garbage_goes_to_the_dlq_and_can_be_listed_and_replayed(
    running_node: tuple[Path, dict[str, Any], subprocess.Popen[str]],
) -> None:
    home, status, _ = running_node

    async def publish_garbage() -> None:
        nc = await nats.connect(str(status["nats_url"]), **operator_credentials(home))
        await nc.jetstream().publish("epi.demo.finding.bogus", b"{not json")
        await nc.close()

    asyncio.run(publish_garbage())
    epibus(
        home,
        "publish",
        "unknown",
        "-p",
        "demo",
        "--question",
        "is the DLQ wired?",
        "--impact",
        "0.2",
        "--wait",
        "journaled",
    )
    letters = as_json(epibus(home, "dlq", "list", "--json"))
    # The journal and the mirror both refuse it; the DLQ keeps one copy, naming the consumer that came first.
    assert [(d["reason"], d["consumer"].split("-")[0] in ("journal", "mirror"), d["subject"]) for d in letters] == [
        ("invalid_event", True, "epi.demo.finding.bogus")
    ]
    assert all("not JSON" in d["error"] for d in letters)
    assert len(as_json(epibus(home, "events", "-p", "demo", "--json"))) == 1

    (journal_letter,) = letters
    replayed = as_json(epibus(home, "dlq", "replay", "--seq", str(journal_letter["dlq_seq"]), "--json"))
    assert replayed["replayed"] == [journal_letter["dlq_seq"]]

    # Replayed garbage is still garbage: it comes back to the DLQ under a new sequence, never into the journal.
    def back_in_the_dlq() -> list[dict[str, object]]:
        again = as_json(epibus(home, "dlq", "list", "--json"))
        journal_seqs = [d["dlq_seq"] for d in again]
        return again if journal_seqs and journal_letter["dlq_seq"] not in journal_seqs else []

    again = eventually_sync(back_in_the_dlq, timeout_s=20)
    assert {d["reason"] for d in again} == {"invalid_event"}
    assert len(as_json(epibus(home, "events", "-p", "demo", "--json"))) == 1
    missing = epibus(home, "dlq", "replay", "--seq", "999", "--json", check=False)
    assert missing.returncode == 1
    assert "999" in error_json(missing)["error"]


def test_replay_rebuilds_a_lost_journal_from_the_stream(
    running_node: tuple[Path, dict[str, Any], subprocess.Popen[str]], tmp_path: Path
) -> None:
    home, _, _ = running_node
    ids = [
        as_json(
            epibus(
                home,
                "publish",
                "unknown",
                "-p",
                "demo",
                "--question",
                f"q{i}",
                "--impact",
                "0.1",
                "--wait",
                "journaled",
                "--json",
            )
        )["event_id"]
        for i in range(3)
    ]
    fresh = f"sqlite:///{tmp_path / 'rebuilt.db'}"
    report = as_json(epibus(home, "replay", "--journal", fresh, "--json"))
    assert (report["read"], report["inserted"], report["already_present"]) == (3, 3, 0)
    again = as_json(epibus(home, "replay", "--journal", fresh, "--json"))
    assert (again["inserted"], again["already_present"]) == (0, 3)
    rebuilt = as_json(epibus(home, "events", "--journal", fresh, "-p", "demo", "--oldest-first", "--json"))
    assert [r["event_id"] for r in rebuilt] == ids


def test_a_second_node_on_the_same_home_is_refused(
    running_node: tuple[Path, dict[str, Any], subprocess.Popen[str]],
) -> None:
    home, status, _ = running_node
    second = epibus(home, "up", "--json", check=False, timeout=30)
    assert second.returncode == 1
    assert str(status["pid"]) in error_json(second)["error"]


def test_state_commands_from_publish_to_rollback(
    running_node: tuple[Path, dict[str, Any], subprocess.Popen[str]],
) -> None:
    home, _, _ = running_node

    def publish(agent: str, text: str, *extra: str) -> str:
        out = epibus(
            home,
            "publish",
            "finding",
            "-p",
            "st",
            "--agent",
            agent,
            "--text",
            text,
            "--impact",
            "0.5",
            "--confidence",
            "0.6",
            "--subject",
            "s",
            "--wait",
            "journaled",
            "--json",
            *extra,
        )
        return str(as_json(out)["artifact_id"])

    base = publish("alice", "the scheduler starves small jobs")
    as_json(epibus(home, "verify", base, "-p", "st", "--agent", "bob", "--note", "reproduced", "--json"))
    child = publish("alice", "raising the quantum fixes it", "--revises", base)
    grandchild = publish("alice", "quantum 50 ms is optimal", "--revises", child)
    own = epibus(home, "verify", child, "-p", "st", "--agent", "alice", "--json", check=False)
    assert own.returncode == 1
    assert "alice is the author" in error_json(own)["error"]

    plan = as_json(epibus(home, "rollback", child, "-p", "st", "--agent", "bob", "--json"))
    assert plan["applied"] is False
    assert plan["plan"]["intermediates"] == [child]
    assert plan["plan"]["tainted"] == [grandchild]
    assert plan["receipts"] == []
    # Only the author (or an admin) rolls a claim back: bob is refused before anything is published, alice may.
    refused = epibus(
        home, "rollback", child, "-p", "st", "--agent", "bob", "--cascade", "--apply", "--json", check=False
    )
    assert refused.returncode == 1
    assert "rule author-or-admin" in error_json(refused)["error"]
    applied = as_json(epibus(home, "rollback", child, "-p", "st", "--agent", "alice", "--cascade", "--apply", "--json"))
    assert len(applied["receipts"]) == 2

    retract = publish("carol", "the scheduler is fair")
    epibus(home, "resolve", retract, "-p", "st", "--as", "retracted", "--agent", "carol", "--json")
    contra = epibus(home, "contradict", base, "-p", "st", "--by", base, "--reason", "r", "--agent", "bob", check=False)
    assert contra.returncode == 1
    assert "cannot contradict itself" in contra.stderr

    def settled() -> bool:
        return len(as_json(epibus(home, "audit", "-p", "st", "--journal", "node", "--json"))) == 4 and all(
            a["trust"] == "rolled_back"
            for a in as_json(epibus(home, "audit", "-p", "st", "--journal", "node", "--json"))
            if a["artifact_id"] in (child, grandchild)
        )

    eventually_sync(settled, timeout_s=20)
    lineage = as_json(epibus(home, "lineage", child, "-p", "st", "--json"))
    assert [a["artifact_id"] for a in lineage["ancestors"]] == [base]
    assert [(d["artifact_id"], d["depth"], d["trust"]) for d in lineage["descendants"]] == [
        (grandchild, 1, "rolled_back")
    ]
    assert (lineage["artifact"]["trust"], lineage["missing"], lineage["cycle"]) == ("rolled_back", [], [])
    drawn = run_epibus(home, "lineage", grandchild, "-p", "st", columns=160)  # a terminal: the table is drawn
    # a table of three rows (the root, the child, the grandchild), each id whole on its line, under a title
    # naming the artifact
    assert f"lineage of {grandchild} in st" in drawn.stdout
    lines = drawn.stdout.splitlines()
    assert [sum(artifact in line for line in lines) for artifact in (base, child, grandchild)] == [1, 1, 2]
    unknown = epibus(home, "lineage", "no-such-artifact", "-p", "st", "--json", check=False)
    assert unknown.returncode == 1
    assert "project 'st' holds no such artifact" in error_json(unknown)["error"]
    safe = [a["artifact_id"] for a in as_json(epibus(home, "artifacts", "-p", "st", "--json"))]
    assert safe == [base]
    audit = {a["artifact_id"]: a for a in as_json(epibus(home, "audit", "-p", "st", "--journal", "node", "--json"))}
    assert audit[base]["verifications"][0]["verifier"] == "bob"
    assert audit[retract]["resolution"] == "retracted"
    repeated = epibus(
        home,
        "publish",
        "finding",
        "-p",
        "st",
        "--agent",
        "dave",
        "--text",
        "The scheduler is FAIR.",
        "--impact",
        "0.5",
        "--confidence",
        "0.6",
        "--subject",
        "s",
        "--strict",
        check=False,
    )
    assert repeated.returncode == 1
    assert "retracted or rolled back" in repeated.stderr
    brief = as_json(epibus(home, "briefing", "-p", "st", "--json"))
    assert [a["artifact_id"] for a in brief["top"]] == [base]
    report = as_json(epibus(home, "vocab-report", "-p", "st", "--json"))
    assert report["resolutions"]["retracted"] == 1
    assert report["trust"]["rolled_back"] == 2
    before = as_json(epibus(home, "artifacts", "-p", "st", "--as-of", "2020-01-01T00:00:00", "--json"))
    assert before == []


def test_recall_from_the_cli_finds_a_paraphrase_and_hides_a_retraction(
    running_node: tuple[Path, dict[str, Any], subprocess.Popen[str]],
) -> None:
    home, status, _ = running_node
    assert status["mirror"].startswith("edge")
    assert status["embedding_model"]

    def publish(text: str) -> str:
        out = epibus(
            home,
            "publish",
            "finding",
            "-p",
            "rc",
            "--text",
            text,
            "--impact",
            "0.6",
            "--confidence",
            "0.7",
            "--subject",
            "ops",
            "--json",
        )
        return str(as_json(out)["artifact_id"])

    cold = publish("the cache is cold after every deploy")
    publish("bananas are yellow when ripe")

    def found() -> list[dict[str, object]]:
        hits = as_json(epibus(home, "recall", "a deployment leaves the cache empty", "-p", "rc", "--json"))["hits"]
        return hits if len(hits) == 2 else []

    hits = eventually_sync(found, timeout_s=30)
    assert hits[0]["artifact_id"] == cold
    epibus(home, "resolve", cold, "-p", "rc", "--as", "retracted", "--json")

    def hidden() -> bool:
        hits = as_json(epibus(home, "recall", "a deployment leaves the cache empty", "-p", "rc", "--json"))["hits"]
        return cold not in [h["artifact_id"] for h in hits]

    eventually_sync(hidden, timeout_s=30)
    brief = as_json(epibus(home, "briefing", "-p", "rc", "--goal-text", "keep deploys from emptying caches", "--json"))
    assert [h["artifact_id"] for h in brief["semantic"]["hits"]] != []
    assert cold not in [h["artifact_id"] for h in brief["semantic"]["hits"]]
    audit = as_json(epibus(home, "audit-recall", "a deployment leaves the cache empty", "-p", "rc", "--json"))
    assert audit["hits"][0]["artifact_id"] == cold
    assert audit["hits"][0]["state"]["resolution"] == "retracted"
    empty = epibus(home, "recall", "   ", "-p", "rc", check=False)
    assert empty.returncode == 1
    assert "query" in empty.stderr


def test_forget_from_the_cli_reports_every_store_clean(
    running_node: tuple[Path, dict[str, Any], subprocess.Popen[str]],
) -> None:
    home, _, _ = running_node
    out = epibus(
        home,
        "publish",
        "finding",
        "-p",
        "fg",
        "--text",
        "the api key is sk-123",
        "--impact",
        "0.5",
        "--confidence",
        "0.5",
        "--subject",
        "secrets",
        "--wait",
        "journaled",
        "--json",
    )
    artifact = as_json(out)["artifact_id"]

    def holding() -> list[Path]:  # read by plain Python, not by the node's scanner
        files = [p for p in home.rglob("*") if not p.is_symlink() and p.is_file()]
        return [p for p in files if b"api key is sk-123" in p.read_bytes()]

    assert holding()  # the journal and outbox hold it before the forget
    proof = as_json(epibus(home, "forget", artifact, "-p", "fg", "--reason", "leaked secret", "--json"))
    assert proof["ok"] is True
    assert proof["clean"] is True
    assert proof["stream"] == {"messages": 1, "erased": 1, "clean": True}
    (node,) = proof["nodes"].values()
    assert node["journal_content_left"] == 0
    assert node["mirror_points"] == 0
    assert node["projection_rows"] == 0
    assert node["files"] == []
    assert node["unscrubbable"] == {}
    assert holding() == []
    rows = as_json(epibus(home, "events", "-p", "fg", "--json"))
    assert all("sk-123" not in json.dumps(r) for r in rows)
    unknown = epibus(home, "forget", "nope", "-p", "fg", "--reason", "r", check=False)
    assert unknown.returncode == 1
    assert "not found" in unknown.stderr


def test_health_says_when_the_node_is_well_and_when_none_runs(
    running_node: tuple[Path, dict[str, Any], subprocess.Popen[str]],
) -> None:
    home, status, process = running_node
    assert status["name"]  # a unique name kept in its home
    report = eventually_sync(lambda: _healthy(home), timeout_s=30)
    assert report["ok"] is True
    assert report["problems"] == []
    assert report["report"]["name"] == status["name"]
    assert any(name.startswith("journal-") for name in report["report"]["observers"])
    shown = epibus(home, "health")
    assert "healthy" in shown.stdout
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    down = epibus(home, "health", check=False)
    assert down.returncode == 1
    assert down.stderr.strip().splitlines() == [
        f"error: no epibus node is running under {home}; start one with `epibus up`"
    ]
    assert as_json(epibus(home, "health", "--json", check=False))["ok"] is False


def _healthy(home: Path) -> dict[str, Any] | None:
    result = epibus(home, "health", "--json", check=False)
    return as_json(result) if result.returncode == 0 else None
