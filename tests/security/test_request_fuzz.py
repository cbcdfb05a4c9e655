"""Generated hostile requests to every request service of a node that authenticates: random and hostile bodies,
missing, forged, stale, future and mangled signatures, random headers, reply subjects that are the signer's
inbox, someone else's, or no inbox at all (a stream's delete API, an event subject). Every request whose reply
subject is an inbox gets exactly one reply, an error unless the request was valid and allowed; a reply subject
that is no inbox is never published to (counted instead); and afterwards every service still answers a valid
signed request."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from bus.client import enrol
from bus.client.client import connect
from bus.client.fleet import ask_rebuild_journal
from bus.identity.signing import AgentKey, node_key
from bus.model.auth import inbox_prefix
from bus.model.requests import ErrorReply, LookupReply, LookupRequest
from bus.model.vocab import ReceiptLevel, Role
from bus.subjects import (
    AGENT_KEYS_BUCKET,
    ENROL,
    FORGET_ERASE,
    JOURNAL_LOOKUP,
    JOURNAL_REBUILD,
    LIST_AGENTS,
    MESH_ADVERTISE,
    MESH_ROSTER,
    MESH_STEP,
    PROVE_FORGOTTEN,
    RECALL,
    REINDEX,
    REVOKE,
    SIGNATURE_HEADER,
    SIGNED_AT_HEADER,
    SIGNER_HEADER,
    SIGNER_KEY_HEADER,
    STREAM,
    VERIFY,
)
from epibus.node.node import Node, NodeConfig
from tests.conftest import finding
from tests.hostile import hostile_requests
from tests.support import enrol_agent, eventually, eventually_sync

T = TypeVar("T")
EXAMPLES = 220  # batches of 10 to 60 requests: a few thousand in all
MESH_SERVICES = [MESH_STEP, MESH_ROSTER, MESH_ADVERTISE]  # no valid body is generated for these: always refused
SERVICES = [
    RECALL, VERIFY, REINDEX, PROVE_FORGOTTEN, FORGET_ERASE, JOURNAL_LOOKUP, ENROL, REVOKE, LIST_AGENTS,
    JOURNAL_REBUILD, *MESH_SERVICES
]  # fmt: skip
HOSTILE_BODIES = {  # the shared hostile bodies, without the near-max_payload ones (slow, and covered elsewhere)
    s: [h.body for h in hostile_requests(s) if len(h.body) < 65536]
    for s in (RECALL, VERIFY, REINDEX, PROVE_FORGOTTEN, JOURNAL_LOOKUP)
}


class NodeThread:
    """A node running in its own event loop on a thread, so that every generated example can use asyncio.run."""

    def __init__(self, config: NodeConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="node", daemon=True)
        self.node = Node(config)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def __enter__(self) -> Node:
        self.thread.start()
        self.run(self.node.__aenter__())
        return self.node

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.run(self.node.__aexit__(None, None, None))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
            self.loop.close()


@dataclass(frozen=True)
class Keys:
    fuzzer: AgentKey  # an agent of one project no request names: allowed the journal lookup only
    bystander: AgentKey  # someone else whose inbox a hostile reply names
    revoked: AgentKey
    stranger: AgentKey  # never enrolled
    keeper: AgentKey  # an admin of every project: the valid requests at the end


@dataclass(frozen=True)
class Fuzzed:
    subject: str
    body: bytes
    headers: dict[str, str] | None
    reply: str
    inbox: bool  # the reply subject is an identity's inbox: the node must answer there
    allowed: bool  # valid and allowed: the answer is the service's, not an error


@dataclass
class Bed:
    node: Node
    home: Path
    project: str
    keys: Keys
    sent: int = 0
    ignored: int = 0  # requests sent with a reply subject that is no inbox


@pytest.fixture
def bed(tmp_path: Path, project: str) -> Iterator[Bed]:
    home = tmp_path / "home"
    with NodeThread(NodeConfig(home=home, name="node-f")) as node:
        keys = Keys(
            fuzzer=AgentKey.load_or_create(tmp_path / "fuzzer", "fuzzer"),
            bystander=AgentKey.load_or_create(tmp_path / "bystander", "bystander"),
            revoked=AgentKey.load_or_create(tmp_path / "revoked", "revoked"),
            stranger=AgentKey.generate("stranger"),
            keeper=AgentKey.load_or_create(tmp_path / "keeper", "keeper"),
        )

        async def enrol_all() -> None:
            only = f"only-{uuid.uuid4().hex[:8]}"
            await enrol_agent(node.nats_url, home, keys.fuzzer, roles=[Role.agent], projects=[only])
            await enrol_agent(node.nats_url, home, keys.bystander, roles=[Role.agent], projects=[project])
            await enrol_agent(node.nats_url, home, keys.revoked, roles=[Role.agent, Role.admin], projects=["*"])
            await enrol_agent(node.nats_url, home, keys.keeper, roles=[Role.agent, Role.admin], projects=["*"])
            operator = await nats.connect(node.nats_url, **node_key(home).nats_credentials)
            await enrol.revoke(operator, node_key(home), keys.revoked.agent_id)
            await operator.close()

        asyncio.run(enrol_all())
        yield Bed(node, home, project, keys)


def valid_body(subject: str, project: str) -> bytes:
    bodies: dict[str, Any] = {
        RECALL: {"query": "backups", "project": project, "k": 3},
        VERIFY: {"project": project, "repair": True},
        REINDEX: {"progress": None},
        PROVE_FORGOTTEN: {"project": project, "artifact_id": "a1", "event_ids": [], "scrub": True},
        FORGET_ERASE: {"project": project, "artifact_id": "a1"},
        JOURNAL_LOOKUP: [str(uuid.uuid4())],
        ENROL: {"agent_id": "intruder", "public_key": AgentKey.generate("x").public_key, "projects": ["*"]},
        REVOKE: {"agent_id": "keeper"},
        LIST_AGENTS: {},
        JOURNAL_REBUILD: {"node": "another-node"},  # valid and allowed for an admin, and names no node here
    }
    return json.dumps(bodies.get(subject, {})).encode()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
# Header names nats-py sends (it refuses others before they leave); values: any text it can encode.
header_name = st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20)
header_text = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=20)
MUTATIONS = [
    "intact", "unsigned", "stale", "future", "bad-signature", "other-key", "other-agent", "garbage-stamp",
    "header-missing", "other-body", "other-subject", "random-headers",
]  # fmt: skip
REPLIES = ["own"] * 6 + ["bystander"] * 2 + ["operator"] + [
    "plain-inbox", "no-token", "wildcard", "stream-delete", "stream-purge", "event-subject", "registry",
]  # fmt: skip


@st.composite
def requests(draw: st.DrawFn, bed: Bed) -> Fuzzed:
    keys = bed.keys
    subject = draw(st.sampled_from(SERVICES))
    body = draw(
        st.one_of(
            st.just(valid_body(subject, bed.project)),
            st.sampled_from(HOSTILE_BODIES.get(subject, [b"{}"])),
            json_values.map(lambda v: json.dumps(v).encode()),
            st.binary(max_size=300),
        )
    )
    signer = draw(st.sampled_from([keys.fuzzer, keys.fuzzer, keys.revoked, keys.stranger]))
    own = f"{inbox_prefix(signer.public_key)}.{uuid.uuid4().hex}"
    replies = {
        "own": own,
        "bystander": f"{inbox_prefix(keys.bystander.public_key)}.{uuid.uuid4().hex}",
        "operator": f"{inbox_prefix(node_key(bed.home).public_key)}.{uuid.uuid4().hex}",
        "plain-inbox": f"_INBOX.{uuid.uuid4().hex}",
        "no-token": inbox_prefix(signer.public_key),
        "wildcard": f"{inbox_prefix(signer.public_key)}.>",
        "stream-delete": f"$JS.API.STREAM.DELETE.{STREAM}",
        "stream-purge": f"$JS.API.STREAM.PURGE.{STREAM}",
        "event-subject": f"epi.{bed.project}.finding.fuzz",
        "registry": f"$KV.{AGENT_KEYS_BUCKET}.keeper",
    }
    which = draw(st.sampled_from(REPLIES))
    reply = replies[which]
    mutation = draw(st.sampled_from(MUTATIONS))
    headers = sign(signer, subject, reply, body, mutation, draw, keys)
    if draw(st.booleans()) and headers is not None:  # extra headers change nothing
        headers |= draw(st.dictionaries(header_name.map(lambda k: f"X-{k}"), header_text, max_size=3))
    inbox = which in ("own", "bystander", "operator")
    allowed = (
        subject == JOURNAL_LOOKUP
        and signer is keys.fuzzer
        and mutation == "intact"
        and which == "own"
        and _is_lookup(body)
    )
    return Fuzzed(subject, body, headers, reply, inbox, allowed)


def sign(
    signer: AgentKey, subject: str, reply: str, body: bytes, mutation: str, draw: st.DrawFn, keys: Keys
) -> dict[str, str] | None:
    now = datetime.now(UTC)
    if mutation == "unsigned":
        return None
    if mutation == "random-headers":
        return draw(st.dictionaries(header_name, header_text, max_size=5))
    at = {"stale": now - timedelta(seconds=121), "future": now + timedelta(seconds=200)}.get(mutation, now)
    headers = signer.sign_request(
        subject + (".x" if mutation == "other-subject" else ""),
        reply,
        body + (b" " if mutation == "other-body" else b""),
        signed_at=at,
    )
    if mutation == "bad-signature":
        signature = headers[SIGNATURE_HEADER]
        headers[SIGNATURE_HEADER] = ("A" if signature[0] != "A" else "B") + signature[1:]
    elif mutation == "other-key":
        headers[SIGNER_KEY_HEADER] = keys.bystander.public_key
    elif mutation == "other-agent":
        headers[SIGNER_HEADER] = keys.keeper.agent_id
    elif mutation == "garbage-stamp":
        headers[SIGNED_AT_HEADER] = draw(header_text)
    elif mutation == "header-missing":
        del headers[draw(st.sampled_from(sorted(headers)))]
    return headers


def _is_lookup(body: bytes) -> bool:
    try:
        LookupRequest.model_validate_json(body)
    except ValidationError:
        return False
    return True


async def fire(bed: Bed, batch: list[Fuzzed]) -> list[str]:
    """Send the batch as one process with every permission would (so the broker refuses nothing on the way),
    and read the reply to each request whose reply subject is an inbox. Returns what was wrong."""
    wrong: list[str] = []
    nc = await nats.connect(bed.node.nats_url, **node_key(bed.home).nats_credentials)
    try:
        subs = {i: await nc.subscribe(r.reply) for i, r in enumerate(batch) if r.inbox}
        for r in batch:
            await nc.publish(r.subject, r.body, reply=r.reply, headers=r.headers)
        for i, sub in subs.items():
            r = batch[i]
            try:
                data = (await sub.next_msg(timeout=10)).data
            except nats.errors.TimeoutError:
                wrong.append(f"no reply: {r}")
                continue
            model = LookupReply if r.allowed else ErrorReply
            try:
                model.model_validate_json(data)
            except ValidationError:
                wrong.append(f"expected {model.__name__}, got {data[:300]!r} for {r}")
    finally:
        await nc.close()
    return wrong


async def stores(bed: Bed) -> dict[str, Any]:
    nc = await nats.connect(bed.node.nats_url, **node_key(bed.home).nats_credentials)
    try:
        js = nc.jetstream()
        info = await js.stream_info(STREAM)
        agents = await js.stream_info(f"KV_{AGENT_KEYS_BUCKET}", subjects_filter=f"$KV.{AGENT_KEYS_BUCKET}.>")
        return {"stream": (info.config.name, info.state.messages), "agents": agents.state.subjects}
    finally:
        await nc.close()


def ignored(node: Node) -> int:
    return sum(responder.counts.unanswerable for responder in node.services.values())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_generated_request_to_every_service_gets_an_error_reply_and_the_services_still_answer(bed: Bed) -> None:
    before = asyncio.run(stores(bed))

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(requests(bed), min_size=10, max_size=60))
    def example(batch: list[Fuzzed]) -> None:
        assert asyncio.run(fire(bed, batch)) == []
        bed.sent += len(batch)
        bed.ignored += sum(not r.inbox for r in batch)
        eventually_sync(lambda: ignored(bed.node) == bed.ignored)

    example()
    assert bed.sent >= 2000  # about 3,000: hypothesis draws the batch sizes
    assert bed.ignored > 0
    assert asyncio.run(stores(bed)) == before  # no reply subject of an asker's choosing was published to
    asyncio.run(valid_requests_are_answered(bed))


async def valid_requests_are_answered(bed: Bed) -> None:
    """Every service, asked by an admin with a valid signed request, answers with its own reply."""
    keeper, project = bed.keys.keeper, bed.project
    async with connect(bed.node.nats_url, agent="keeper", home=bed.home.parent / "keeper", outbox=False) as client:
        event = client.event("finding", finding(text="the nightly backup skips the largest table"), project=project)
        await client.publish(event, wait_for=ReceiptLevel.journaled, timeout_s=30)  # the journal lookup answers
        await eventually(lambda: bed.node.mirror is not None and bed.node.mirror.indexed >= 1, timeout_s=60)
        assert [h["artifact_id"] for h in (await client.recall("backups miss a table", project)).hits] == [
            event.artifact_id
        ]
        (verified,) = await client.verify_nodes(project, repair=True)
        assert verified["clean"] is True
        (reindexed,) = await client.reindex_nodes()
        assert reindexed["points"] == 1
        report = await client.forget(project, event.artifact_id, reason="fuzz")  # publishes, then the node erases
        assert [seq for seq, _ in report.messages]
        proof = await client.prove_forgotten(report, scrub=True)
        assert "error" not in proof.nodes["node-f"]
        assert client.nc is not None
        listed = await enrol.list_agents(client.nc, keeper)
        rebuilt = await ask_rebuild_journal(client.nc, keeper, "node-f", timeout_s=120)
        assert rebuilt.rebuilt is True
        assert rebuilt.not_restored == 1  # the forgotten claim's row: its message was erased from the stream
    assert {"fuzzer", "keeper"} <= {a["agent_id"] for a in listed}
    answered = {s: bed.node.services[s].counts.answered for s in SERVICES if s not in (ENROL, REVOKE, *MESH_SERVICES)}
    assert all(answered.values()), answered
    # The mesh services refused every generated request, and each still answers one (refusing an empty step).
    for subject in MESH_SERVICES:
        counts = bed.node.services[subject].counts
        assert counts.refused + counts.forbidden > 0, (subject, counts)
        nc = await nats.connect(bed.node.nats_url, **keeper.nats_credentials)
        try:
            inbox = f"{inbox_prefix(keeper.public_key)}.{uuid.uuid4().hex}"
            sub = await nc.subscribe(inbox)
            body = b"{}"
            headers = keeper.sign_request(subject, inbox, body, signed_at=datetime.now(UTC))
            await nc.publish(subject, body, reply=inbox, headers=headers)
            assert "error" in json.loads((await sub.next_msg(timeout=10)).data)
        finally:
            await nc.close()
