"""An enrolled agent's seat: what it can read outside its projects through consumers, and how many it can hold.
Mallory is enrolled in her own project only; Bob in his. Every attempt below was possible before agents' reads
went through consumers a node opens for them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bus.broker.ask import ask_one
from bus.broker.loops import stop_all
from bus.client import enrol
from bus.client.client import EpibusClient, connect
from bus.errors import Forbidden, InvalidEvent, LimitReached
from bus.identity.signing import AgentKey, node_key
from bus.intake.consumers import drop_consumer, pull_consumer
from bus.intake.follow import StreamFollower, resume_config
from bus.intake.stream_read import last_matching, last_sequence
from bus.model.requests import (
    ConsumerOpenReply,
    ConsumerOpenRequest,
    TombstoneCheckReply,
    TombstoneCheckRequest,
    build_request,
)
from bus.model.tombstones import Tombstone, content_hash
from bus.model.vocab import Role
from bus.services.tombstone_registry import TombstoneRegistry
from bus.subjects import (
    CONSUMER_OPEN,
    MESH_BUCKET,
    MESH_STREAM,
    STREAM,
    TOMBSTONE_CHECK,
    TOMBSTONES_BUCKET,
    agent_consumer_name,
    events_filter,
    js_api,
    kv_stream,
    kv_subject,
)
from epibus.node.node import Node, NodeConfig
from tests.conftest import finding
from tests.security.test_broker import Violations
from tests.support import enrol_agent, eventually, operator_credentials

SLOTS = 3


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    async with Node(NodeConfig(home=tmp_path / "home", mirror="off", agent_consumers=SLOTS)) as running:
        assert running.authenticated
        yield running


@contextlib.asynccontextmanager
async def agent(node: Node, name: str, project: str) -> AsyncIterator[EpibusClient]:
    home = node.config.home
    await enrol_agent(node.nats_url, home, AgentKey.load_or_create(home, name), roles=[Role.agent], projects=[project])
    async with connect(node.nats_url, agent=name, home=home, outbox=False) as client:
        assert client.enrolment is not None
        assert client.enrolment.projects == (project,)
        yield client


async def raw(node: Node, key: AgentKey, violations: Violations) -> NatsClient:
    return await nats.connect(
        node.nats_url,
        error_cb=violations.record,
        allow_reconnect=False,
        **key.nats_credentials,  # with the inbox prefix the broker lets it subscribe to
    )


async def refused(violations: Violations, subject: str, attempt: asyncio.Future[object] | object) -> None:
    with contextlib.suppress(nats.errors.TimeoutError, TimeoutError, nats.errors.NoRespondersError):
        await attempt  # type: ignore[misc]
    await eventually(functools.partial(violations.about, subject), timeout_s=5)


async def test_another_projects_consumer_cannot_be_pulled_and_its_tail_still_sees_every_event(
    node: Node, project: str
) -> None:
    theirs, mine = project, f"{project}-m"
    async with agent(node, "bob", theirs) as bob, agent(node, "mallory", mine) as mallory:
        follower = StreamFollower(bob.js, STREAM, events_filter(theirs), start_seq=1, closed=lambda: False)
        seen: list[str] = []

        async def tail() -> None:
            async for msg in follower.messages():
                seen.append(json.loads(msg.data)["event_id"])

        tailing = asyncio.create_task(tail())
        sent = [str((await bob.publish(bob.event("finding", finding(i), project=theirs))).event_id) for i in range(5)]
        await eventually(lambda: len(seen) == 5)
        bobs = agent_consumer_name(bob.key.public_key, 0)
        violations = Violations()
        nc = await raw(node, mallory.key, violations)
        pull = js_api("CONSUMER.MSG.NEXT", STREAM, bobs)
        inbox = f"_INBOX_{mallory.key.public_key}.x"
        await refused(violations, pull, nc.publish(pull, b'{"batch": 10}', reply=inbox))
        info = js_api("CONSUMER.INFO", STREAM, bobs)
        await refused(violations, info, nc.request(info, b"", timeout=2))
        await nc.close()
        more = [
            str((await bob.publish(bob.event("finding", finding(i), project=theirs))).event_id) for i in range(5, 8)
        ]
        await eventually(lambda: len(seen) == 8)
        await stop_all([tailing])
    assert seen == sent + more


async def test_a_node_opens_no_consumer_outside_the_askers_projects_nor_for_another_key(
    node: Node, project: str
) -> None:
    async with agent(node, "bob", project) as bob, agent(node, "mallory", f"{project}-m") as mallory:
        with pytest.raises(Forbidden, match=rf"project {project}: only its members may"):
            await pull_consumer(mallory.js, STREAM, resume_config(events_filter(project), 0))
        with pytest.raises(Forbidden, match=r"project \*: only its members may"):
            await pull_consumer(mallory.js, STREAM, resume_config("epi.*.>", 0))
        with pytest.raises(Forbidden, match="is no filter of a project"):
            await pull_consumer(mallory.js, STREAM, resume_config(f"epi.{project}-m.a.b.c", 0))
        for_bob = build_request(
            ConsumerOpenRequest, owner_key=bob.key.public_key, stream=STREAM, filter_subject=events_filter(project)
        )
        with pytest.raises(Forbidden, match="owner_key must be the signing key"):
            await ask_one(mallory.js._nc, CONSUMER_OPEN, for_bob, ConsumerOpenReply, signer=mallory.key, timeout_s=5)
        with pytest.raises(Forbidden, match="only its members may"):
            await pull_consumer(mallory.js, MESH_STREAM, resume_config(f"$KV.epibus_mesh.task.{project}.*", 0))
    async with await nats.connect(node.nats_url, **operator_credentials(node.config.home)) as operator:
        names = [c.name for c in await operator.jetstream().consumers_info(STREAM)]
    assert not [n for n in names if n.startswith(agent_consumer_name(mallory.key.public_key, 0)[:-1])]


async def test_an_agent_cannot_create_a_consumer_push_or_pull_at_the_broker(node: Node, project: str) -> None:
    async with agent(node, "mallory", project) as mallory:
        violations = Violations()
        nc = await raw(node, mallory.key, violations)
        js = nc.jetstream(timeout=2)
        mine = agent_consumer_name(mallory.key.public_key, 0)
        for deliver in ("epidlq.stolen", "$KV.epibus_agents.mallory", f"_INBOX_{mallory.key.public_key}.push"):
            config = ConsumerConfig(name=mine, deliver_subject=deliver, filter_subject=events_filter(project))
            await refused(violations, js_api("CONSUMER.CREATE", STREAM, mine), js.add_consumer(STREAM, config))
        pull = ConsumerConfig(name=mine, ack_policy=AckPolicy.NONE, filter_subject=events_filter(project))
        await refused(violations, js_api("CONSUMER.CREATE", STREAM, mine), js.add_consumer(STREAM, pull))
        durable = ConsumerConfig(durable_name="mine", filter_subject=events_filter(project))
        await refused(violations, js_api("CONSUMER.CREATE", STREAM), js.add_consumer(STREAM, durable))
        await nc.close()
    async with await nats.connect(node.nats_url, **operator_credentials(node.config.home)) as operator:
        consumers = await operator.jetstream().consumers_info(STREAM)
    assert [c.name for c in consumers if c.config.deliver_subject] == []


async def test_the_nodes_mesh_and_event_consumers_cannot_be_drained(node: Node, project: str) -> None:
    async with await nats.connect(node.nats_url, **operator_credentials(node.config.home)) as operator:
        js = operator.jetstream()

        async def node_consumers() -> dict[str, list[str]] | None:
            found = {stream: [c.name for c in await js.consumers_info(stream)] for stream in (STREAM, MESH_STREAM)}
            return found if all(found.values()) else None  # the journal's durable, the mesh recorder's watcher

        durables = await eventually(node_consumers)
    async with agent(node, "mallory", project) as mallory:
        violations = Violations()
        nc = await raw(node, mallory.key, violations)
        for stream, names in durables.items():
            for name in names:
                pull = js_api("CONSUMER.MSG.NEXT", stream, name)
                await refused(
                    violations, pull, nc.publish(pull, b'{"batch": 10}', reply=f"_INBOX_{mallory.key.public_key}.d")
                )
        await nc.close()
    async with await nats.connect(node.nats_url, **operator_credentials(node.config.home)) as operator:
        after = {c.name: c.num_waiting for c in await operator.jetstream().consumers_info(MESH_STREAM)}
    assert set(after) >= set(durables[MESH_STREAM])


async def test_an_agent_holds_at_most_its_slots_and_a_dropped_consumer_frees_one(node: Node, project: str) -> None:
    async with agent(node, "alice", project) as alice:
        config = resume_config(events_filter(project), 0)
        held = [await pull_consumer(alice.js, STREAM, config) for _ in range(SLOTS)]
        with pytest.raises(LimitReached, match=rf"limit agent consumers \({SLOTS}\) reached.*--agent-consumers"):
            await pull_consumer(alice.js, STREAM, config)
        assert node.consumer_slots is not None
        assert node.consumer_slots.counts.full == 1
        await drop_consumer(alice.js, held[0])
        again = await pull_consumer(alice.js, STREAM, config)
        names = {s._consumer for s in [*held[1:], again]}
        assert names == {agent_consumer_name(alice.key.public_key, slot) for slot in range(SLOTS)}
        config_back = (await alice.js.consumer_info(STREAM, again._consumer)).config
        assert config_back.deliver_subject is None
        assert config_back.ack_policy == AckPolicy.NONE
        assert config_back.deliver_policy == DeliverPolicy.BY_START_SEQUENCE


async def test_refusals_name_the_agent_and_what_to_do_as_soon_as_the_broker_refuses(
    node: Node, project: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the call's own deadline is ten minutes: the refusal must come from the broker's answer, not the deadline
    monkeypatch.setattr("bus.intake.stream_read.READ_TIMEOUT_S", 600.0)
    async with agent(node, "mallory", project) as mallory:
        with pytest.raises(
            Forbidden, match=r"agent 'mallory' may not use \$JS.API.STREAM.INFO.EPI: the broker refused"
        ):
            async with asyncio.timeout(60):
                await last_sequence(mallory.js, STREAM)  # what `replay` and `dlq replay` read first: a whole stream
        other = events_filter(f"{project}-x")
        with pytest.raises(Forbidden, match=rf"may not use \$JS.API.DIRECT.GET.EPI.{other}: the broker refused"):
            async with asyncio.timeout(60):
                await last_matching(mallory.js, STREAM, other)
    home = node.config.home
    async with await nats.connect(node.nats_url, **operator_credentials(home)) as operator:
        await enrol.revoke(operator, node_key(home), "mallory")
    with pytest.raises(Forbidden, match=r"its enrolment was revoked at .*only an admin can enrol it again"):
        async with connect(node.nats_url, agent="mallory", home=home, outbox=False):
            pass


async def test_bucket_keys_naming_other_projects_are_not_listed_and_tombstones_are_checked_through_a_node(
    node: Node, project: str
) -> None:
    theirs, mine = project, f"{project}-m"
    retracted = finding(1)
    async with agent(node, "bob", theirs) as bob, agent(node, "mallory", mine) as mallory:
        async with await nats.connect(node.nats_url, **operator_credentials(node.config.home)) as operator:
            tombstone = Tombstone(content_hash(retracted["text"]), "a1", "e1", "retracted")
            await TombstoneRegistry(operator.jetstream()).record(theirs, tombstone)
        # listing a bucket's keys (stream info with a subjects filter) is refused on every bucket keyed by project
        violations = Violations()
        nc = await raw(node, mallory.key, violations)
        js = nc.jetstream(timeout=2)
        for bucket in (TOMBSTONES_BUCKET, MESH_BUCKET):
            listing = js.stream_info(kv_stream(bucket), subjects_filter=kv_subject(bucket, ">"))
            await refused(violations, js_api("STREAM.INFO", kv_stream(bucket)), listing)
        await nc.close()
        # a member's claim is checked by a node before it is published: a repeat of the retracted one is refused
        with pytest.raises(InvalidEvent, match="repeats a claim that was retracted"):
            await bob.publish(bob.event("finding", retracted, project=theirs), strict=True)
        fresh = await bob.publish(bob.event("finding", finding(2), project=theirs), strict=True)
        assert fresh.flags == ()
        # and nobody else may ask about that project's tombstones, even with the text in hand
        ask = TombstoneCheckRequest(project=theirs, hashes=[tombstone.content_hash])
        with pytest.raises(Forbidden, match=rf"project {theirs}: only its members may"):
            await ask_one(mallory.js._nc, TOMBSTONE_CHECK, ask, TombstoneCheckReply, signer=mallory.key, timeout_s=5)
        assert await mallory.tombstones.tombstoned(mine, {tombstone.content_hash}) == set()
