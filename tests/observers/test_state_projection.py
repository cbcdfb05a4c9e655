"""The epistemic state end to end on real NATS and a real journal: client-side validation with
compare-and-set, the projection, the safe and audit doors, tombstones, as-of."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import text

from bus.client.client import EpibusClient, connect
from bus.errors import Conflict, Forbidden, IllegalTransition, InvalidEvent
from bus.host.server import NatsServer
from bus.model.event import Envelope
from bus.model.tombstones import FLAG_PREVIOUSLY_RETRACTED
from bus.model.vocab import ReceiptLevel, Role, Trust
from epibus.node.node import Node, NodeConfig
from observers.journal import Journal
from observers.reads import artifacts, audit_artifacts, briefing, snapshot, vocab_report
from tests.conftest import finding
from tests.support import enrol_on_stream, eventually


@pytest.fixture
async def agents(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[dict[str, EpibusClient]]:
    clients = {}
    for name in ("alice", "bob", "carol"):
        clients[name] = await connect(nats_server.url, agent=name, home=tmp_path / name, outbox=False)
    try:
        yield clients
    finally:
        for client in clients.values():
            await client.close()


async def claim(client: EpibusClient, project: str, text: str, *, source: str | None = None, **extra: object) -> str:
    event = client.event("finding", finding(text=text) | extra, project=project, source=source)
    await client.publish(event, wait_for=ReceiptLevel.journaled)
    return event.artifact_id


async def settled(journal: Journal, client: EpibusClient, project: str) -> None:
    """Wait until the journal has every event the stream has for the project (the projection commits with it)."""
    view = await client.project_view(project)
    expected = len(view.fold.artifacts) and max(view.subject_seq.values())

    def caught_up() -> bool:
        with journal.engine.connect() as conn:
            top = conn.execute(text("SELECT max(stream_seq) FROM events WHERE project = :p"), {"p": project}).scalar()
        return (top or 0) >= expected

    await eventually(caught_up, timeout_s=15)


async def test_safe_read_returns_exactly_the_safe_set_and_audit_returns_all(
    node: Node, agents: dict[str, EpibusClient], project: str
) -> None:
    alice, bob = agents["alice"], agents["bob"]
    term = "replication lag on shard seven"
    ids = {
        name: await claim(alice, project, f"{term}: {name}")
        for name in (
            "verified",
            "unverified",
            "contradicted",
            "rolled_back",
            "retracted",
            "stale",
            "superseded",
            "successor",
        )
    }
    await bob.transition("verified", {"note": "reproduced"}, project=project, artifact_id=ids["verified"])
    await bob.transition(
        "contradicted",
        {"contradicted_by": ids["verified"], "reason": "measured otherwise"},
        project=project,
        artifact_id=ids["contradicted"],
    )
    # Only the author or an admin rolls a claim back (bus/model/authority.py): alice does.
    await alice.transition("rolled_back", {"reason": "bad premise"}, project=project, artifact_id=ids["rolled_back"])
    await alice.transition("resolved", {"resolution": "retracted"}, project=project, artifact_id=ids["retracted"])
    await alice.transition("resolved", {"resolution": "stale"}, project=project, artifact_id=ids["stale"])
    await alice.transition(
        "resolved",
        {"resolution": "superseded", "superseded_by": ids["successor"]},
        project=project,
        artifact_id=ids["superseded"],
    )
    assert node.journal is not None
    await settled(node.journal, alice, project)

    safe = {v.state.artifact_id for v in artifacts(node.journal, project)}
    assert safe == {ids["verified"], ids["unverified"], ids["successor"]}  # positive control included
    with_resolved = {v.state.artifact_id for v in artifacts(node.journal, project, include_resolved=True)}
    assert with_resolved == safe | {ids["stale"], ids["superseded"]}
    audit = {v.state.artifact_id: v for v in audit_artifacts(node.journal, project)}
    assert set(audit) == set(ids.values())
    assert audit[ids["contradicted"]].state.trust is Trust.contradicted
    assert audit[ids["verified"]].verifications[0].verifier == "bob"
    assert audit[ids["superseded"]].state.superseded_by == ids["successor"]
    assert audit[ids["successor"]].state.supersedes == ids["superseded"]


async def test_illegal_transitions_are_refused_before_anything_is_written(
    node: Node, agents: dict[str, EpibusClient], project: str
) -> None:
    alice, bob = agents["alice"], agents["bob"]
    aid = await claim(alice, project, "the build is flaky")
    before = (await alice.project_view(project)).subject_seq[aid]
    with pytest.raises(IllegalTransition, match="alice is the author"):
        await alice.transition("verified", {}, project=project, artifact_id=aid)
    with pytest.raises(IllegalTransition, match="cannot contradict itself"):
        await bob.transition("contradicted", {"contradicted_by": aid, "reason": "r"}, project=project, artifact_id=aid)
    with pytest.raises(IllegalTransition, match="'ghost' does not exist"):  # resolved by its author
        await alice.transition(
            "resolved", {"resolution": "superseded", "superseded_by": "ghost"}, project=project, artifact_id=aid
        )
    with pytest.raises(InvalidEvent, match="superseded_by"):
        await bob.transition("resolved", {"resolution": "superseded"}, project=project, artifact_id=aid)
    with pytest.raises(InvalidEvent, match="resolution"):
        await bob.transition("resolved", {"resolution": "obsolete"}, project=project, artifact_id=aid)
    with pytest.raises(Forbidden, match="rule author-or-admin"):
        await bob.transition("rolled_back", {"reason": "r"}, project=project, artifact_id=aid)
    await alice.transition("rolled_back", {"reason": "r"}, project=project, artifact_id=aid)
    with pytest.raises(IllegalTransition, match=r"rolled_back/active -> verified is illegal: from rolled_back only"):
        await bob.transition("verified", {}, project=project, artifact_id=aid)
    with pytest.raises(IllegalTransition, match="no verified ancestor"):
        await bob.plan_rollback(project, await claim(alice, project, "orphan"))
    after = (await alice.project_view(project)).subject_seq[aid]
    assert after == before + 1  # only the rollback landed on the artifact's subjects


async def test_a_verify_racing_a_rollback_has_exactly_one_winner_and_both_nodes_agree(
    nats_server: NatsServer, agents: dict[str, EpibusClient], project: str, tmp_path: Path
) -> None:
    second_journal = f"sqlite:///{tmp_path / 'second.db'}"
    async with (
        Node(
            NodeConfig(
                home=tmp_path / "n1",
                nats_url=nats_server.url,
                journal_url=f"sqlite:///{tmp_path / 'first.db'}",
                mirror="off",
            )
        ) as n1,
        Node(
            NodeConfig(home=tmp_path / "n2", nats_url=nats_server.url, journal_url=second_journal, mirror="off")
        ) as n2,
    ):
        alice, bob = agents["alice"], agents["bob"]
        aid = await claim(alice, project, "the index is stale after compaction")
        bob_view, alice_view = await bob.project_view(project), await alice.project_view(project)  # same state read
        results = await asyncio.gather(  # the rollback by the author: only she (or an admin) may
            bob.transition("verified", {"note": "checked"}, project=project, artifact_id=aid, view=bob_view),
            alice.transition("rolled_back", {"reason": "wrong"}, project=project, artifact_id=aid, view=alice_view),
            return_exceptions=True,
        )
        winners = [r for r in results if not isinstance(r, BaseException)]
        losers = [r for r in results if isinstance(r, BaseException)]
        assert len(winners) == 1
        assert len(losers) == 1
        assert isinstance(losers[0], Conflict)
        assert "10071" in str(losers[0])
        assert n1.journal is not None
        await settled(n1.journal, alice, project)
        assert n2.journal is not None
        await settled(n2.journal, alice, project)
        first, second = snapshot(n1.journal, project), snapshot(n2.journal, project)
        assert first.states == second.states
        assert first.states[aid].trust in (Trust.verified, Trust.rolled_back)
        assert first.verifications == second.verifications


async def test_the_projection_rebuilt_from_the_stream_equals_the_live_one(
    node: Node, agents: dict[str, EpibusClient], project: str, tmp_path: Path
) -> None:
    alice, bob, carol = agents["alice"], agents["bob"], agents["carol"]
    root = await claim(alice, project, "baseline latency is 4 ms")
    await bob.transition("verified", {}, project=project, artifact_id=root)
    child = await claim(alice, project, "latency is 6 ms after the patch", revises=root)
    grandchild = await claim(carol, project, "latency regression is in the allocator", revises=child)
    await claim(alice, project, "nobody knows why p99 moves")
    await carol.transition("resolved", {"resolution": "retracted"}, project=project, artifact_id=grandchild)
    await claim(carol, project, "latency regression is in the allocator")  # repeats a retracted claim
    bad = alice.event("verified", {}, project=project, artifact_id=root)  # the author verifying: illegal
    await alice.publish(bad)  # published raw, past client validation: the projection must reject it
    assert node.journal is not None
    await settled(node.journal, alice, project)

    rebuilt = Journal(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    rebuilt.migrate()
    from bus.intake.reader import replay
    from observers.journal import JournalObserver

    await replay(alice.js, JournalObserver(rebuilt, name="rebuild"))
    live, again = snapshot(node.journal, project), snapshot(rebuilt, project)
    assert [asdict(s) for s in sorted(live.states.values(), key=lambda s: s.artifact_id)] == [
        asdict(s) for s in sorted(again.states.values(), key=lambda s: s.artifact_id)
    ]
    assert live.verifications == again.verifications
    with node.journal.engine.connect() as conn:
        status = conn.execute(
            text("SELECT status, reason FROM events WHERE event_id = :e"), {"e": str(bad.event_id)}
        ).one()
    assert status.status == "rejected"
    assert "alice is the author" in status.reason
    node.journal.rebuild_projection()
    assert snapshot(node.journal, project).states == live.states
    rebuilt.close()


async def test_republishing_a_retracted_claim_is_flagged_on_the_receipt_and_in_the_journal(
    node: Node, agents: dict[str, EpibusClient], project: str
) -> None:
    alice, bob = agents["alice"], agents["bob"]
    aid = await claim(alice, project, "Disk I/O is the bottleneck.")
    await alice.transition(
        "resolved", {"resolution": "retracted", "note": "it was the network"}, project=project, artifact_id=aid
    )
    again = bob.event("finding", finding(text="disk i/o is the   bottleneck"), project=project)
    receipt = await bob.publish(again, wait_for=ReceiptLevel.journaled)
    assert FLAG_PREVIOUSLY_RETRACTED in receipt.flags
    assert node.journal is not None
    await settled(node.journal, alice, project)
    state = snapshot(node.journal, project).states[again.artifact_id]
    assert FLAG_PREVIOUSLY_RETRACTED in state.flags
    with node.journal.engine.connect() as conn:
        flags = conn.execute(text("SELECT flags FROM events WHERE event_id = :e"), {"e": str(again.event_id)}).scalar()
    assert flags == FLAG_PREVIOUSLY_RETRACTED
    strict = bob.event("finding", finding(text="DISK I/O is the bottleneck!!"), project=project)
    with pytest.raises(InvalidEvent, match="retracted or rolled back"):
        await bob.publish(strict, strict=True)
    fresh = bob.event("finding", finding(text="the network is the bottleneck"), project=project)
    assert (await bob.publish(fresh, strict=True)).flags == ()


async def test_as_of_reads_before_and_after_a_retraction(
    node: Node, agents: dict[str, EpibusClient], project: str
) -> None:
    alice = agents["alice"]
    aid = await claim(alice, project, "the queue never drops messages")
    assert node.journal is not None
    await settled(node.journal, alice, project)
    before = datetime.now(UTC)
    await eventually(lambda: datetime.now(UTC) > before)  # the retraction is recorded strictly later
    await alice.transition("resolved", {"resolution": "retracted"}, project=project, artifact_id=aid)
    await settled(node.journal, alice, project)
    assert [v.state.artifact_id for v in artifacts(node.journal, project, as_of=before)] == [aid]
    assert artifacts(node.journal, project) == []
    assert snapshot(node.journal, project, as_of=before).states[aid].trust is Trust.unverified
    resolution = snapshot(node.journal, project).states[aid].resolution
    assert resolution is not None
    assert resolution.value == "retracted"
    assert [v.state.artifact_id for v in audit_artifacts(node.journal, project)] == [aid]


async def test_rollback_applies_to_the_intermediates_and_cascades_on_request(
    node: Node, agents: dict[str, EpibusClient], project: str
) -> None:
    alice, bob = agents["alice"], agents["bob"]
    base = await claim(alice, project, "v0")
    await bob.transition("verified", {}, project=project, artifact_id=base)
    chain = [base]
    for i in range(1, 6):
        chain.append(await claim(alice, project, f"v{i}", revises=chain[-1]))
    branch = await claim(alice, project, "branch", revises=chain[2])
    await enrol_on_stream(bob.js, bob.key, Role.agent, Role.admin)  # rolling back alice's claims takes an admin
    plan = await bob.plan_rollback(project, chain[3])
    assert plan.intermediates == (chain[3], chain[2], chain[1])
    assert set(plan.tainted) == {chain[4], chain[5], branch}
    plan, receipts = await bob.rollback(project, chain[3], reason="premise was wrong", cascade=True)
    assert len(receipts) == 6
    assert node.journal is not None
    await settled(node.journal, alice, project)
    states = snapshot(node.journal, project).states
    assert {a for a, s in states.items() if s.trust is Trust.rolled_back} == set(chain[1:]) | {branch}
    assert states[base].trust is Trust.verified


async def test_briefing_and_vocab_report(node: Node, agents: dict[str, EpibusClient], project: str) -> None:
    alice, bob = agents["alice"], agents["bob"]
    top = await claim(alice, project, "the deploy script skips migrations", source="search")
    unknown = alice.event("unknown", {"question": "why do migrations time out?", "impact": 0.7}, project=project)
    await alice.publish(unknown)
    mistake = alice.event(
        "mistake",
        {
            "mistake": "ran migrations twice",
            "why_wrong": "not idempotent",
            "cost_estimate": "2h",
            "root_cause": "no lock",
            "prevention": "advisory lock",
        },
        project=project,
    )
    await alice.publish(mistake)
    hunch = alice.event(
        "finding", finding(text="it is the ORM") | {"confidence": 0.9}, project=project, source="intuition"
    )
    await alice.publish(hunch)
    stale = await claim(alice, project, "migrations take 10 s")
    await alice.transition("resolved", {"resolution": "stale"}, project=project, artifact_id=stale)
    assert node.journal is not None
    await settled(node.journal, alice, project)

    brief = briefing(node.journal, project)
    assert top in [v.state.artifact_id for v in brief.top]
    assert [v.state.artifact_id for v in brief.open_unknowns] == [unknown.artifact_id]
    assert [v.state.artifact_id for v in brief.recent_mistakes_and_dead_ends] == [mistake.artifact_id]
    assert [v.state.artifact_id for v in brief.unearned_confidence] == [hunch.artifact_id]
    report = vocab_report(node.journal, project)
    assert report.resolutions == {"stale": 1, "superseded": 0, "retracted": 0, "mistyped": 0}
    assert report.sources["intuition"] == 1
    assert report.sources["search"] == 1
    assert any("every resolution (1) is 'stale'" in w for w in report.warnings)
    await bob.transition("verified", {}, project=project, artifact_id=top)
    await settled(node.journal, alice, project)
    assert not any("none of" in w for w in vocab_report(node.journal, project).warnings)


async def test_a_journaled_receipt_says_when_the_projection_rejected_the_event(
    node: Node, agents: dict[str, EpibusClient], project: str
) -> None:
    alice = agents["alice"]
    aid = await claim(alice, project, "the author cannot vouch for this")
    own = alice.event("verified", {}, project=project, artifact_id=aid)
    receipt = await alice.publish(own, wait_for=ReceiptLevel.journaled)  # raw publish, no client validation
    assert receipt.level is ReceiptLevel.journaled
    assert receipt.rejected is not None
    assert "alice is the author" in receipt.rejected


async def test_a_claim_revising_a_missing_artifact_is_refused_before_anything_is_written(
    node: Node, agents: dict[str, EpibusClient], project: str
) -> None:
    alice = agents["alice"]
    ghost = alice.event("finding", finding(text="builds on nothing") | {"revises": "ghost"}, project=project)
    with pytest.raises(IllegalTransition, match="revised artifact 'ghost' does not exist"):
        await alice.publish(ghost)
    assert (await alice.project_view(project)).subject_seq == {}


async def test_two_claims_racing_to_supersede_one_artifact_have_one_winner(
    node: Node, agents: dict[str, EpibusClient], project: str
) -> None:
    alice, bob, carol = agents["alice"], agents["bob"], agents["carol"]
    old = await claim(alice, project, "the limit is 100 requests per second")
    for other in (bob, carol):  # superseding alice's claim takes one of her identities or an admin: admins here
        await enrol_on_stream(other.js, other.key, Role.agent, Role.admin)
    first = bob.event("finding", finding(text="the limit is 120 rps") | {"supersedes": old}, project=project)
    second = carol.event("finding", finding(text="the limit is 150 rps") | {"supersedes": old}, project=project)
    receipts = await asyncio.gather(
        bob.publish(first, wait_for=ReceiptLevel.journaled),
        carol.publish(second, wait_for=ReceiptLevel.journaled),
        return_exceptions=True,
    )
    # The compare-and-set guards the superseded artifact's own subjects; two new claims land on their own
    # subjects, so both may be stored: the projection applies the first and rejects the second, saying why.
    landed = [r for r in receipts if not isinstance(r, BaseException)]
    refused = [r for r in receipts if isinstance(r, BaseException)]
    assert all(isinstance(r, IllegalTransition | Conflict) for r in refused)
    rejected = [r for r in landed if r.rejected]
    assert len(landed) - len(rejected) == 1
    assert all(r.rejected is not None and "already resolved" in r.rejected for r in rejected)
    assert node.journal is not None
    states = snapshot(node.journal, project).states
    winner = next(r for r in landed if not r.rejected)
    winner_id = first.artifact_id if winner.event_id == first.event_id else second.artifact_id
    assert states[old].superseded_by == winner_id
    assert states[winner_id].supersedes == old


async def test_as_of_follows_when_events_reached_the_stream_not_the_publishers_clock(
    node: Node, agents: dict[str, EpibusClient], project: str
) -> None:
    from datetime import timedelta

    from bus.model.event import validate_event

    alice = agents["alice"]
    draft = alice.event("finding", finding(text="written offline an hour ago"), project=project)
    late = alice.key.sign(
        validate_event(draft.model_dump() | {"recorded_at": draft.recorded_at - timedelta(hours=1), "signature": None})
    )
    await alice.publish(late, wait_for=ReceiptLevel.journaled)
    half_an_hour_ago = datetime.now(UTC) - timedelta(minutes=30)
    assert node.journal is not None
    assert artifacts(node.journal, project, as_of=half_an_hour_ago) == []  # it had not reached the stream yet
    assert [v.state.artifact_id for v in artifacts(node.journal, project)] == [late.artifact_id]


async def test_migrating_a_journal_with_events_projects_them(
    tmp_path: Path, agents: dict[str, EpibusClient], project: str
) -> None:
    from bus.intake.admission import Delivery
    from bus.subjects import event_subject
    from observers.schema import _v1_events, events, metadata, schema_versions

    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = Journal(url)
    event = agents["alice"].event("finding", finding(text="written before the upgrade"), project=project)
    with old.engine.begin() as conn:  # a journal at version 1: events, no projection
        metadata.create_all(conn, tables=[schema_versions])
        _v1_events(conn)
        conn.execute(schema_versions.insert().values(version=1, description="v1", applied_at=datetime.now(UTC)))
    delivery = Delivery(event, event_subject(project, "finding", event.artifact_id), 1, 1)
    with old.engine.begin() as conn:
        conn.execute(
            events.insert().values(
                event_id=str(event.event_id),
                stream_seq=1,
                subject=delivery.subject,
                project=project,
                kind="finding",
                artifact_id=event.artifact_id,
                actor_id="alice",
                actor_key=event.actor.public_key,
                session_id="s",
                recorded_at=event.recorded_at,
                received_at=event.recorded_at,
                signature_status="verified",
                envelope=__import__("json").dumps(event.model_dump(mode="json")),
            )
        )
    old.migrate()
    assert [v.state.artifact_id for v in artifacts(old, project)] == [event.artifact_id]
    old.close()


async def test_an_enrolment_record_learned_after_the_events_it_governs_decides_them_again(
    tmp_path: Path, agents: dict[str, EpibusClient], project: str
) -> None:
    """A journal upgraded from before enrolment records existed decided its events without them; the first batch
    that brings a record older than what it decided makes it decide everything again, as a fresh journal would."""
    from bus.intake.admission import Delivery
    from bus.model.auth import Enrolment
    from bus.model.authority import NO_RECORDS, Authority
    from bus.subjects import event_subject

    alice, bob = agents["alice"], agents["bob"]
    claim_ = alice.event("finding", finding(text="the cron job runs twice"), project=project)
    rollback = bob.event("rolled_back", {"reason": "it runs once"}, project=project, artifact_id=claim_.artifact_id)
    later = alice.event("finding", finding(text="the cron job runs at noon"), project=project)

    def delivery(event: Envelope, seq: int, authority: Authority = NO_RECORDS) -> Delivery:
        return Delivery(event, event_subject(project, event.kind, event.artifact_id), seq, 1, authority=authority)

    journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}")
    journal.migrate()
    journal.write([delivery(claim_, 1), delivery(rollback, 3)])
    assert journal.outcomes([str(rollback.event_id)])[str(rollback.event_id)]["status"] == "rejected"
    bob_admin = Enrolment(
        agent_id="bob",
        public_key=bob.key.public_key,
        owner="bob",
        roles=(Role.agent, Role.admin),
        projects=("*",),
        enrolled_by="tests",
        enrolled_at=datetime.now(UTC),
    )
    journal.write([delivery(later, 5, Authority.of([(2, bob_admin)]))])
    assert journal.outcomes([str(rollback.event_id)])[str(rollback.event_id)]["status"] == "applied"
    assert snapshot(journal, project).states[claim_.artifact_id].trust is Trust.rolled_back
    journal.close()
