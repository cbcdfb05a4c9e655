"""A stream or KV bucket changed behind epibus's back is refused naming each change, left as it is, and put back
only when asked (`ensure_streams(repair=True)`, `epibus streams repair`, `epibus up --repair-streams`). Every
change is made with plain nats-py and every result read back through `js.stream_info`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    RePublish,
    RetentionPolicy,
    StorageType,
    StreamConsumerLimits,
    StreamSource,
    SubjectTransform,
)

from bus.broker.nats_errors import translate_publish_error
from bus.broker.streams import (
    BUCKETS,
    DLQ_MAX_MSG_BYTES,
    DRIFT_CHECK_EVERY_S,
    EVENT_MAX_MSG_BYTES,
    MIB,
    NOTICE_MAX_MSG_BYTES,
    VECTOR_MAX_MSG_BYTES,
    StreamLimits,
    ensure_streams,
    managed_streams,
    open_bucket,
    stream_configs,
)
from bus.client.client import connect
from bus.errors import ConfigError, StreamDrift, Unavailable
from bus.host.home import read_node_info
from bus.host.server import NatsServer
from bus.subjects import (
    AGENT_KEYS_BUCKET,
    DLQ_STREAM,
    MESH_BUCKET,
    MESH_STREAM,
    STREAM,
    VECTORS_STREAM,
    WATCH_STREAM,
)
from epibus.monitoring.health import problems, read_health
from epibus.node.node import Node, NodeConfig
from tests.e2e.test_cli import as_json, epibus, error_json
from tests.support import eventually

# One hostile value per managed field that the server lets an update change and change back.
EVENT_STREAM_CHANGES: list[tuple[str, Any]] = [
    ("subjects", ["epi.only.>"]),
    ("retention", RetentionPolicy.INTEREST),
    ("max_age", 3600.0),  # the server wants max_age above the duplicate window, so the window stays as it is
    ("max_msg_size", 100),
    ("max_msgs_per_subject", 1),
    ("duplicate_window", 1.0),
    ("no_ack", True),
    ("allow_rollup_hdrs", True),
    ("allow_direct", False),
    ("republish", RePublish(src="epi.>", dest="leak.>")),
    ("subject_transform", SubjectTransform(src="epi.>", dest="epi.moved.>")),
    ("sources", [StreamSource(name="ELSEWHERE")]),  # would copy another stream's messages in
    ("consumer_limits", StreamConsumerLimits(inactive_threshold=5.0)),
]
BUCKET_CHANGES: list[tuple[str, Any]] = [
    ("max_msgs_per_subject", 1),  # the bucket's history
    ("max_age", 3600.0),
    ("discard", DiscardPolicy.OLD),
    ("allow_rollup_hdrs", False),
    ("max_bytes", 1_000_000),
    ("max_msg_size", 100),
    ("duplicate_window", 1.0),
    ("subjects", [f"$KV.{MESH_BUCKET}.>", "leak.>"]),
    ("republish", RePublish(src=f"$KV.{MESH_BUCKET}.>", dest="leak.>")),
]
CASES = [(STREAM, field, value) for field, value in EVENT_STREAM_CHANGES] + [
    (MESH_STREAM, field, value) for field, value in BUCKET_CHANGES
]


@contextlib.asynccontextmanager
async def jetstream(server: NatsServer) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(server.url)
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


async def config_of(js: JetStreamContext, stream: str) -> dict[str, Any]:
    return (await js.stream_info(stream)).config.as_dict()


async def change(js: JetStreamContext, stream: str, **changes: Any) -> dict[str, Any]:
    """What someone with plain nats-py does to a stream; returns its configuration read back."""
    config = (await js.stream_info(stream)).config
    for field, value in changes.items():
        setattr(config, field, value)
    await js.update_stream(config)
    return await config_of(js, stream)


@pytest.mark.parametrize(("stream", "field", "value"), CASES, ids=[f"{s}.{f}" for s, f, _ in CASES])
async def test_a_changed_managed_field_is_refused_by_name_and_left_alone_until_repaired(
    nats_server: NatsServer, stream: str, field: str, value: Any
) -> None:
    async with jetstream(nats_server) as js:
        await ensure_streams(js, replicas=1)  # a node makes the streams and the buckets
        original = await config_of(js, stream)
        drifted = await change(js, stream, **{field: value})
        for replicas in (None, 1):  # a client and a node refuse alike
            with pytest.raises(StreamDrift) as refused:
                await ensure_streams(js, replicas=replicas)
            assert refused.value.fields == {stream: [field]}
            assert str(refused.value).startswith(f"stream {stream} drifted: {field}=")
        assert await config_of(js, stream) == drifted

        repaired = await ensure_streams(js, repair=True)
        assert {name: [d.field for d in diffs] for name, diffs in repaired.items()} == {stream: [field]}
        assert await config_of(js, stream) == original
        assert await ensure_streams(js) == {}


@pytest.mark.parametrize(
    ("changes", "fields"),
    [
        ({"deny_delete": True}, ["deny_delete"]),  # would make `epibus forget` fail to erase
        ({"deny_purge": True}, ["deny_purge"]),
        ({"allow_msg_ttl": True}, ["allow_msg_ttl"]),  # a publisher could make its own event vanish
        # Sealing sets the other three (and discard new, which the event stream has already).
        ({"sealed": True}, ["sealed", "deny_delete", "deny_purge"]),
    ],
    ids=["deny_delete", "deny_purge", "allow_msg_ttl", "sealed"],
)
async def test_a_change_the_server_cannot_undo_is_refused_and_its_repair_fails_with_the_servers_reason(
    nats_server: NatsServer, changes: dict[str, Any], fields: list[str]
) -> None:
    async with jetstream(nats_server) as js:
        await ensure_streams(js)
        drifted = await change(js, STREAM, **changes)
        with pytest.raises(StreamDrift) as refused:
            await ensure_streams(js)
        assert refused.value.fields == {STREAM: fields}
        with pytest.raises(ConfigError, match=f"stream {STREAM}: JetStream refused to restore {', '.join(fields)}: "):
            await ensure_streams(js, repair=True)
        assert await config_of(js, STREAM) == drifted


async def test_an_event_stream_recreated_in_memory_is_refused_naming_its_storage(nats_server: NatsServer) -> None:
    async with jetstream(nats_server) as js:
        await ensure_streams(js)
        await js.delete_stream(STREAM)
        await js.add_stream(dataclasses.replace(stream_configs()[0], storage=StorageType.MEMORY))
        with pytest.raises(StreamDrift) as refused:
            await ensure_streams(js)
        assert refused.value.fields == {STREAM: ["storage"]}
        assert "storage=memory (epibus needs file)" in str(refused.value)
        with pytest.raises(ConfigError, match="can not change storage type"):
            await ensure_streams(js, repair=True)
        assert (await js.stream_info(STREAM)).config.storage == StorageType.MEMORY


async def test_a_short_max_age_is_refused_in_one_line_naming_each_change(nats_server: NatsServer) -> None:
    """Events older than max_age are deleted by the server: three seconds would wipe the memory."""
    async with jetstream(nats_server) as js:
        await ensure_streams(js)
        await change(js, STREAM, max_age=3.0, duplicate_window=1.0)  # the window may not exceed max_age
        await change(js, DLQ_STREAM, duplicate_window=60.0)
        with pytest.raises(StreamDrift) as refused:
            await ensure_streams(js)
    assert str(refused.value) == (
        "stream EPI drifted: max_age=3.0s (epibus needs 0: keep forever), duplicate_window=1.0s (needs 600.0s); "
        "stream EPI_DLQ drifted: duplicate_window=60.0s (epibus needs 600.0s); run `epibus streams repair` to "
        "restore them"
    )


async def test_streams_and_buckets_as_epibus_makes_them_show_no_drift(nats_server: NatsServer) -> None:
    async with jetstream(nats_server) as js:
        assert await ensure_streams(js) == {}  # a client makes the event streams
        for bucket in BUCKETS:
            await open_bucket(js, bucket)  # and the buckets, through nats-py's KV API, on first use
        assert await ensure_streams(js) == {}
        assert await ensure_streams(js, replicas=1) == {}
        names = [(await js.stream_info(stream.name)).config.name for stream in managed_streams()]
    assert names == [STREAM, DLQ_STREAM, VECTORS_STREAM, WATCH_STREAM, *(f"KV_{bucket}" for bucket in BUCKETS)]


# The limits a node sets from its configuration (`epibus up --events-max-gib` and the like), never drift.
LIMIT_CHANGES: list[tuple[str, Any]] = [
    ("discard", DiscardPolicy.OLD),  # with a byte limit this would drop the oldest memory to make room
    ("max_msgs", 10),
    ("max_bytes", 1_000_000),
    ("max_consumers", 1),
]


async def test_a_node_applies_its_limits_and_a_client_leaves_them_to_the_node(nats_server: NatsServer) -> None:
    limits = StreamLimits(events_max_bytes=10 * MIB, dlq_max_bytes=MIB, dlq_max_age_s=3600.0, max_consumers=50)
    async with jetstream(nats_server) as js:
        await ensure_streams(js, replicas=1, limits=limits)
        made = await config_of(js, STREAM)
        await change(js, STREAM, **dict(LIMIT_CHANGES))
        assert await ensure_streams(js) == {}  # a client compares everything else, and leaves limits alone
        changed = await ensure_streams(js, replicas=1, limits=limits)
        restored = await config_of(js, STREAM)
        dlq = (await js.stream_info(DLQ_STREAM)).config
    assert sorted(d.field for d in changed[STREAM]) == sorted(field for field, _ in LIMIT_CHANGES)
    assert restored == made
    assert (made["discard"], made["max_bytes"], made["max_age"]) == ("new", 10 * MIB, 0)
    assert (dlq.discard, dlq.max_bytes, dlq.max_age, dlq.max_consumers) == (DiscardPolicy.OLD, MIB, 3600.0, 50)


async def test_a_full_event_stream_refuses_new_events_and_keeps_every_old_one(nats_server: NatsServer) -> None:
    async with jetstream(nats_server) as js:
        await ensure_streams(js, replicas=1, limits=StreamLimits(events_max_bytes=4000))
        refusal: nats.js.errors.APIError | None = None
        sent = 0
        while refusal is None and sent < 100:
            sent += 1
            try:
                await js.publish("epi.p.finding.a", b"x" * 500, headers={"Nats-Msg-Id": str(sent)})
            except nats.js.errors.APIError as e:
                refusal = e
        first = await js.get_msg(STREAM, seq=1)
    assert refusal is not None
    assert translate_publish_error(refusal, "epi.p.finding.a").__class__ is Unavailable
    assert "the stream is full" in str(translate_publish_error(refusal, "epi.p.finding.a"))
    assert first.data == b"x" * 500  # nothing old was dropped to make room
    assert 1 < sent < 99


async def test_a_mesh_bucket_without_direct_gets_them_without_asking_and_other_buckets_are_left_alone(
    nats_server: NatsServer,
) -> None:
    """Direct gets are how the broker confines an agent's reads of the mesh bucket to its projects' keys: a
    bucket made before that gets them, since they only add a way to read one key."""
    async with jetstream(nats_server) as js:
        await ensure_streams(js, replicas=1)
        await change(js, MESH_STREAM, allow_direct=False)
        changed = await ensure_streams(js, replicas=1)
        mesh = (await js.stream_info(MESH_STREAM)).config
        await change(js, f"KV_{AGENT_KEYS_BUCKET}", allow_direct=True)
        with pytest.raises(StreamDrift) as refused:
            await ensure_streams(js, replicas=1)
    assert {name: [tuple(d) for d in diffs] for name, diffs in changed.items()} == {
        MESH_STREAM: [("allow_direct", False, True)]
    }
    assert mesh.allow_direct is True
    assert refused.value.fields == {f"KV_{AGENT_KEYS_BUCKET}": ["allow_direct"]}


async def test_an_older_epibus_stream_without_a_size_limit_gets_the_limit_without_asking(
    nats_server: NatsServer,
) -> None:
    async with jetstream(nats_server) as js:
        for config in stream_configs():
            await js.add_stream(dataclasses.replace(config, max_msg_size=-1))  # as epibus made them before the limit
        changed = await ensure_streams(js)
        names = (STREAM, DLQ_STREAM, VECTORS_STREAM, WATCH_STREAM)
        sizes = {name: (await js.stream_info(name)).config.max_msg_size for name in names}
    wanted = {
        STREAM: EVENT_MAX_MSG_BYTES,
        DLQ_STREAM: DLQ_MAX_MSG_BYTES,
        VECTORS_STREAM: VECTOR_MAX_MSG_BYTES,
        WATCH_STREAM: NOTICE_MAX_MSG_BYTES,
    }
    assert {name: [tuple(d) for d in diffs] for name, diffs in changed.items()} == {
        name: [("max_msg_size", -1, size)] for name, size in wanted.items()
    }
    assert sizes == wanted


async def test_a_size_limit_is_not_added_while_another_setting_drifted(nats_server: NatsServer) -> None:
    async with jetstream(nats_server) as js:
        await js.add_stream(dataclasses.replace(stream_configs()[0], max_msg_size=-1, max_age=3600.0))
        before = await config_of(js, STREAM)
        with pytest.raises(StreamDrift) as refused:
            await ensure_streams(js)
        assert refused.value.fields == {STREAM: ["max_age"]}
        assert await config_of(js, STREAM) == before


@pytest.mark.slow
async def test_streams_repair_on_the_command_line_restores_each_field_and_reports_it(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    home = tmp_path / "cli-home"
    async with jetstream(nats_server) as js:
        await ensure_streams(js, replicas=1)
        original = {name: await config_of(js, name) for name in (STREAM, MESH_STREAM)}
        await change(js, STREAM, max_age=3600.0)
        await change(js, MESH_STREAM, max_msgs_per_subject=1)
        result = await asyncio.to_thread(epibus, home, "streams", "repair", "--nats", nats_server.url, "--json")
        assert as_json(result) == {
            "ok": True,
            "repaired": [
                {"stream": STREAM, "field": "max_age", "was": 3600.0, "now": 0.0},
                {"stream": MESH_STREAM, "field": "max_msgs_per_subject", "was": 1, "now": 64},
            ],
        }
        assert {name: await config_of(js, name) for name in original} == original
        again = await asyncio.to_thread(epibus, home, "streams", "repair", "--nats", nats_server.url)
    assert "no drift" in again.stdout


async def test_a_node_does_not_start_on_a_drifted_stream_and_repairs_it_when_told(
    nats_server: NatsServer, home: Path, sqlite_journal_url: str
) -> None:
    config = NodeConfig(home=home, nats_url=nats_server.url, journal_url=sqlite_journal_url, mirror="off")
    async with jetstream(nats_server) as js:
        await ensure_streams(js)
        drifted = await change(js, STREAM, max_age=3600.0)
        with pytest.raises(StreamDrift, match=r"^stream EPI drifted: max_age=3600.0s \(epibus needs 0: keep forever\)"):
            async with Node(config):
                pass
        assert await config_of(js, STREAM) == drifted
        async with Node(dataclasses.replace(config, repair_streams=True)) as node:
            assert node.stream_drift is None
            assert (await js.stream_info(STREAM)).config.max_age == 0


@pytest.mark.slow
async def test_epibus_up_on_a_drifted_stream_exits_with_the_drift_in_one_line(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    async with jetstream(nats_server) as js:
        await ensure_streams(js)
        drifted = await change(js, STREAM, max_age=3600.0)
        args = ("up", "--nats", nats_server.url, "--mirror", "off", "--json")
        result = await asyncio.to_thread(epibus, tmp_path / "up-home", *args, check=False)
        assert await config_of(js, STREAM) == drifted
    assert result.returncode == 1
    assert error_json(result) == {
        "ok": False,
        "error": "stream EPI drifted: max_age=3600.0s (epibus needs 0: keep forever); "
        "run `epibus streams repair` to restore it",
        "type": "StreamDrift",
    }


def drift_reported(home: Path) -> dict[str, Any] | None:
    report = read_health(home)
    return report if report and (report.get("streams") or {}).get("drift") else None


@pytest.mark.slow
async def test_a_running_node_reports_a_stream_that_drifts_and_keeps_running(
    node: Node, nats_server: NatsServer, home: Path
) -> None:
    async with jetstream(nats_server) as js:
        await change(js, STREAM, max_age=3600.0)
        report = await eventually(lambda: drift_reported(home), timeout_s=DRIFT_CHECK_EVERY_S * 3)
        found = problems(home, read_node_info(home), report)
        assert [p for p in found if p.startswith("stream EPI drifted: max_age=3600.0s (epibus needs 0: keep forever)")]
        assert node.forwarder is not None
        assert node.forwarder.stats.errors_by_kind.get("StreamDrift", 0) >= 1  # it forwards nothing meanwhile
        assert not any(task.done() for task in node._tasks), "a node service stopped"
        with pytest.raises(StreamDrift):
            async with connect(nats_server.url, agent="alice", home=home, outbox=False):
                pass

        await ensure_streams(js, repair=True)
        await eventually(lambda: drift_reported(home) is None, timeout_s=DRIFT_CHECK_EVERY_S * 3)
        assert problems(home, read_node_info(home), read_health(home)) == []
