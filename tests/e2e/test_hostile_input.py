"""A node under a barrage of hostile input stays up and loses nothing: thousands of generated messages on the
event stream (random bytes, truncated and wrongly typed JSON, deep nesting, huge numbers and strings up to the
limit, non-UTF-8, a signed event with a byte changed, a taken event id with other content, unknown kinds,
subjects that disagree with the body, impostor keys), malformed records in every KV bucket the node reads and
malformed requests to every request service, interleaved with valid events. Every hostile message is in the
dead-letter stream with a reason for each observer (or was refused by the stream), every request is answered
with an error, nothing hostile reaches the journal or the mirror, and every valid event reaches both."""

from __future__ import annotations

import hashlib
import json
import os
import random
import uuid
from collections import Counter
from pathlib import Path

import nats
import nats.js.errors
import pytest

from bus.broker.streams import EVENT_MAX_MSG_BYTES
from bus.client.client import connect
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey
from bus.intake.reader import dead_letters
from bus.model.event import Envelope, event_digest
from bus.model.ids import point_id
from bus.model.vocab import DeadLetterReason
from bus.subjects import (
    AGENT_KEYS_BUCKET,
    DLQ_CONSUMER,
    DLQ_REASON,
    DLQ_STREAM_SEQ,
    JOURNAL_LOOKUP,
    MESH_BUCKET,
    PROVE_FORGOTTEN,
    RECALL,
    REINDEX,
    TOMBSTONES_BUCKET,
    VERIFY,
    capabilities_key,
    roster_key,
    task_key,
)
from epibus.node.node import Node, NodeConfig
from observers.mirror.store import Filter
from tests.conftest import finding
from tests.hostile import hostile_payloads, hostile_requests, put_raw
from tests.hostile_stream import StreamFuzzer
from tests.support import eventually

HOSTILE_MESSAGES = int(os.environ.get("EPIBUS_HOSTILE_MESSAGES", "5000"))
VALID_EVERY = 25  # one valid event among this many hostile messages
SIDE_EVERY = 50  # a hostile KV record and a hostile request among this many


def kv_targets(project: str, i: int) -> list[tuple[str, str]]:
    """Keys in every bucket the node reads. Never the honest agent's own registry entry: a record there that
    cannot be read (rightly) stops that agent's events, which is another test."""
    return [
        (MESH_BUCKET, task_key(project, f"hostile{i}")),
        (MESH_BUCKET, roster_key(f"{project}-r{i}")),
        (MESH_BUCKET, capabilities_key(f"stranger{i}")),
        (AGENT_KEYS_BUCKET, f"stranger{i}"),
        (TOMBSTONES_BUCKET, f"{project}.{hashlib.sha256(str(i).encode()).hexdigest()}"),
    ]


