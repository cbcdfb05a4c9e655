"""Nothing a publisher sends stops a node: poison messages, huge messages and messages over the limit are
dead-lettered (or refused by the stream) and the node keeps journaling what comes after."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import pytest
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bus.broker.streams import EVENT_MAX_MSG_BYTES, stream_configs
from bus.client.client import connect
from bus.errors import ConfigError
from bus.host.home import read_node_info
from bus.host.server import NatsServer
from bus.intake.reader import dead_letters
from bus.subjects import DLQ_DIGEST, DLQ_REASON, DLQ_SIZE, DLQ_STREAM_SEQ, DLQ_TRUNCATED, STREAM, event_subject
from epibus.monitoring.health import problems, read_health
from epibus.node.node import Node, NodeConfig
from tests.conftest import finding
from tests.support import eventually, headers_of, journal_event_ids

# The size that made the dead-letter copy (message + headers) exceed the server's 1 MiB max payload.
HUGE = 1_048_376


def poison_messages(envelope: dict[str, object]) -> list[bytes]:
    """Each of these once raised out of the runner and stopped the node, again after every restart."""
    far_future = dict(envelope, recorded_at="9999-12-31T23:59:59.999999-23:59")
    return [
        b"[" * 30000 + b"]" * 30000,  # RecursionError in json.loads
        b'{"event_id": 1' + b"0" * 5000 + b"}",  # ValueError: more than 4300 digits
        json.dumps(far_future).encode(),  # OverflowError converting to UTC
    ]


async def test_poison_messages_are_dead_lettered_and_the_node_goes_on(
    node: Node, nats_server: NatsServer, home: Path, project: str
) -> None:
    async with connect(nats_server.url, agent="alice", home=home) as client:
        template = json.loads(client.event("finding", finding(0), project=project).model_dump_json())
        raw = await nats.connect(nats_server.url)
        try:
            for data in poison_messages(template):
                await raw.jetstream().publish(event_subject(project, "finding", "poison"), data)
        finally:
            await raw.close()
        after = client.event("finding", finding(1), project=project)
        await client.publish(after)

        assert node.journal is not None
        journal_url = node.journal.url
        await eventually(lambda: journal_event_ids(journal_url, project) == [str(after.event_id)], timeout_s=20)
        letters = await eventually(lambda: _letters_of(client.js, project, 3), timeout_s=20)
        assert sorted(headers_of(m)[DLQ_REASON] for m in letters) == ["invalid_event"] * 3
        assert not any(task.done() for task in node._tasks), "a node service stopped"
        assert node.runner is not None
        assert node.runner.stats.internal_errors == 0


async def _letters_of(js: JetStreamContext, project: str, count: int) -> list[Msg] | None:
    found = [m for m in await dead_letters(js) if f"epi.{project}." in (m.headers or {}).get("Epibus-Dlq-Subject", "")]
    return found if len(found) >= count else None


async def test_a_message_over_the_event_limit_is_refused_by_the_stream(
    node: Node, nats_server: NatsServer, project: str
) -> None:
    raw = await nats.connect(nats_server.url)
    try:
        js = raw.jetstream()
        before = (await js.stream_info(STREAM)).state.last_seq
        with pytest.raises(nats.js.errors.APIError) as refused:
            await js.publish(event_subject(project, "finding", "x"), b"x" * (EVENT_MAX_MSG_BYTES + 1))
        assert refused.value.err_code == 10054  # message size exceeds maximum allowed
        assert (await js.stream_info(STREAM)).state.last_seq == before
    finally:
        await raw.close()
    assert node.nc is not None
    assert node.nc.is_connected


async def test_a_huge_message_already_in_the_stream_is_dead_lettered_as_digest_and_prefix(
    nats_server: NatsServer, home: Path, sqlite_journal_url: str, project: str
) -> None:
    """A stream an older epibus made before the size limit may hold a message near the server's max payload:
    its dead-letter copy once exceeded the max payload and the server closed the node's connection for good.
    The missing limit is the one setting a node restores without asking (any other drift stops its start)."""
    raw = await nats.connect(nats_server.url)
    huge = b"h" * HUGE
    try:
        js = raw.jetstream()
        await js.add_stream(dataclasses.replace(stream_configs()[0], max_msg_size=-1))
        ack = await js.publish(event_subject(project, "finding", "x"), huge)
    finally:
        await raw.close()
    config = NodeConfig(home=home, nats_url=nats_server.url, journal_url=sqlite_journal_url, mirror="off")
    async with Node(config) as node, connect(nats_server.url, agent="alice", home=home) as client:
        after = client.event("finding", finding(1), project=project)
        await client.publish(after)
        await eventually(lambda: journal_event_ids(sqlite_journal_url, project) == [str(after.event_id)], timeout_s=20)
        (letter,) = await eventually(lambda: _letters_of(client.js, project, 1), timeout_s=20)
        assert headers_of(letter)[DLQ_STREAM_SEQ] == str(ack.seq)
        assert headers_of(letter)[DLQ_SIZE] == str(HUGE)
        assert headers_of(letter)[DLQ_DIGEST] == hashlib.sha256(huge).hexdigest()
        assert int(headers_of(letter)[DLQ_TRUNCATED]) == len(letter.data) < HUGE
        assert letter.data == huge[: len(letter.data)]
        assert node.nc is not None
        assert node.nc.is_connected
        info = await client.js.stream_info(STREAM)
        assert info.config.max_msg_size == EVENT_MAX_MSG_BYTES  # the node put the limit on the old stream


async def test_a_node_whose_connection_the_server_closes_restarts_its_services(
    node: Node, nats_server: NatsServer, home: Path, project: str
) -> None:
    """nats-py checks a message's payload against the max payload but not its headers; the server counts both
    and closes the connection for good on a violation. The node once kept running on the closed connection,
    journaling nothing while `epibus stats` still answered."""
    assert node.nc is not None
    first = node.nc
    await first.publish("epibus.test.oversize", b"a" * (first.max_payload - 100), headers={"Pad": "b" * 1000})
    # The server answers with -ERR and closes (nats-py gives the connection up: the node restarts its services
    # on a new one) or, when the violation lands mid-write, resets the socket (nats-py reconnects the same
    # connection). Either way the node must end connected and journaling, never on a dead connection.
    await eventually(lambda: first.is_closed or first.stats["reconnects"] > 0, timeout_s=30)
    await eventually(
        lambda: (
            node.nc is not None
            and node.nc.is_connected
            and (node.connection_restarts == 1) == (node.nc is not first)
            and (node.nc is not first or not first.is_closed)
        ),
        timeout_s=30,
    )
    async with connect(nats_server.url, agent="alice", home=home) as client:
        event = client.event("finding", finding(1), project=project)
        await client.publish(event)
        assert node.journal is not None
        journal_url = node.journal.url
        await eventually(lambda: journal_event_ids(journal_url, project) == [str(event.event_id)], timeout_s=20)
    report = await eventually(lambda: _reported(node, home), timeout_s=10)
    assert report["nats"]["connection_restarts"] == (1 if first.is_closed else 0)
    assert report["nats"]["connected"] is True
    assert problems(home, read_node_info(home), report) == []


def _reported(node: Node, home: Path) -> dict[str, Any] | None:
    report = read_health(home)
    return report if report and report["nats"]["connection_restarts"] == node.connection_restarts else None


async def test_two_nodes_on_one_machine_have_different_names_that_stay(nats_server: NatsServer, tmp_path: Path) -> None:
    def config(home: str, name: str | None = None) -> NodeConfig:
        return NodeConfig(home=tmp_path / home, nats_url=nats_server.url, mirror="off", name=name)

    async with Node(config("a")) as a, Node(config("b")) as b:
        names = (a.name, b.name)
    assert names[0] != names[1]
    async with Node(config("a")) as again:
        assert again.name == names[0]  # kept in its home
    async with Node(config("a", name="ops-east")) as renamed:
        assert renamed.name == "ops-east"
    async with Node(config("a")) as after:
        assert after.name == "ops-east"
    with pytest.raises(ConfigError, match="--name"):
        async with Node(config("c", name="bad name\n")):
            pass
