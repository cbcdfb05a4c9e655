"""Forget, the privacy delete, proven on all three stores by reading each back (DESIGN §2, §10.1)."""

from __future__ import annotations

import json
from pathlib import Path

import nats.js.errors
import pytest
from sqlalchemy import text

from bus.client import connect
from bus.errors import NotFound
from bus.ids import point_id
from bus.subjects import STREAM
from bus.vocab import ReceiptLevel
from epibus.node import Node, NodeConfig
from observers.reads import artifacts, audit_artifacts, snapshot
from tests.conftest import finding
from tests.support import eventually


async def test_forget_is_proven_on_the_stream_the_journal_and_the_mirror(nats_server, tmp_path: Path, project):
    config = NodeConfig(
        home=tmp_path / "node", nats_url=nats_server.url, agent="node-a", journal_url=f"sqlite:///{tmp_path / 'j.db'}"
    )
    async with Node(config) as node:
        assert node.journal is not None and node.store is not None and node.mirror is not None
        async with (
            connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice,
            connect(nats_server.url, agent="bob", home=tmp_path / "bob", outbox=False) as bob,
        ):
            secret = alice.event("finding", finding(text="the customer's password is hunter2"), project=project)
            kept = alice.event("finding", finding(text="the login page is slow"), project=project)
            await alice.publish_many([secret, kept], wait_for=ReceiptLevel.journaled)
            await bob.transition(
                "verified", {"note": "saw hunter2 in the log"}, project=project, artifact_id=secret.artifact_id
            )
            await eventually(lambda: node.mirror.indexed == 2, timeout_s=30)

            report = await alice.forget(project, secret.artifact_id, reason="personal data")
            assert len(report.messages) == 2  # the claim and its verification

            async def proven() -> object:
                proof = await alice.prove_forgotten(report)
                return proof if proof.clean else None

            proof = await eventually(proven, timeout_s=30)
            assert proof.erased_seqs and list(proof.nodes) == ["node-a"]
            for seq, _ in report.messages:  # read back by another path than the proof's
                with pytest.raises(nats.js.errors.NotFoundError):
                    await alice.js.get_msg(STREAM, seq)
            with pytest.raises(NotFound):
                await alice.forget(project, secret.artifact_id, reason="again")
            assert (await alice.recall("what is the password", project, k=5)).hits[0]["artifact_id"] == kept.artifact_id

        assert await node.store.retrieve([point_id(secret.event_id)]) == []
        assert [p.id for p in await node.store.retrieve([point_id(kept.event_id)])] == [point_id(kept.event_id)]
        with node.journal.engine.connect() as conn:
            rows = conn.execute(
                text("SELECT status, envelope FROM events WHERE artifact_id = :a AND kind != 'forgotten'"),
                {"a": secret.artifact_id},
            ).all()
            notes = (
                conn.execute(text("SELECT note FROM verifications WHERE artifact_id = :a"), {"a": secret.artifact_id})
                .scalars()
                .all()
            )
        assert {r.status for r in rows} == {"forgotten"} and len(rows) == 2
        assert all("hunter2" not in r.envelope and json.loads(r.envelope)["redacted"] for r in rows)
        assert notes == [None]
        assert [v.state.artifact_id for v in artifacts(node.journal, project)] == [kept.artifact_id]
        assert [v.state.artifact_id for v in audit_artifacts(node.journal, project)] == [kept.artifact_id]
        node.journal.rebuild_projection()
        assert set(snapshot(node.journal, project).states) == {kept.artifact_id}
