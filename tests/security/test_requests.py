"""A node's request services answer only those allowed, against the configuration `epibus up` runs (the
embedded server with authentication): every request must be signed by the node's key or an enrolled, active
agent, recent, with the answer going to the signer's own inbox, and each service applies its rule (members of
the project; the audit door for reviewers; repairs, reindexing, erasing and scrubbing for admins). Refusals are
error replies naming the rule, and the stores read back unchanged."""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import pytest
from nats.aio.client import Client as NatsClient

from bus.client import enrol
from bus.client.client import EpibusClient, connect
from bus.client.fleet import ask_verify
from bus.errors import Forbidden
from bus.identity.signing import AgentKey, node_key
from bus.model.auth import inbox_prefix
from bus.model.forget import ForgetReport, content_fingerprints
from bus.model.ids import point_id
from bus.model.vocab import ReceiptLevel, Role
from bus.subjects import (
    FORGET_ERASE,
    JOURNAL_LOOKUP,
    LIST_AGENTS,
    PROVE_FORGOTTEN,
    RECALL,
    REINDEX,
    STREAM,
    VERIFY,
)
from epibus.node.node import Node, NodeConfig
from observers.mirror.embed import text_key
from tests.conftest import finding
from tests.support import enrol_agent, eventually


@dataclass
class Fleet:
    node: Node
    home: Path
    tmp: Path
    project: str

    async def agent(self, name: str, roles: list[Role], projects: list[str]) -> AgentKey:
        """An agent with its own home (no node key there), enrolled with exactly these roles and projects."""
        key = AgentKey.load_or_create(self.tmp / name, name)
        await enrol_agent(self.node.nats_url, self.home, key, roles=roles, projects=projects)
        return key

    def client(self, key: AgentKey) -> connect:
        return connect(self.node.nats_url, agent=key.agent_id, home=self.tmp / key.agent_id, outbox=False)

    async def operator(self) -> NatsClient:
        return await nats.connect(self.node.nats_url, **node_key(self.home).nats_credentials)


@pytest.fixture
async def fleet(tmp_path: Path, project: str) -> AsyncIterator[Fleet]:
    home = tmp_path / "home"
    async with Node(NodeConfig(home=home, name="node-a")) as node:
        assert node.authenticated
        yield Fleet(node, home, tmp_path, project)


async def claim(fleet: Fleet, writer: EpibusClient, text: str) -> tuple[str, str, int]:
    """Publish a claim and wait until the node journaled and mirrored it: (artifact id, event id, stream seq)."""
    event = writer.event("finding", finding(text=text), project=fleet.project)
    receipt = await writer.publish(event, wait_for=ReceiptLevel.journaled, timeout_s=30)
    assert fleet.node.store is not None
    store = fleet.node.store
    await eventually(lambda: store.retrieve([point_id(event.event_id)]), timeout_s=60)
    assert receipt.stream_seq is not None
    return event.artifact_id, str(event.event_id), receipt.stream_seq


