"""Which nodes are live. Each node puts a heartbeat, signed with its own key, in the nodes bucket every
HEARTBEAT_S; the server drops a record HEARTBEAT_TTL_S after its last write, so a node that died leaves the
live set by itself, and one that stops withdraws its record at once. A fan-out waits for exactly the live nodes
that answer its subject, never for a fixed time.

Only nodes write the bucket (the broker refuses agents' writes). A record that does not decode, sits under
another key than its signer's, carries a signature that does not verify or was signed too long ago is
quarantined (counted, logged once), never trusted."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.kv import KeyValue
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from bus.broker.nats_errors import JS_TIMEOUT_S, NATS_OR_API_ERROR, nats_call
from bus.broker.streams import open_bucket
from bus.errors import InvalidEvent, MalformedRecord, Unavailable
from bus.host.home import NODE_NAME_PATTERN
from bus.identity.signing import REQUEST_MAX_AGE_S, AgentKey, verify_document
from bus.model.auth import PublicKey
from bus.model.records import Quarantine, decode_json
from bus.subjects import NODES_BUCKET, NODES_STREAM, heartbeat_key, heartbeat_subject, heartbeats_filter

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
HEARTBEAT_PURPOSE = "epibus node heartbeat"
# nats-py's KV delete and purge leave a marker record with this header.
_KV_OPERATION = "KV-Operation"

NodeName = Annotated[str, StringConstraints(pattern=f"^{NODE_NAME_PATTERN.pattern}$")]
ServiceSubject = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_-]*(\.[a-z][a-z0-9_-]*){1,7}$")]

# Every reader in this process counts the heartbeats it refused here (each record once).
quarantine = Quarantine("node heartbeats")


class Heartbeat(BaseModel):
    """One node's presence: its name (as in its replies), its key, the request subjects it answers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: NodeName
    public_key: PublicKey
    services: tuple[ServiceSubject, ...] = Field(max_length=64)
    at: datetime
    # Events its journal has yet to take from the stream (its consumer's pending count), None when not known.
    journal_pending: int | None = Field(default=None, ge=0)
    signature: str = Field(max_length=128)

    def document(self) -> bytes:
        return self.model_dump_json(exclude={"signature"}).encode()


def signed_heartbeat(
    key: AgentKey, node: str, services: Iterable[str], *, at: datetime, journal_pending: int | None = None
) -> Heartbeat:
    unsigned = Heartbeat(
        node=node,
        public_key=key.public_key,
        services=tuple(sorted(services)),
        at=at,
        journal_pending=journal_pending,
        signature="",
    )
    return unsigned.model_copy(update={"signature": key.sign_document(HEARTBEAT_PURPOSE, unsigned.document())})


def decode_heartbeat(data: bytes, *, key: str, revision: int | None, now: datetime) -> Heartbeat:
    """The heartbeat a nodes bucket record holds. Raises MalformedRecord for anything else: not a heartbeat,
    under another key than its signer's, a signature that does not verify, or signed more than
    REQUEST_MAX_AGE_S from `now` (a replayed record)."""
    beat = decode_json(Heartbeat, data, bucket=NODES_BUCKET, key=key, revision=revision)
    if key != heartbeat_key(beat.public_key):
        raise MalformedRecord(NODES_BUCKET, key, revision, f"is signed by {beat.public_key[:12]}…, not its key's node")
    try:
        verify_document(beat.public_key, HEARTBEAT_PURPOSE, beat.document(), beat.signature)
    except InvalidEvent as e:
        raise MalformedRecord(NODES_BUCKET, key, revision, f"its signature {e.problem}") from e
    if beat.at.tzinfo is None or abs((now - beat.at).total_seconds()) > REQUEST_MAX_AGE_S:
        raise MalformedRecord(NODES_BUCKET, key, revision, f"was signed at {beat.at.isoformat()}, not recently")
    return beat


