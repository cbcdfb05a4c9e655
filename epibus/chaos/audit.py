"""Reading every store back for the audit: the event stream as each server holds it (each made the leader in
turn), and each node's journal and mirror from their files once the nodes have stopped. Every reader returns
event id -> the digest of each copy; the ledger's one rule judges them all."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import nats.errors
from nats.aio.client import Client as NatsClient
from sqlalchemy import bindparam, create_engine, text

from bus.broker.ask import fan_out
from bus.errors import Unavailable
from bus.identity.signing import AgentKey
from bus.intake.admission import Rejected, TimeBounds, check_message
from bus.intake.stream_read import read_stream
from bus.model.event import event_digest
from bus.model.ids import point_id
from bus.model.requests import LOOKUP_CHUNK, ErrorReply, IndexedReply, LookupRequest
from bus.subjects import MIRROR_LOOKUP, MSG_ID_HEADER, STREAM, events_filter, stream_leader_stepdown_subject
from observers.mirror.edge import EdgeVectorStore
from observers.mirror.embed import DEFAULT_DIMENSION, DEFAULT_MODEL
from observers.mirror.store import Filter

Copies = dict[str, list[str | None]]
LEADER_S = 60.0
RETRIEVE_CHUNK = 512
LOOKUP_S = 30.0  # one ask: a node that just restarted and is catching up may be slow to answer
LOOKUP_WAIT_S = 120.0


async def make_leader(nc: NatsClient, server: str, timeout_s: float = LEADER_S) -> None:
    """Move the event stream's leadership to `server` (a preferred stepdown, asked again until it holds).
    Raises Unavailable when the server did not become the leader in time."""
    js = nc.jetstream()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last = "no answer"
    while True:
        try:
            info = await js.stream_info(STREAM)
            if info.cluster is not None and info.cluster.leader == server:
                return
            request = json.dumps({"placement": {"preferred": server}}).encode()
            reply = await nc.request(stream_leader_stepdown_subject(STREAM), request, timeout=10)
            last = reply.data.decode(errors="replace")[:200]
        except (nats.errors.Error, TimeoutError) as e:  # an election in progress answers nothing: asked again
            last = type(e).__name__
        if loop.time() > deadline:
            raise Unavailable(server, f"did not become the event stream's leader in {timeout_s:.0f}s (last: {last})")
        await asyncio.sleep(1.0)


async def stream_copies(nc: NatsClient, projects: Sequence[str]) -> Copies:
    """What the stream's current leader holds in these projects. A message that is not an admissible event
    counts as a copy with no digest (wrong content)."""
    js = nc.jetstream()
    bounds = TimeBounds.from_env()
    found: Copies = defaultdict(list)
    for project in projects:
        async for batch in read_stream(js, STREAM, filter_subject=events_filter(project)):
            for msg in batch:
                headers = dict(msg.headers or {})
                try:
                    event = check_message(msg.subject, msg.data, msg.metadata.timestamp, bounds, headers)
                except Rejected:
                    found[headers.get(MSG_ID_HEADER, f"seq-{msg.metadata.sequence.stream}")].append(None)
                    continue
                found[str(event.event_id)].append(event_digest(event))
    return dict(found)


def journal_copies(journal_file: Path, projects: Sequence[str]) -> Copies:
    """The journal's rows in these projects, read by SQL from the file (not through the Journal class)."""
    if not journal_file.exists():
        raise Unavailable("journal", f"{journal_file} does not exist")
    engine = create_engine(f"sqlite:///file:{journal_file}?mode=ro&uri=true")
    found: Copies = defaultdict(list)
    try:
        with engine.connect() as conn:
            query = text("SELECT event_id, digest FROM events WHERE project IN :projects").bindparams(
                bindparam("projects", expanding=True)
            )
            for event_id, digest in conn.execute(query, {"projects": list(projects)}):
                found[str(event_id)].append(digest)
    finally:
        engine.dispose()
    return dict(found)


async def mirror_copies(mirror_dir: Path, projects: Sequence[str]) -> Copies:
    """The mirror's points in these projects, read from its files (the node must have stopped). A point whose
    id is not the point id of the event it names counts as a second copy of that event."""
    if not await asyncio.to_thread(mirror_dir.is_dir):
        raise Unavailable("mirror", f"{mirror_dir} does not exist")
    store = await EdgeVectorStore.open(mirror_dir, DEFAULT_MODEL, DEFAULT_DIMENSION)
    found: Copies = defaultdict(list)
    try:
        ids = await store.point_ids(Filter(any_of={"project": list(projects)}))
        for start in range(0, len(ids), RETRIEVE_CHUNK):
            for point in await store.retrieve(ids[start : start + RETRIEVE_CHUNK]):
                event_id = str(point.payload.get("event_id"))
                found[event_id].append(_point_digest(point.id, event_id, point.payload.get("event_digest")))
    finally:
        await store.close()
    return dict(found)


def _point_digest(point: uuid.UUID, event_id: str, digest: object) -> str | None:
    try:
        expected = point_id(uuid.UUID(event_id))
    except ValueError:
        return None
    return digest if isinstance(digest, str) and point == expected else None


async def mirror_lookup_copies(
    nc: NatsClient, signer: AgentKey, digests: Mapping[str, str], nodes: Sequence[str]
) -> tuple[dict[str, Copies], dict[str, str]]:
    """Which of these events each running node's mirror has indexed, asked through its lookup service (a running
    node's mirror files cannot be opened beside it). Presence only: a found event is taken to hold its digest.
    A node that has not answered a chunk is asked again (a node just restarted may be slow) until LOOKUP_WAIT_S;
    returns what each node holds, and why for each node that could not be read."""
    found: dict[str, Copies] = {node: {} for node in nodes}
    problems: dict[str, str] = {}
    ids = sorted(digests)
    loop = asyncio.get_running_loop()
    for start in range(0, len(ids), LOOKUP_CHUNK):
        chunk = LookupRequest(ids[start : start + LOOKUP_CHUNK])
        waiting = {node: "did not answer the mirror lookup" for node in nodes if node not in problems}
        deadline = loop.time() + LOOKUP_WAIT_S
        while waiting and loop.time() < deadline:
            try:
                replies = await fan_out(
                    nc, MIRROR_LOOKUP, chunk, IndexedReply, signer=signer, timeout_s=LOOKUP_S, expect=list(waiting)
                )
            except Unavailable as e:  # NATS itself did not answer: asked again within the wait
                waiting = dict.fromkeys(waiting, str(e))
                await asyncio.sleep(1.0)
                continue
            for answer in replies.answers:
                if answer.node not in waiting:
                    continue
                if isinstance(answer, ErrorReply):
                    waiting[answer.node] = f"its mirror lookup failed: {answer.error}"
                elif not answer.mirror:
                    waiting[answer.node] = "it runs no mirror"
                else:
                    del waiting[answer.node]
                    found[answer.node] |= {event_id: [digests[event_id]] for event_id in answer.indexed}
            if waiting:
                await asyncio.sleep(1.0)
        problems |= {node: f"{why} (asked for {LOOKUP_WAIT_S:.0f}s)" for node, why in waiting.items()}
    return found, problems
