"""The open-unknowns count the status snapshot shows (one grouped query over every project) against what a
briefing lists as open unknowns, project by project, on a real node's journal."""

from __future__ import annotations

import uuid
from pathlib import Path

from bus.client.client import EpibusClient, connect
from bus.host.server import NatsServer
from bus.model.vocab import ReceiptLevel
from epibus.node.node import Node
from observers.reads import briefing, open_unknown_counts
from tests.conftest import finding
from tests.support import eventually


async def unknown(client: EpibusClient, project: str, question: str) -> str:
    event = client.event("unknown", {"question": question, "impact": 0.6}, project=project)
    await client.publish(event, wait_for=ReceiptLevel.journaled)
    return event.artifact_id


async def test_the_open_unknowns_count_agrees_with_the_briefing_in_every_project(
    node: Node, nats_server: NatsServer, tmp_path: Path
) -> None:
    assert node.journal is not None
    busy, quiet, settled = (f"u-{uuid.uuid4().hex[:10]}" for _ in range(3))
    async with (
        connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice,
        connect(nats_server.url, agent="bob", home=tmp_path / "bob", outbox=False) as bob,
    ):
        await unknown(alice, busy, "why does the cache miss at midnight?")
        await unknown(alice, busy, "who rotates the keys?")
        stale = await unknown(alice, busy, "is the old queue still read?")
        disputed = await unknown(alice, busy, "does the job run twice?")
        withdrawn = await unknown(alice, busy, "is the disk failing?")
        private = await unknown(alice, busy, "whose password leaked?")
        claim = alice.event("finding", finding(text="the job runs once a day"), project=busy)
        await alice.publish(claim, wait_for=ReceiptLevel.journaled)  # a finding is no unknown, open or not
        await alice.transition("resolved", {"resolution": "stale"}, project=busy, artifact_id=stale)
        await bob.transition(
            "contradicted",
            {"contradicted_by": claim.artifact_id, "reason": "the log shows one run"},
            project=busy,
            artifact_id=disputed,
        )
        await alice.transition("rolled_back", {"reason": "asked by mistake"}, project=busy, artifact_id=withdrawn)
        await alice.forget(busy, private, reason="personal data")
        await unknown(alice, quiet, "which region is primary?")
        answered = await unknown(alice, settled, "what is the retention?")
        await alice.transition("resolved", {"resolution": "stale"}, project=settled, artifact_id=answered)

        def counted() -> dict[str, int] | None:
            assert node.journal is not None
            counts = {p: n for p, n in open_unknown_counts(node.journal).items() if p in (busy, quiet, settled)}
            return counts if counts == {busy: 2, quiet: 1} else None

        await eventually(counted, timeout_s=15)  # the forget and the transitions reach the journal in order
    briefed = {p: len(briefing(node.journal, p, limit=100).open_unknowns) for p in (busy, quiet, settled)}
    assert briefed == {busy: 2, quiet: 1, settled: 0}
    counts = open_unknown_counts(node.journal)
    assert {p: counts.get(p, 0) for p in briefed} == briefed
