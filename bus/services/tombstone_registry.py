"""The tombstones bucket, read and written: the node records a tombstone when a claim is retracted or rolled
back; a client checks the claims it is about to publish. A confined agent checks through a node
(`epibus.tombstones.check`): the bucket's keys are every project's content hashes."""

from __future__ import annotations

import json

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from bus.broker.ask import Refused, ask_one
from bus.broker.nats_errors import JS_TIMEOUT_S, nats_call
from bus.broker.streams import open_bucket
from bus.enrolment.service_rules import tombstone_check_rule
from bus.errors import MalformedRecord, Unavailable
from bus.identity.confinement import confined_key
from bus.model.records import Quarantine
from bus.model.requests import MAX_HASHES, TombstoneCheckReply, TombstoneCheckRequest
from bus.model.tombstones import Tombstone, decode_tombstone_key, tombstone_key
from bus.services.responder import Service
from bus.subjects import TOMBSTONE_CHECK, TOMBSTONE_QUEUE, TOMBSTONES_BUCKET, kv_stream, kv_subject


class TombstoneRegistry:
    """Content hashes of retracted and rolled-back claims per project, in a KV bucket `<project>.<hash>`."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._kv: KeyValue | None = None
        self.quarantine = Quarantine("tombstone registry")

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await open_bucket(self._js, TOMBSTONES_BUCKET)
        return self._kv

    async def hashes(self, project: str, *, timeout_s: float = JS_TIMEOUT_S) -> set[str]:
        """Every tombstoned content hash of a project, in one request (the keys of the KV stream). A key that
        is not `<project>.<content hash>` is quarantined and left out: it can flag or refuse nothing."""
        async with nats_call(f"tombstones of {project}", timeout_s=timeout_s):
            await self._bucket()
            info = await self._js.stream_info(
                kv_stream(TOMBSTONES_BUCKET), subjects_filter=kv_subject(TOMBSTONES_BUCKET, f"{project}.>")
            )
        found: set[str] = set()
        for subject in info.state.subjects or {}:
            try:
                found.add(decode_tombstone_key(subject, project=project))
            except MalformedRecord as e:
                self.quarantine.add(e)
        return found

    async def tombstoned(self, project: str, digests: set[str], *, timeout_s: float = JS_TIMEOUT_S) -> set[str]:
        """Which of `digests` are tombstoned in `project`. A confined agent asks a node (it may not list the
        bucket: its keys are every project's hashes), a chunk at a time; others read the keys. Raises
        Unavailable, Forbidden (not a member of the project)."""
        key = confined_key(self._js)
        if key is None:
            return digests & await self.hashes(project, timeout_s=timeout_s)
        found: set[str] = set()
        ordered = sorted(digests)
        for start in range(0, len(ordered), MAX_HASHES):
            request = TombstoneCheckRequest(project=project, hashes=ordered[start : start + MAX_HASHES])
            try:
                reply = await ask_one(
                    self._js._nc, TOMBSTONE_CHECK, request, TombstoneCheckReply, signer=key, timeout_s=timeout_s
                )
            except Refused as e:  # the node answered that it could not read the bucket: not checked, not refused
                raise Unavailable("epibus node", f"tombstones of {project} not checked: {e}") from e
            found |= digests & set(reply.tombstoned)  # a node names only what was asked
        return found

    def service(self, *, node: str) -> Service[TombstoneCheckRequest]:
        """The node's side of `tombstoned`: answered from the bucket's keys by one node of the queue group."""

        async def answer(request: TombstoneCheckRequest) -> TombstoneCheckReply:
            held = await self.hashes(request.project)
            return TombstoneCheckReply(node=node, tombstoned=sorted(held & set(request.hashes)))

        return Service(
            TOMBSTONE_CHECK,
            TombstoneCheckRequest,
            TombstoneCheckReply,
            answer,
            tombstone_check_rule,
            queue=TOMBSTONE_QUEUE,
        )

    async def record(self, project: str, tombstone: Tombstone) -> None:
        value = json.dumps(
            {"artifact_id": tombstone.artifact_id, "event_id": tombstone.event_id, "reason": tombstone.reason}
        ).encode()
        async with nats_call("recording a tombstone"):
            kv = await self._bucket()
            await kv.put(tombstone_key(project, tombstone.content_hash), value)
