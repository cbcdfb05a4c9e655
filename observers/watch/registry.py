"""The node's side of watches: the one writer of the watches bucket (an agent asks a node: epibus.watch.*), and the
book of watches every node matches claims against, kept by following the bucket from its first record."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from bus.broker.nats_errors import nats_call
from bus.broker.streams import open_bucket
from bus.enrolment.service_rules import Asker, current_asker, watch_own_rule, watch_register_rule
from bus.errors import ConfigError, LimitReached, MalformedRecord
from bus.intake.follow import StreamFollower
from bus.model.records import Quarantine
from bus.model.watch import (
    MAX_WATCHES_PER_AGENT,
    WatchListReply,
    WatchListRequest,
    WatchRecord,
    WatchRegisterRequest,
    WatchReply,
    WatchStopReply,
    WatchStopRequest,
    watch_expiry,
)
from bus.services.responder import Service
from bus.subjects import (
    WATCH_LIST,
    WATCH_QUEUE,
    WATCH_REGISTER,
    WATCH_STOP,
    WATCHES_BUCKET,
    kv_stream,
    kv_subject,
    watch_key,
)
from observers.mirror.embed import Embedder
from observers.watch.match import WatchBook

log = logging.getLogger(__name__)
_KV_OPERATION = "KV-Operation"
_REMOVED = ("DEL", "PURGE")


@dataclass
class WatchCounts:
    registered: int = 0
    stopped: int = 0
    over_limit: int = 0  # registrations refused: the agent held its limit of watches
    reembedded: int = 0  # watches made by a node of another model, embedded again with this node's


class WatchRegistry:
    """Registers, stops and lists agents' watches, and keeps `book` in step with the bucket (`follow`). A watch
    registered elsewhere under another model is embedded again here: a node never matches with a vector of a
    model it does not run."""

    def __init__(
        self,
        js: Callable[[], JetStreamContext],
        embedder: Embedder,
        *,
        node: str,
        replicas: int,
        closed: Callable[[], bool],
        limit: int = MAX_WATCHES_PER_AGENT,
    ) -> None:
        self._js = js
        self.embedder = embedder
        self.node = node
        self.replicas = replicas
        self.closed = closed
        self.limit = limit
        self.book = WatchBook(embedder.model_id, embedder.dimension)
        self.counts = WatchCounts()
        self.quarantine = Quarantine("watch registry")
        self.follower: StreamFollower | None = None

    async def _bucket(self) -> KeyValue:
        async with nats_call("the watches bucket"):
            return await open_bucket(self._js(), WATCHES_BUCKET, replicas=self.replicas)

    def services(self) -> list[Service[Any]]:
        """Register, stop and list, answered by one node of the group; a watch belongs to its signer, so the
        rules apply on a node without authentication too."""
        return [
            Service(WATCH_REGISTER, WatchRegisterRequest, WatchReply, self.register, watch_register_rule,
                    queue=WATCH_QUEUE, always=True),
            Service(WATCH_STOP, WatchStopRequest, WatchStopReply, self.stop, watch_own_rule, queue=WATCH_QUEUE,
                    always=True),
            Service(WATCH_LIST, WatchListRequest, WatchListReply, self.list_own, watch_own_rule, queue=WATCH_QUEUE,
                    always=True),
        ]  # fmt: skip

    async def register(self, request: WatchRegisterRequest) -> WatchReply:
        """Record a watch for the signer. Raises LimitReached when it holds `limit` unexpired watches already."""
        asker = _signer()
        now = datetime.now(UTC)
        held = [w for w in await self._owned(asker.public_key) if not w.expired(now)]
        if len(held) >= self.limit:
            self.counts.over_limit += 1
            raise LimitReached(
                "watches per agent",
                self.limit,
                f"agent {asker.agent_id} holds {len(held)} watches",
                "stop one with `epibus watch stop ID` (`epibus watch list` shows them)",
            )
        (vector,) = await self.embedder.embed([request.about])
        record = WatchRecord(
            watch_id=uuid.uuid4().hex,
            owner_key=asker.public_key,
            agent_id=asker.agent_id,
            about=request.about,
            projects=sorted(set(request.projects)),
            kinds=sorted(set(request.kinds)) if request.kinds is not None else None,
            threshold=request.threshold,
            audit=request.audit,
            created_at=now,
            expires_at=watch_expiry(now, request.days),
            model_id=self.embedder.model_id,
            dimension=self.embedder.dimension,
            vector=[float(x) for x in vector],
            node=self.node,
        )
        kv = await self._bucket()
        async with nats_call("recording a watch"):
            await kv.create(watch_key(record.owner_key, record.watch_id), record.model_dump_json().encode())
        self.book.put(record, record.vector)  # matched here at once; other nodes read it from the bucket
        self.counts.registered += 1
        return WatchReply(node=self.node, watch=record.view())

    async def stop(self, request: WatchStopRequest) -> WatchStopReply:
        """Remove one of the signer's watches; another agent's id is answered as not found (its key is the
        signer's own, so no other agent's watch can be named)."""
        asker = _signer()
        key = watch_key(asker.public_key, request.watch_id)
        if not any(w.watch_id == request.watch_id for w in await self._owned(asker.public_key)):
            return WatchStopReply(node=self.node, stopped=False)
        kv = await self._bucket()
        async with nats_call("stopping a watch"):
            await kv.purge(key)
        self.book.remove(request.watch_id)
        self.counts.stopped += 1
        return WatchStopReply(node=self.node, stopped=True)

    async def list_own(self, request: WatchListRequest) -> WatchListReply:
        asker = _signer()
        owned = sorted(await self._owned(asker.public_key), key=lambda w: w.created_at)
        return WatchListReply(node=self.node, watches=[w.view() for w in owned], limit=self.limit)

    async def _owned(self, owner_key: str) -> list[WatchRecord]:
        """The owner's watches as the bucket holds them now (not as this node's book has caught up with them: a
        watch registered or stopped through another node a moment ago counts as it is)."""
        await self._bucket()
        js, stream = self._js(), kv_stream(WATCHES_BUCKET)
        found: list[WatchRecord] = []
        async with nats_call(f"the watches of {owner_key[:12]}"):
            info = await js.stream_info(stream, subjects_filter=kv_subject(WATCHES_BUCKET, watch_key(owner_key, "*")))
            for subject in sorted(info.state.subjects or {}):
                raw = await js.get_last_msg(stream, subject)
                record = self._record(subject, raw.headers, raw.data or b"", raw.seq)
                if record is not None:
                    found.append(record)
        return found

    async def follow(self) -> None:
        """Keep the book in step with the bucket, from its first record, until cancelled (a supervised loop:
        errors are ridden out by the follower, a record that cannot be read is quarantined and skipped)."""
        await self._bucket()
        bucket_subjects = kv_subject(WATCHES_BUCKET, ">")
        self.follower = StreamFollower(
            self._js(), kv_stream(WATCHES_BUCKET), bucket_subjects, start_seq=1, closed=self.closed
        )
        async for msg in self.follower.messages():
            await self.apply(msg)

    async def apply(self, msg: Msg) -> None:
        """One revision of the bucket: a record put, or a key removed."""
        key = msg.subject.removeprefix(kv_subject(WATCHES_BUCKET, ""))
        record = self._record(msg.subject, msg.headers, msg.data, msg.metadata.sequence.stream)
        if record is None:
            self.book.remove(key.partition(".")[2])
            return
        vector: Sequence[float] = record.vector
        if (record.model_id, record.dimension) != (self.embedder.model_id, self.embedder.dimension):
            (vector,) = await self.embedder.embed([record.about])
            self.counts.reembedded += 1
        self.book.put(record, vector)

    def _record(
        self, subject: str, headers: Mapping[str, str] | None, data: bytes, revision: int | None
    ) -> WatchRecord | None:
        """The record a revision holds; None for a removed key, or a record that cannot be read (quarantined)."""
        key = subject.removeprefix(kv_subject(WATCHES_BUCKET, ""))
        if (headers or {}).get(_KV_OPERATION) in _REMOVED:
            return None
        try:
            record = WatchRecord.model_validate_json(data)
            if watch_key(record.owner_key, record.watch_id) != key:
                raise ValueError(f"the record is of {watch_key(record.owner_key, record.watch_id)}")
        except ValueError as e:  # pydantic's ValidationError is one
            self.quarantine.add(MalformedRecord(WATCHES_BUCKET, key, revision, str(e).splitlines()[0]))
            return None
        return record


def _signer() -> Asker:
    asker = current_asker()
    if asker is None:  # the watch services apply their rules on every node: a request is always signed
        raise ConfigError("watch", "the request was not signed; an agent's client signs it with its key")
    return asker