async def ask_raw(
    nc: NatsClient, subject: str, body: bytes, *, reply: str, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """Publish a request as any process could, and read the one reply on `reply` (the connection must be
    allowed to receive there)."""
    sub = await nc.subscribe(reply)
    try:
        await nc.publish(subject, body, reply=reply, headers=headers)
        answer: dict[str, Any] = json.loads((await sub.next_msg(timeout=10)).data)
        return answer
    finally:
        await sub.unsubscribe()


def signed(key: AgentKey, subject: str, reply: str, body: bytes, *, age_s: float = 0.0) -> dict[str, str]:
    return key.sign_request(subject, reply, body, signed_at=datetime.now(UTC) - timedelta(seconds=age_s))


def bodies(project: str) -> dict[str, bytes]:
    """A well-formed request for each service: only who asks is wrong."""
    event_id = str(uuid.uuid4())
    return {
        RECALL: json.dumps({"query": "backups", "project": project, "k": 3}).encode(),
        VERIFY: json.dumps({"project": project}).encode(),
        REINDEX: json.dumps({"progress": None}).encode(),
        PROVE_FORGOTTEN: json.dumps({"project": project, "artifact_id": "a1", "event_ids": []}).encode(),
        FORGET_ERASE: json.dumps({"project": project, "artifact_id": "a1"}).encode(),
        JOURNAL_LOOKUP: json.dumps([event_id]).encode(),
        LIST_AGENTS: b"{}",
    }


async def test_an_unsigned_request_is_refused_by_every_service_even_from_an_admins_connection(fleet: Fleet) -> None:
    admin = await fleet.agent("root", [Role.admin], ["*"])
    nc = await nats.connect(fleet.node.nats_url, **admin.nats_credentials)
    try:
        for subject, body in bodies(fleet.project).items():
            reply = await ask_raw(nc, subject, body, reply=nc.new_inbox())
            assert set(reply) == {"node", "error"}, (subject, reply)
            assert "the request is not signed" in reply["error"], (subject, reply)
            counts = fleet.node.services[subject].counts
            assert (counts.forbidden, counts.answered, counts.refused) == (1, 0, 0), subject
        # The same admin, signing: answered (a service that cannot answer this body says why, never "not signed").
        for subject in (VERIFY, JOURNAL_LOOKUP, LIST_AGENTS, PROVE_FORGOTTEN):
            body = bodies(fleet.project)[subject]
            inbox = nc.new_inbox()
            reply = await ask_raw(nc, subject, body, reply=inbox, headers=signed(admin, subject, inbox, body))
            assert "error" not in reply, (subject, reply)
            assert fleet.node.services[subject].counts.answered == 1
    finally:
        await nc.close()


async def test_recall_answers_members_only_and_the_audit_door_reviewers_only(fleet: Fleet) -> None:
    writer = await fleet.agent("writer", [Role.agent], [fleet.project])
    stranger = await fleet.agent("stranger", [Role.agent, Role.reviewer], ["someone-else"])
    member = await fleet.agent("member", [Role.agent], [fleet.project])
    reviewer = await fleet.agent("reviewer", [Role.reviewer], [fleet.project])
    async with fleet.client(writer) as w:
        artifact_id, _, _ = await claim(fleet, w, "the nightly backup skips the largest table")
    async with fleet.client(stranger) as s:
        with pytest.raises(Forbidden, match=f"project {fleet.project}: only its members may"):
            await s.recall("backups miss a table", fleet.project, k=3)
    async with fleet.client(member) as m:
        assert [h["artifact_id"] for h in (await m.recall("backups miss a table", fleet.project, k=3)).hits] == [
            artifact_id
        ]
        with pytest.raises(Forbidden, match=r"audit: true .* is for reviewers and admins"):
            await m.audit_recall("backups miss a table", fleet.project, k=3)
    async with fleet.client(reviewer) as r:
        audit = await r.audit_recall("backups miss a table", fleet.project, k=3)
    assert [h["artifact_id"] for h in audit.hits] == [artifact_id]
    counts = fleet.node.services[RECALL].counts
    assert (counts.forbidden, counts.answered) == (2, 2)


async def test_repairs_reindexing_erasing_and_scrubbing_are_refused_to_a_non_admin_and_change_nothing(
    fleet: Fleet,
) -> None:
    node = fleet.node
    assert node.store is not None
    assert node.mirror is not None
    member = await fleet.agent("member", [Role.agent], [fleet.project])
    operator = await fleet.operator()
    admin = node_key(fleet.home)
    text = f"the vault under the old mill opens with the code {uuid.uuid4().hex}"
    cache = fleet.home / "embed-cache.db"

    def cached() -> int:  # read by another connection than the cache's own
        with sqlite3.connect(f"file:{cache}?mode=ro", uri=True) as db:
            key = text_key(node.embedder.model_id if node.embedder else "", text)
            return int(db.execute("SELECT count(*) FROM vectors WHERE key = ?", (key,)).fetchone()[0])

    try:
        async with fleet.client(member) as m:
            artifact_id, event_id, seq = await claim(fleet, m, text)
            point = point_id(uuid.UUID(event_id))
            await node.store.delete([point])  # a mirror point gone missing: what a repair or a reindex puts back
            mirror_name = node.mirror.name
            with pytest.raises(Forbidden, match="repair: true is for admins"):
                await m.verify_nodes(fleet.project, repair=True)
            with pytest.raises(Forbidden, match=r"project: null .* is for admins"):
                await m.verify_nodes(None)
            with pytest.raises(Forbidden, match="only an admin may"):
                await m.reindex_nodes()
            assert await node.store.retrieve([point]) == []  # neither repaired nor reindexed
            assert node.mirror.name == mirror_name
            (verified,) = await ask_verify(operator, admin, fleet.project)
            assert (verified["mirror"]["missing"], verified["journal"]["clean"]) == (1, True)

            with pytest.raises(Forbidden, match="only an admin may"):  # `forgotten` is published, the erase refused
                await m.forget(fleet.project, artifact_id, reason="personal data")
            fingerprints = content_fingerprints([text])
            report = ForgetReport(fleet.project, artifact_id, "", [(seq, event_id)], fingerprints, [text])
            with pytest.raises(Forbidden, match="scrub: true is for admins"):
                await m.prove_forgotten(report, scrub=True)
            looked = await m.prove_forgotten(report, scrub=False)  # a member may look
            assert "error" not in looked.nodes["node-a"]
        kept = await operator.jetstream().get_msg(STREAM, seq)  # the stream still holds the claim's bytes
        assert text.encode() in (kept.data or b"")
        assert cached() == 1

        # An admin may: its `forget` finds the artifact forgotten but not erased, and finishes the erase.
        root = await fleet.agent("root", [Role.agent, Role.admin], ["*"])
        async with fleet.client(root) as r:
            finished = await r.forget(fleet.project, artifact_id, reason="personal data")
            assert finished.messages == [(seq, event_id)]
            with pytest.raises(nats.js.errors.NotFoundError):
                await operator.jetstream().get_msg(STREAM, seq)
            await r.prove_forgotten(finished, scrub=True)
        assert cached() == 0
    finally:
        await operator.close()
    forbidden = {s: node.services[s].counts.forbidden for s in (VERIFY, REINDEX, FORGET_ERASE, PROVE_FORGOTTEN)}
    assert forbidden == {VERIFY: 2, REINDEX: 1, FORGET_ERASE: 1, PROVE_FORGOTTEN: 1}


async def test_a_reply_subject_that_is_not_the_signers_inbox_is_refused_or_never_published_to(fleet: Fleet) -> None:
    admin = await fleet.agent("root", [Role.admin], ["*"])
    bystander = await fleet.agent("bystander", [Role.agent], [fleet.project])
    operator = await fleet.operator()  # may listen anywhere: sees where the node would publish
    body = bodies(fleet.project)[VERIFY]
    try:
        info = await operator.jetstream().stream_info(STREAM)
        elsewhere = f"{inbox_prefix(bystander.public_key)}.{uuid.uuid4().hex}"
        reply = await ask_raw(operator, VERIFY, body, reply=elsewhere, headers=signed(admin, VERIFY, elsewhere, body))
        assert "its reply subject is not an inbox of the signing key" in reply["error"]

        # Reply subjects that are no inbox: the node, which may publish anywhere, publishes nothing there.
        dangerous = [f"$JS.API.STREAM.DELETE.{STREAM}", f"epi.{fleet.project}.finding.x", "_INBOX.plain"]
        watch = await operator.subscribe(">")
        for subject in dangerous:
            await operator.publish(VERIFY, body, reply=subject, headers=signed(admin, VERIFY, subject, body))
        await eventually(lambda: fleet.node.services[VERIFY].counts.unanswerable == len(dangerous))
        await operator.flush()
        seen = []
        while watch.pending_msgs:
            seen.append((await watch.next_msg(timeout=1)).subject)
        await watch.unsubscribe()
        assert set(seen) & set(dangerous) == set()
        after = await operator.jetstream().stream_info(STREAM)
        assert (after.config.name, after.state.messages) == (info.config.name, info.state.messages)
        assert fleet.node.services[VERIFY].counts.answered == 0
    finally:
        await operator.close()


async def test_a_reindex_progress_subject_must_be_an_inbox_of_the_signer(fleet: Fleet) -> None:
    admin = await fleet.agent("root", [Role.admin], ["*"])
    nc = await nats.connect(fleet.node.nats_url, **admin.nats_credentials)
    try:
        for progress in (f"epi.{fleet.project}.finding.x", f"{inbox_prefix(node_key(fleet.home).public_key)}.x"):
            body = json.dumps({"progress": progress}).encode()
            inbox = nc.new_inbox()
            reply = await ask_raw(nc, REINDEX, body, reply=inbox, headers=signed(admin, REINDEX, inbox, body))
            assert "progress must be an inbox of the signing key" in reply["error"]
        assert fleet.node.services[REINDEX].counts.answered == 0
    finally:
        await nc.close()


async def test_a_request_signed_more_than_120_seconds_ago_is_refused(fleet: Fleet) -> None:
    admin = await fleet.agent("root", [Role.admin], ["*"])
    nc = await nats.connect(fleet.node.nats_url, **admin.nats_credentials)
    body = bodies(fleet.project)[VERIFY]
    try:
        inbox = nc.new_inbox()
        stale = await ask_raw(nc, VERIFY, body, reply=inbox, headers=signed(admin, VERIFY, inbox, body, age_s=121))
        assert "not within 120s of now" in stale["error"]
        inbox = nc.new_inbox()
        fresh = await ask_raw(nc, VERIFY, body, reply=inbox, headers=signed(admin, VERIFY, inbox, body, age_s=100))
        assert fresh["clean"] is True
    finally:
        await nc.close()


async def test_a_revoked_signer_is_refused(fleet: Fleet) -> None:
    mallory = await fleet.agent("mallory", [Role.agent], [fleet.project])
    operator = await fleet.operator()  # mallory can no longer connect: her signed request comes through another
    body = bodies(fleet.project)[VERIFY]
    try:
        inbox = f"{inbox_prefix(mallory.public_key)}.{uuid.uuid4().hex}"
        before = await ask_raw(operator, VERIFY, body, reply=inbox, headers=signed(mallory, VERIFY, inbox, body))
        assert before["clean"] is True
        await enrol.revoke(operator, node_key(fleet.home), "mallory")
        inbox = f"{inbox_prefix(mallory.public_key)}.{uuid.uuid4().hex}"
        after = await ask_raw(operator, VERIFY, body, reply=inbox, headers=signed(mallory, VERIFY, inbox, body))
        assert "it was revoked at" in after["error"]
        stranger = AgentKey.generate("stranger")
        inbox = f"{inbox_prefix(stranger.public_key)}.{uuid.uuid4().hex}"
        unknown = await ask_raw(operator, VERIFY, body, reply=inbox, headers=signed(stranger, VERIFY, inbox, body))
        assert "the signing key is not an enrolled agent's" in unknown["error"]
    finally:
        await operator.close()
    assert fleet.node.services[VERIFY].counts.answered == 1
