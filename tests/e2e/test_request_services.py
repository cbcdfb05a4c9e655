"""Every request to a node gets a reply: a hostile body is refused with the field it got wrong, within two
seconds, and the service still answers valid requests after the barrage. A garbage reply from another process
on the bus is reported, never taken for a node's answer. Real nats-server, real nodes, real embedding model."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from pydantic import BaseModel

from bus.client.client import EpibusClient, connect
from bus.errors import Unavailable
from bus.host.server import NatsServer
from bus.model.requests import ForgetProofReply, VerifyReply
from bus.model.vocab import ReceiptLevel
from bus.subjects import JOURNAL_LOOKUP, PROVE_FORGOTTEN, RECALL, REINDEX, VERIFY
from epibus.node.node import Node, NodeConfig
from tests.conftest import finding
from tests.hostile import HostileRequest, hostile_requests
from tests.support import eventually

GARBAGE_REPLIES = [
    b"not json at all",
    b"[1, 2, 3]",
    b"null",
    b'{"node": "impostor", "hits": "all of them"}',
    b'{"node": "impostor-2", "hits": [{"event_id": 1, "score": "high"}]}',
    b'{"node": "impostor-3"}',
    b'{"node": 5, "error": ["not", "a", "line"]}',
    json.dumps({"node": "huge", "hits": [], "padding": "x" * 900_000}).encode(),
    b"\xff\xfe\xfd",
]


@pytest.fixture
async def mirrored_node(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Node]:
    config = NodeConfig(
        home=tmp_path / "node-a", nats_url=nats_server.url, name="node-a", journal_url=f"sqlite:///{tmp_path / 'a.db'}"
    )
    async with Node(config) as node:
        yield node


@pytest.fixture
async def raw(nats_server: NatsServer) -> AsyncIterator[NatsClient]:
    """A plain nats-py connection: what any process on the bus can send."""
    nc = await nats.connect(nats_server.url)
    try:
        yield nc
    finally:
        await nc.close()


async def refusals(nc: NatsClient, subject: str, bodies: list[HostileRequest]) -> dict[str, str]:
    """Send each body raw; return, per body, what was wrong with the reply (nothing when it was a refusal
    naming the expected field). A missing reply fails with nats' timeout after 2 s."""
    wrong: dict[str, str] = {}
    for hostile in bodies:
        reply = json.loads((await nc.request(subject, hostile.body, timeout=2)).data)
        error = reply.get("error", "")
        if set(reply) != {"node", "error"} or not re.match(rf"{re.escape(hostile.field)}(=| is missing)", error):
            wrong[hostile.name] = f"expected an error naming {hostile.field!r}, got {reply}"
    return wrong


@pytest.mark.parametrize("subject", [VERIFY, PROVE_FORGOTTEN, REINDEX, JOURNAL_LOOKUP])
async def test_every_hostile_request_gets_a_reply_naming_the_field_it_got_wrong(
    node: Node, raw: NatsClient, subject: str
) -> None:
    bodies = hostile_requests(subject)
    assert await refusals(raw, subject, bodies) == {}
    counts = node.services[subject].counts
    assert (counts.refused, counts.answered, counts.failed) == (len(bodies), 0, 0)