@dataclass
class LiveNodes:
    """The live nodes by name; `known` False when nobody can say (no node has announced itself on this server,
    or the bucket could not be read: `why` says which), and `ignored` the records refused (key -> why)."""

    nodes: dict[str, Heartbeat] = field(default_factory=dict)
    known: bool = True
    why: str = ""
    ignored: dict[str, str] = field(default_factory=dict)

    def answering(self, subject: str) -> set[str]:
        return {name for name, beat in self.nodes.items() if subject in beat.services}


async def live_nodes(js: JetStreamContext, *, timeout_s: float = JS_TIMEOUT_S) -> LiveNodes:
    """Every live node's heartbeat, read from the bucket's stream state (two round trips, however many nodes).
    Never raises for what the bucket holds or for NATS: an unreadable bucket gives `known` False."""
    try:
        async with asyncio.timeout(timeout_s):
            info = await js.stream_info(NODES_STREAM, subjects_filter=heartbeats_filter())
            subjects = sorted(info.state.subjects or {})
            found = await asyncio.gather(*(_last(js, subject) for subject in subjects))
    except nats.js.errors.NotFoundError:
        return LiveNodes(known=False, why=f"no node has announced itself ({NODES_BUCKET} does not exist)")
    except NATS_OR_API_ERROR as e:
        return LiveNodes(known=False, why=f"{NODES_BUCKET} unreadable: {type(e).__name__} {e}")
    live = LiveNodes()
    now = datetime.now(UTC)
    prefix = heartbeat_subject("")
    for subject, msg in zip(subjects, found, strict=True):
        if msg is None or (msg.headers or {}).get(_KV_OPERATION) in ("DEL", "PURGE"):
            continue  # expired since the listing, or withdrawn by a node that stopped
        key = subject.removeprefix(prefix)
        try:
            beat = decode_heartbeat(msg.data or b"", key=key, revision=msg.seq, now=now)
        except MalformedRecord as e:
            quarantine.add(e)
            live.ignored[key] = e.reason
            continue
        live.nodes[beat.node] = beat
    return live


async def _last(js: JetStreamContext, subject: str) -> RawStreamMsg | None:
    try:
        return await js.get_last_msg(NODES_STREAM, subject)
    except nats.js.errors.NotFoundError:
        return None


class Presence:
    """A node's heartbeat: `beat` once at start, `run` every HEARTBEAT_S, `withdraw` when the node stops."""

    def __init__(
        self,
        js: Callable[[], JetStreamContext],
        key: AgentKey,
        node: str,
        services: Callable[[], Iterable[str]],
        journal_pending: Callable[[], int | None] = lambda: None,
    ) -> None:
        self._js = js
        self._journal_pending = journal_pending
        self._key = key
        self._node = node
        self._services = services
        self._kv: KeyValue | None = None
        self.beats = 0
        self.failures = 0

    async def beat(self) -> None:
        """Put this node's heartbeat. Raises Unavailable."""
        record = signed_heartbeat(
            self._key, self._node, self._services(), at=datetime.now(UTC), journal_pending=self._journal_pending()
        )
        async with nats_call(f"heartbeat of node {self._node}"):
            if self._kv is None:
                self._kv = await open_bucket(self._js(), NODES_BUCKET, create=False)
            await self._kv.put(heartbeat_key(self._key.public_key), record.model_dump_json().encode())
        self.beats += 1

    async def run(self) -> None:
        """Beat every HEARTBEAT_S until cancelled. A failed beat is logged and counted; the next one tries again
        (the record lives HEARTBEAT_TTL_S, several beats)."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self.beat()
            except Unavailable as e:
                self.failures += 1
                log.warning("%s", e)

    async def withdraw(self) -> None:
        """Remove this node from the live set now, not when its record expires. A failure is logged: the
        record then expires by itself."""
        if self._kv is None:
            return
        try:
            async with asyncio.timeout(JS_TIMEOUT_S):
                await self._kv.delete(heartbeat_key(self._key.public_key))
        except NATS_OR_API_ERROR as e:
            why = f"{type(e).__name__} {e}"
            log.warning("node %s: heartbeat not withdrawn (%s); it expires by itself", self._node, why)
