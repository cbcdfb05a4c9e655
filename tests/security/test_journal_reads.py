"""Journal reads (events, artifacts, audit, briefing, lineage, vocab report) from an enrolled agent's seat: they
go through a node under recall's membership rules, a refusal names its rule, and the read a node answers is
the read its operator makes on the file."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Connection

from bus.client.client import EpibusClient, connect
from bus.client.fleet import ask_journal
from bus.errors import Forbidden, StoreDamaged, Unavailable
from bus.identity.signing import AgentKey, wire_message
from bus.model.event import draft_event
from bus.model.requests import JOURNAL_READS, JournalReadRequest, build_request
from bus.model.vocab import Role
from epibus.node.node import Node, NodeConfig
from observers.journal import Journal
from observers.read_service import READ_ATTEMPTS, read_answering, read_journal
from tests.conftest import finding
from tests.support import enrol_agent, eventually, journal_event_ids


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    async with Node(NodeConfig(home=tmp_path / "home", mirror="off")) as running:
        yield running


@contextlib.asynccontextmanager
async def agent(node: Node, name: str, projects: list[str], roles: list[Role]) -> AsyncIterator[EpibusClient]:
    home = node.config.home
    # A person's key is never among the node home's agent keys (the node would enrol it as an agent).
    key = AgentKey.load_or_create(home.parent / "people" if Role.reviewer in roles else home, name)
    await enrol_agent(node.nats_url, home, key, roles=roles, projects=projects)
    async with connect(node.nats_url, key=key, home=home, outbox=False) as client:
        yield client


async def read(client: EpibusClient, **fields: object) -> Any:
    request = build_request(JournalReadRequest, **fields)
    return await ask_journal(client.connection.require_nc(), client.key, request)


async def test_an_agent_reads_its_projects_through_a_node_and_is_refused_the_others_by_rule(
    node: Node, project: str
) -> None:
    theirs = f"{project}-b"
    async with (
        agent(node, "bob", [theirs], [Role.agent]) as bob,
        agent(node, "mallory", [project], [Role.agent]) as mallory,
        agent(node, "rita", [theirs], [Role.agent, Role.reviewer]) as rita,
    ):
        claim = bob.event("finding", finding(1, "the cache is warm"), project=theirs)
        await bob.publish(claim)
        assert node.journal is not None
        url = node.journal.url
        await eventually(lambda: str(claim.event_id) in journal_event_ids(url, theirs))
        for kind in JOURNAL_READS:
            fields = {
                "read": kind,
                "project": theirs,
                "artifact_id": claim.artifact_id if kind == "lineage" else None,
            }
            with pytest.raises(Forbidden, match=rf"agent 'mallory' may not ask epibus.journal.read: project {theirs}"):
                await read(mallory, **fields)
        views = await read(bob, read="artifacts", project=theirs)
        assert [v["content"] for v in views] == ["the cache is warm"]
        with pytest.raises(Forbidden, match=r"the audit read .* is for reviewers and admins"):
            await read(bob, read="audit", project=theirs)
        audited = await read(rita, read="audit", project=theirs)
        assert [v["artifact_id"] for v in audited] == [claim.artifact_id]
        with pytest.raises(Forbidden, match="every project"):
            await read(bob, read="events")


async def test_the_read_a_node_answers_is_the_operators_read_of_the_file(node: Node, project: str) -> None:
    async with agent(node, "alice", [project], [Role.agent, Role.reviewer]) as alice:
        first = alice.event("finding", finding(1), project=project)
        await alice.publish(first)
        await alice.publish(alice.event("unknown", {"question": "is it warm?", "impact": 0.4}, project=project))
        second = alice.event("finding", finding(2) | {"revises": first.artifact_id}, project=project)
        await alice.publish(second)
        journal = node.journal
        assert journal is not None
        await eventually(lambda: len(journal_event_ids(journal.url, project)) == 3)
        for kind in JOURNAL_READS:
            fields = {
                "read": kind,
                "project": project,
                "artifact_id": second.artifact_id if kind == "lineage" else None,
            }
            through_node = await read(alice, **fields)
            direct = read_journal(journal, build_request(JournalReadRequest, **fields))
            assert _without_ages(through_node) == _without_ages(direct), kind


def _without_ages(value: object) -> object:
    """An answer without what depends on the moment it was read (relevance decays, `at` is now)."""
    if isinstance(value, dict):
        return {k: _without_ages(v) for k, v in value.items() if k not in ("relevance", "at")}
    if isinstance(value, list):
        return [_without_ages(v) for v in value]
    return value


def test_a_read_from_a_home_with_no_node_says_so_instead_of_an_empty_table(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"EPIBUS_HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "epibus", "artifacts", "-p", "demo", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "0 artifact" not in result.stdout
    assert "node" in result.stderr.splitlines()[-1]


async def test_a_backdated_event_takes_its_place_in_time_from_the_stream_on_every_read(
    node: Node, project: str
) -> None:
    """recorded_at 20 days back is admitted (an outbox may drain that late), but the fleet learned it now: an
    as-of read of ten days ago does not show it, one of now does, and `--since 1h` lists it among the new."""
    async with agent(node, "mallory", [project], [Role.agent]) as mallory:
        backdated = mallory.key.sign(
            draft_event(
                "finding",
                finding(1, "it was always like this"),
                project=project,
                actor=mallory.key.actor,
                session_id="s",
                recorded_at=datetime.now(UTC) - timedelta(days=20),
            )
        )
        message = wire_message(backdated)
        await mallory.js.publish(message.subject, message.data, headers=dict(message.headers))
        journal = node.journal
        assert journal is not None
        await eventually(lambda: str(backdated.event_id) in journal_event_ids(journal.url, project))
        now = datetime.now(UTC)

        def ids(**fields: Any) -> list[str]:
            found = read_journal(journal, build_request(JournalReadRequest, project=project, **fields))
            return [row.get("event_id") or row["created_event_id"] for row in found]

        assert ids(read="artifacts", as_of=now - timedelta(days=10)) == []
        assert ids(read="artifacts", as_of=now) == [str(backdated.event_id)]
        assert ids(read="events", since=now - timedelta(hours=1)) == [str(backdated.event_id)]
        assert ids(read="events", until=now - timedelta(days=10)) == []
        (row,) = read_journal(journal, build_request(JournalReadRequest, read="events", project=project))
        assert datetime.fromisoformat(row["recorded_at"]) < now - timedelta(days=19)
        assert datetime.fromisoformat(row["stored_at"]) > now - timedelta(minutes=5)


class FailingJournal(Journal):
    """A real SQLite journal whose first `failures` reads fail with `error`, as a locked or unreadable file
    would: the journal is not under test, the read service's answer to it is."""

    def __init__(self, url: str, error: Exception, failures: int) -> None:
        super().__init__(url)
        self.error, self.failures, self.reads = error, failures, 0

    @contextlib.contextmanager
    def reading(self, doing: str, *, one_snapshot: bool = False) -> Iterator[Connection]:
        self.reads += 1
        if self.reads <= self.failures:
            raise self.error
        with super().reading(doing, one_snapshot=one_snapshot) as conn:
            yield conn


@pytest.mark.parametrize(
    ("error", "failures", "answered", "reads"),
    [
        (Unavailable("journal", "database is locked"), 2, True, 3),
        (Unavailable("journal", "disk I/O error"), READ_ATTEMPTS, False, READ_ATTEMPTS),
        (StoreDamaged("journal", "journal.db", "malformed", "rebuild it"), 1, False, 1),
    ],
    ids=["passing-outage", "lasting-outage", "damage"],
)
async def test_a_journal_outage_is_asked_again_a_bounded_number_of_times_and_damage_never(
    tmp_path: Path, error: Exception, failures: int, answered: bool, reads: int
) -> None:
    journal = FailingJournal(f"sqlite:///{tmp_path / 'journal.db'}", error, failures)
    journal.migrate()
    request = build_request(JournalReadRequest, read="artifacts", project="p")
    try:
        if answered:
            assert await read_answering(journal, request) == []
        else:
            with pytest.raises(type(error)):
                await read_answering(journal, request)
        assert journal.reads == reads
    finally:
        journal.close()