async def test_recall_refuses_every_hostile_request_and_then_finds_a_published_event(
    mirrored_node: Node, raw: NatsClient, nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    bodies = hostile_requests(RECALL)
    assert await refusals(raw, RECALL, bodies) == {}
    assert mirrored_node.services[RECALL].counts.refused == len(bodies)
    async with connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice:
        event = alice.event("finding", finding(text="the nightly backup skips the largest table"), project=project)
        await alice.publish(event)
        assert mirrored_node.mirror is not None
        await eventually(lambda: mirrored_node.mirror is not None and mirrored_node.mirror.indexed >= 1, timeout_s=30)
        answer = await alice.recall("backups miss the biggest table", project, k=3)
    assert [h["artifact_id"] for h in answer.hits] == [event.artifact_id]
    assert answer.nodes == ["node-a"]
    assert answer.failed_nodes == {}


async def test_verify_and_a_forget_proof_still_answer_after_the_barrage(
    node: Node, raw: NatsClient, client: EpibusClient, project: str
) -> None:
    for subject in (VERIFY, PROVE_FORGOTTEN):
        await refusals(raw, subject, hostile_requests(subject))
    events = [client.event("finding", finding(i), project=project) for i in range(3)]
    await client.publish_many(events, wait_for=ReceiptLevel.journaled)
    (report,) = await client.verify_nodes(project)
    assert VerifyReply.model_validate(report).clean is True
    assert report["stream_events"] == 3
    proof_request = {"project": project, "artifact_id": "never-published", "event_ids": [], "scrub": False}
    reply = await raw.request(PROVE_FORGOTTEN, json.dumps(proof_request).encode(), timeout=5)
    proof = ForgetProofReply.model_validate_json(reply.data)
    assert (proof.node, proof.journal_rows, proof.projection_rows) == (node.name, 0, 0)


async def test_a_request_without_a_reply_subject_is_counted_and_ignored(node: Node, raw: NatsClient) -> None:
    await raw.publish(VERIFY, b"[1]")
    await raw.publish(VERIFY, b'{"project": null}')
    await eventually(lambda: node.services[VERIFY].counts.unanswerable == 2, timeout_s=5)
    assert node.services[VERIFY].counts.answered == 0


async def answer_with_garbage(nc: NatsClient, subject: str) -> asyncio.Event:
    """A process that answers every request on `subject` with each of GARBAGE_REPLIES. The event is set once
    the server has them all: a reply a node sends after that reaches the asker after them."""
    sent = asyncio.Event()

    async def answer(msg: Msg) -> None:
        for garbage in GARBAGE_REPLIES:
            await nc.publish(msg.reply, garbage)
        await reached_server(nc)
        sent.set()

    await nc.subscribe(subject, cb=answer)
    await reached_server(nc)  # the server knows the subscription before anyone asks
    return sent


async def reached_server(nc: NatsClient) -> None:
    """Everything `nc` has sent so far has reached the server. nats-py's flush writes its PING ahead of the
    commands still buffered, so one PONG proves nothing about them (a SUB sent just before could land after
    the request it was meant to catch); the second PING goes out after the first round trip let them out."""
    await nc.flush()
    await nc.flush()


def answer_after(node: Node, subject: str, sent: asyncio.Event) -> None:
    """The node answers `subject` only once the garbage is sent. An asker stops listening when every live node
    has answered, so only garbage that came before is its to report; here that is all of it, whatever the
    scheduling."""
    service = node.services[subject]
    handle = service.handle

    async def after_the_garbage(request: Any) -> BaseModel:
        await asyncio.wait_for(sent.wait(), timeout=5)
        answer: BaseModel = await handle(request)
        return answer

    service.handle = after_the_garbage


async def test_verify_uses_the_real_answer_and_lists_every_garbage_reply_as_failed(
    node: Node, raw: NatsClient, client: EpibusClient, project: str
) -> None:
    answer_after(node, VERIFY, await answer_with_garbage(raw, VERIFY))
    answers = await client.verify_nodes(project, timeout_s=5)
    real = [a for a in answers if "error" not in a]
    failed = [a for a in answers if "error" in a]
    assert [a["node"] for a in real] == [node.name]
    assert real[0]["clean"] is True
    assert len(failed) == len(GARBAGE_REPLIES)
    assert all(a["error"].startswith("malformed reply: ") for a in failed), failed


async def test_verify_with_only_garbage_replies_is_unavailable_and_names_them(
    nats_server: NatsServer, raw: NatsClient, client: EpibusClient, project: str
) -> None:
    await answer_with_garbage(raw, VERIFY)
    with pytest.raises(Unavailable, match=r"no node answered.*malformed reply"):
        await client.verify_nodes(project, timeout_s=2)


async def test_recall_uses_the_real_answer_and_reports_the_garbage_in_failed_nodes(
    mirrored_node: Node, raw: NatsClient, nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    async with connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice:
        event = alice.event("finding", finding(text="the cache is flushed on every deploy"), project=project)
        await alice.publish(event)
        assert mirrored_node.mirror is not None
        await eventually(lambda: mirrored_node.mirror is not None and mirrored_node.mirror.indexed >= 1, timeout_s=30)
        answer_after(mirrored_node, RECALL, await answer_with_garbage(raw, RECALL))
        answer = await alice.recall("deploys empty the cache", project, k=3)
    assert answer.nodes == ["node-a"]
    assert [h["artifact_id"] for h in answer.hits] == [event.artifact_id]
    assert [h["answered_by"] for h in answer.hits] == ["node-a"]
    malformed = {origin: why for origin, why in answer.failed_nodes.items() if why.startswith("malformed reply: ")}
    assert len(malformed) == len(GARBAGE_REPLIES) == len(answer.failed_nodes), answer.failed_nodes
    assert {"impostor", "impostor-2", "impostor-3"} <= set(malformed)


async def test_a_garbage_journal_lookup_reply_is_a_reason_not_a_crash(
    nats_server: NatsServer, raw: NatsClient, client: EpibusClient, project: str
) -> None:
    await answer_with_garbage(raw, JOURNAL_LOOKUP)
    event = client.event("finding", finding(), project=project)
    with pytest.raises(Unavailable, match="malformed journal lookup reply"):
        await client.wait_journaled([event.event_id], timeout_s=1)
