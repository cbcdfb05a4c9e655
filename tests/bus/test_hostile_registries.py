"""Hostile records in the bus's own buckets: an unreadable agent key makes that agent's events fail admission
(dead-lettered with a reason), a malformed tombstone is ignored with a count. Neither stops a node or a
publish."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import nats
import pytest

from bus.broker.streams import ensure_streams
from bus.client.client import connect
from bus.enrolment.registry import AgentRegistry
from bus.errors import MalformedRecord
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey
from bus.model.auth import first_use_enrolment
from bus.model.records import decode_agent_key
from bus.model.tombstones import decode_tombstone_key
from bus.subjects import AGENT_KEYS_BUCKET, TOMBSTONES_BUCKET
from epibus.node.node import Node
from tests.conftest import finding
from tests.e2e.test_one_truth import dlq_reasons, publish_raw, signed
from tests.hostile import Hostile, hostile_payloads, put_raw
from tests.support import eventually, journal_event_ids

HASH = "0123456789abcdef" * 4


@pytest.mark.parametrize("hostile", hostile_payloads(), ids=[h.name for h in hostile_payloads()])
def test_every_hostile_agent_key_record_decodes_to_a_malformed_record(hostile: Hostile) -> None:
    with pytest.raises(MalformedRecord) as caught:
        decode_agent_key(hostile.value, key="mallory", revision=4)
    assert (caught.value.bucket, caught.value.key, caught.value.revision) == (AGENT_KEYS_BUCKET, "mallory", 4)


def test_a_well_formed_agent_key_decodes() -> None:
    key = AgentKey.generate("alice")
    assert decode_agent_key(key.public_key.encode(), key="alice", revision=1) == key.public_key


@pytest.mark.parametrize(
    "subject",
    [
        f"$KV.{TOMBSTONES_BUCKET}.p.not-a-hash",
        f"$KV.{TOMBSTONES_BUCKET}.p.{HASH.upper()}",
        f"$KV.{TOMBSTONES_BUCKET}.p.x.{HASH}",
        f"$KV.{TOMBSTONES_BUCKET}.other.{HASH}",
        "$KV.elsewhere.p." + HASH,
    ],
)
def test_a_tombstone_key_of_the_wrong_shape_is_malformed(subject: str) -> None:
    with pytest.raises(MalformedRecord):
        decode_tombstone_key(subject, project="p")


def test_a_tombstone_key_decodes_to_its_content_hash() -> None:
    assert decode_tombstone_key(f"$KV.{TOMBSTONES_BUCKET}.p.{HASH}", project="p") == HASH


async def test_an_unreadable_agent_key_dead_letters_that_agents_events_and_the_node_goes_on(
    node: Node, nats_server: NatsServer, project: str, sqlite_journal_url: str
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        alice = AgentKey.generate("alice")
        await AgentRegistry(js).bind(alice.actor)  # the bucket exists, alice's key is bound
        forged: list[str] = []
        for i, hostile in enumerate(hostile_payloads()):
            mallory = AgentKey.generate(f"mallory-{i}")
            await put_raw(js, AGENT_KEYS_BUCKET, mallory.agent_id, hostile.value)
            event = signed(mallory, "finding", finding(i), project)
            await publish_raw(js, event)
            forged.append(str(event.event_id))
        good = signed(alice, "finding", finding(99), project)
        await publish_raw(js, good)

        await eventually(lambda: str(good.event_id) in journal_event_ids(sqlite_journal_url, project), timeout_s=20)

        async def dead() -> list[tuple[str, str]]:
            found = [r for r in await dlq_reasons(js) if f".{project}." in r[1]]
            return found if len(found) == len(forged) else []

        assert {reason for reason, _ in await eventually(dead, timeout_s=20)} == {"unknown_actor_key"}
        assert not set(forged) & set(journal_event_ids(sqlite_journal_url, project))
        assert node.runner is not None
        assert node.runner.admission.registry.quarantine.count == len(forged)
    finally:
        await nc.close()


async def test_a_hostile_tombstone_record_never_refuses_or_crashes_a_publish(
    node: Node, nats_server: NatsServer, project: str, sqlite_journal_url: str, home: Path
) -> None:
    async with connect(nats_server.url, agent="alice", home=home, outbox=False) as client:
        registry = client.tombstones
        assert await registry.hashes(project) == set()  # makes the bucket
        keys = [f"{project}.not-a-hash", f"{project}.{HASH.upper()}", f"{project}.x.{HASH}"]
        for key, hostile in zip(keys, hostile_payloads(), strict=False):
            await put_raw(client.js, TOMBSTONES_BUCKET, key, hostile.value)
        event = client.event("finding", finding(1), project=project)
        receipt = await client.publish(event, strict=True)
        assert receipt.stream_seq is not None
        await eventually(lambda: str(event.event_id) in journal_event_ids(sqlite_journal_url, project), timeout_s=20)
        assert await registry.hashes(project) == set()
        assert registry.quarantine.count == len(keys)


async def test_every_enrolment_is_listed_while_the_registry_is_being_written(nats_server: NatsServer) -> None:
    """The node renders its server's users from this list: an agent missing from it would be disconnected."""
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        registry = AgentRegistry(js)
        now = datetime.now(UTC)
        names = [f"agent{i}" for i in range(5)]
        for name in names:
            await registry.enrol(first_use_enrolment(name, AgentKey.generate(name).public_key, enrolled_at=now))
        writing = True

        async def churn() -> None:  # other agents enrolled meanwhile
            i = 0
            while writing:
                key = AgentKey.generate(f"churn{i % 7}").public_key
                await registry.enrol(first_use_enrolment(f"churn{i % 7}", key, enrolled_at=now), replace_key=True)
                i += 1

        writer = asyncio.create_task(churn())
        try:
            short = [len(listed) for listed in [await registry.enrolments() for _ in range(300)]]
        finally:
            writing = False
            await writer
        assert [n for n in short if n < len(names)] == []
        listed = {e.agent_id for e in await registry.enrolments()}
        assert set(names) | {f"churn{i}" for i in range(7)} == listed
    finally:
        await nc.close()