REQUEST_SUBJECTS = [RECALL, VERIFY, PROVE_FORGOTTEN, REINDEX, JOURNAL_LOOKUP]


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_a_node_survives_a_barrage_of_hostile_input_and_keeps_every_valid_event(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    config = NodeConfig(
        home=tmp_path / "node", nats_url=nats_server.url, journal_url=f"sqlite:///{tmp_path / 'journal.db'}"
    )
    rng = random.Random(20261203)
    async with Node(config) as node, connect(nats_server.url, agent="alice", home=tmp_path / "alice") as alice:

        def make_event(text: str, event_id: uuid.UUID | None = None) -> Envelope:
            return alice.event("finding", finding(text=text), project=project, event_id=event_id)

        valid = [make_event(f"valid claim number {i} about queue lag") for i in range(20)]
        await alice.publish_many(valid)
        impostor = AgentKey.load_or_create(tmp_path / "impostor", "alice")
        fuzzer = StreamFuzzer(rng, project, make_event, impostor, [e.event_id for e in valid])

        raw = await nats.connect(nats_server.url)
        js = raw.jetstream()
        accepted: dict[int, str] = {}  # stream seq -> category
        refused_by_stream: list[tuple[int | None, int]] = []  # (err_code, size)
        unanswered: list[str] = []
        answered_errors = 0
        side = 0
        requests = [(s, r) for s in REQUEST_SUBJECTS for r in hostile_requests(s)]
        kv_values = hostile_payloads()
        try:
            for i, message in enumerate(fuzzer.messages(HOSTILE_MESSAGES)):
                try:
                    ack = await js.publish(message.subject, message.data, headers=message.headers)
                    accepted[ack.seq] = message.category
                except nats.js.errors.APIError as e:
                    refused_by_stream.append((e.err_code, len(message.data)))
                if i % VALID_EVERY == 0:
                    event = make_event(f"valid claim {i} about disk pressure")
                    await alice.publish(event)
                    valid.append(event)
                if i % SIDE_EVERY == 0:
                    for bucket, key in kv_targets(project, side):
                        await put_raw(js, bucket, key, kv_values[side % len(kv_values)].value)
                    subject, request = requests[side % len(requests)]
                    try:
                        reply = json.loads((await raw.request(subject, request.body, timeout=5)).data)
                    except (TimeoutError, nats.errors.NoRespondersError):
                        unanswered.append(f"{subject}:{request.name}")
                    else:
                        assert isinstance(reply, dict), (subject, request.name, reply)
                        assert reply.get("error"), (subject, request.name, reply)
                        answered_errors += 1
                    side += 1
        finally:
            await raw.close()

        assert unanswered == []
        # Only what is over the stream's size limit (err_code 10054) is refused at publish.
        assert all(code == 10054 and size > EVENT_MAX_MSG_BYTES - 4096 for code, size in refused_by_stream)
        valid_ids = sorted(str(e.event_id) for e in valid)
        digests = {str(e.event_id): event_digest(e) for e in valid}

        async def journaled() -> bool:
            assert node.journal is not None
            kept = await __import__("asyncio").to_thread(node.journal.kept_events, valid_ids)
            return sorted(kept) == valid_ids and all(kept[i].digest == digests[i] for i in valid_ids)

        await eventually(journaled, timeout_s=240, interval_s=1.0)

        assert node.runner is not None
        assert node.mirror_runner is not None
        runners = (node.runner, node.mirror_runner)
        # Every accepted hostile message, dead-lettered once by each observer's runner (counted as it happens).
        await eventually(
            lambda: all(sum(r.stats.dead_lettered.values()) >= len(accepted) for r in runners),
            timeout_s=400,
            interval_s=1.0,
        )
        # The DLQ keeps one copy of each: whichever observer refused it first; never one per observer.
        copies: dict[int, list[tuple[str, str]]] = {}
        for letter in await dead_letters(alice.js):
            headers = letter.headers or {}
            if headers.get(DLQ_CONSUMER) in {r.observer.name for r in runners}:
                copies.setdefault(int(headers[DLQ_STREAM_SEQ]), []).append((headers[DLQ_CONSUMER], headers[DLQ_REASON]))
        print(  # the run's figures, shown with `pytest -s`
            f"hostile messages {HOSTILE_MESSAGES}: accepted by the stream {len(accepted)}, refused at publish "
            f"{len(refused_by_stream)}; valid events {len(valid)}; KV records {side * 5}; requests {side}; "
            f"dead letters {dict(Counter(reason for found in copies.values() for _, reason in found))}"
        )
        reasons = {r.value for r in DeadLetterReason}
        missing = {seq: accepted[seq] for seq in set(accepted) - set(copies)}
        assert missing == {}, f"not dead-lettered: {missing}"
        assert {seq: found for seq, found in copies.items() if len(found) != 1} == {}
        assert {reason for found in copies.values() for _, reason in found} <= reasons

        async def mirrored() -> bool:
            assert node.store is not None
            found = await node.store.point_ids(Filter(equals={"project": project}))
            return sorted(found) == sorted(point_id(e.event_id) for e in valid)

        await eventually(mirrored, timeout_s=120, interval_s=1.0)
        assert not any(task.done() for task in node._tasks), "a node service stopped"
        assert node.runner.stats.internal_errors == 0
        assert node.mirror_runner.stats.internal_errors == 0
        assert answered_errors == side
