"""The agent registry: who each agent is (public key, owner, roles, projects), one record per agent in the
`epibus_agents` bucket. Every admission path reads it; only node services write it (an agent asks, the node
writes: the broker refuses agents' writes to the bucket).

On a server without authentication the first key seen for an agent is bound to it (trust on first use). A node
with authentication marks the registry closed: from then on an agent without an enrolment record is refused.

Each node also records its own key (`node.<key>`): what the node signs as its operator (identity `node`, e.g. a
coordinator it seats) is then verifiable by every reader, on every node."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from bus.broker.kv import compare_and_set, create_if_absent, read_entry
from bus.broker.nats_errors import JS_TIMEOUT_S, NATS_OR_API_ERROR, nats_call
from bus.broker.streams import open_bucket
from bus.enrolment.enrolment_view import EnrolmentView, enrolment_view
from bus.errors import Conflict, MalformedRecord, NotFound, Unavailable
from bus.identity.confinement import confined_key
from bus.identity.signing import NODE_IDENTITY
from bus.model.auth import NODE_PREFIX, Enrolment, first_use_enrolment
from bus.model.event import Actor
from bus.model.fields import AGENT_PATTERN
from bus.model.records import Quarantine, decode_enrolment
from bus.subjects import AGENT_KEYS_BUCKET, kv_stream, kv_subject, node_key_record

# Present once a node with authentication has run: agents must then be enrolled (no trust on first use).
ENROL_ATTEMPTS = 3
CLOSED_KEY = "policy.enrolment-required"


class AgentRegistry:
    """agent_id → Enrolment. `bind` is what admission asks; `enrol`/`revoke` are for node services. On a confined
    connection (an agent's, `bus.identity.confinement`) the reads go to a node's enrolment view: the agents it shares a
    project with, and the nodes."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._kv: KeyValue | None = None
        self._known: dict[str, str] = {}
        self._closed: bool | None = None
        self._node_keys: set[str] = set()
        self.quarantine = Quarantine("agent key registry")

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await open_bucket(self._js, AGENT_KEYS_BUCKET)
        return self._kv

    async def bind(self, actor: Actor) -> None:
        """Confirm the actor's key is the one its agent is enrolled with (on an open registry, bind it on first
        use). Raises Conflict (another key, no enrolment on a closed registry, or an unreadable record:
        quarantined, never trusted), Unavailable."""
        if self._known.get(actor.agent_id) == actor.public_key:
            return
        if actor.agent_id == NODE_IDENTITY and await self.is_node_key(actor.public_key):
            return
        view = self._view()
        if view is not None:
            bound = await self._served_key(view, actor)
        else:
            async with nats_call("agent key registry"):
                kv = await self._bucket()
                bound = await self._bound_key(kv, actor)
        if bound != actor.public_key:
            raise Conflict(
                f"agent {actor.agent_id}",
                f"it is registered with key {bound[:12]}…, this event is signed by {actor.public_key[:12]}…",
                fix=f"use the agent's original key (keys/{actor.agent_id}.nk) or another agent name",
            )
        self._known[actor.agent_id] = bound

    def _view(self) -> EnrolmentView | None:
        key = confined_key(self._js)
        return None if key is None else enrolment_view(self._js._nc, key)  # nats-py keeps its connection there

    async def _served_key(self, view: EnrolmentView, actor: Actor) -> str:
        found = await view.lookup(actor.agent_id)
        if found is None:
            raise Conflict(
                f"agent {actor.agent_id}",
                "it is not enrolled in a project this agent is a member of",
                fix=f"an admin enrols it: epibus agent add {actor.agent_id} --key {actor.public_key} --project P",
            )
        return found.public_key

    async def _bound_key(self, kv: KeyValue, actor: Actor) -> str:
        entry = await self._entry(kv, actor.agent_id)
        if entry is not None:
            return self._decode(entry.value or b"", actor.agent_id, entry.revision).public_key
        if await self._is_closed(kv):
            raise Conflict(
                f"agent {actor.agent_id}",
                "it is not enrolled on this fleet",
                fix=f"an admin enrols it: epibus agent add {actor.agent_id} --key {actor.public_key} --project P",
            )
        record = first_use_enrolment(actor.agent_id, actor.public_key, enrolled_at=datetime.now(UTC))
        what = f"agent {actor.agent_id}"
        if await create_if_absent(kv, actor.agent_id, record.model_dump_json().encode(), what=what) is not None:
            return actor.public_key
        entry = await kv.get(actor.agent_id)  # another node bound it first: its key is the one
        return self._decode(entry.value or b"", actor.agent_id, entry.revision).public_key

    async def _entry(self, kv: KeyValue, key: str) -> KeyValue.Entry | None:
        return await read_entry(kv, key)

    async def _is_closed(self, kv: KeyValue) -> bool:
        if self._closed is None or not self._closed:
            self._closed = await self._entry(kv, CLOSED_KEY) is not None
        return self._closed

    def _decode(self, data: bytes, agent_id: str, revision: int | None) -> Enrolment:
        try:
            return decode_enrolment(data, key=agent_id, revision=revision)
        except MalformedRecord as e:
            self.quarantine.add(e)
            raise Conflict(
                f"agent {agent_id}",
                f"its registered key is unreadable ({e.reason})",
                fix=f"nobody publishes as {agent_id} until an admin enrols it again (epibus agent add)",
            ) from e

    async def get(self, agent_id: str) -> Enrolment | None:
        """The agent's enrolment, or None (on a confined connection: also when it shares no project with this
        agent). An unreadable record raises Conflict. Raises Unavailable."""
        view = self._view()
        if view is not None:
            return await view.lookup(agent_id)
        async with nats_call("agent key registry"):
            entry = await self._entry(await self._bucket(), agent_id)
        return None if entry is None else self._decode(entry.value or b"", agent_id, entry.revision)

    async def require(self, agent_id: str) -> Enrolment:
        enrolment = await self.get(agent_id)
        if enrolment is None:
            raise NotFound("agent", agent_id)
        return enrolment

    async def enrolments(self) -> list[Enrolment]:
        """Every readable enrolment, revoked ones included; unreadable records are quarantined. On a confined
        connection, those of the agents it shares a project with."""
        view = self._view()
        if view is not None:
            await view.refresh()
            agents = dict.fromkeys(e.agent_id for _, e in view.records)  # those recorded on the stream
            return [e for agent in agents if (e := view.latest(agent)) is not None]
        found: list[Enrolment] = []
        async with nats_call("agent key registry"):
            kv = await self._bucket()
            # The keys from the stream's own state: nats-py's kv.keys() (a watcher) can come back short while
            # the bucket is written, and a short list here would drop enrolled agents from the server.
            prefix = kv_subject(AGENT_KEYS_BUCKET, "")
            info = await self._js.stream_info(kv_stream(AGENT_KEYS_BUCKET), subjects_filter=f"{prefix}>")
            keys = [subject.removeprefix(prefix) for subject in info.state.subjects or {}]
            for key in sorted(keys):
                if not AGENT_PATTERN.fullmatch(key):
                    continue  # policy records
                entry = await self._entry(kv, key)
                if entry is None:
                    continue
                try:
                    found.append(decode_enrolment(entry.value or b"", key=key, revision=entry.revision))
                except MalformedRecord as e:
                    self.quarantine.add(e)
        return found

    async def enrol(self, enrolment: Enrolment, *, replace_key: bool = False) -> Enrolment:
        """Write an enrolment (node services only). Enrolling an agent again with its key updates its owner,
        roles and projects; another key needs `replace_key` (an admin rotating it). A record another node wrote
        meanwhile is read again and the rules applied to it (a few times). Raises Conflict."""
        for attempt in range(ENROL_ATTEMPTS):
            try:
                return await self._enrol_once(enrolment, replace_key=replace_key)
            except Conflict as e:
                if not e.lost_race or attempt == ENROL_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")  # the loop returns or raises

    async def _enrol_once(self, enrolment: Enrolment, *, replace_key: bool) -> Enrolment:
        try:
            async with asyncio.timeout(JS_TIMEOUT_S):
                kv = await self._bucket()
                entry = await self._entry(kv, enrolment.agent_id)
                self._check_key(entry, enrolment, replace_key=replace_key)
                data = enrolment.model_dump_json().encode()
                last = None if entry is None else entry.revision
                await compare_and_set(kv, enrolment.agent_id, data, last=last, what=f"agent {enrolment.agent_id}")
        except MalformedRecord:
            await self._overwrite(enrolment)
        except NATS_OR_API_ERROR as e:
            raise Unavailable("nats", f"agent key registry: {type(e).__name__} {e}") from e
        self._known.pop(enrolment.agent_id, None)
        return enrolment

    async def enrol_if_absent(self, enrolment: Enrolment) -> Enrolment | None:
        """Create the agent's record only if it has none (never changes, re-keys or un-revokes one): the
        enrolment written, or None when the agent already had a record. Raises Unavailable."""
        try:
            async with asyncio.timeout(JS_TIMEOUT_S):
                kv = await self._bucket()
                data = enrolment.model_dump_json().encode()
                created = await create_if_absent(kv, enrolment.agent_id, data, what=f"agent {enrolment.agent_id}")
        except NATS_OR_API_ERROR as e:
            raise Unavailable("nats", f"agent key registry: {type(e).__name__} {e}") from e
        return None if created is None else enrolment

    async def check_enrol(self, enrolment: Enrolment, *, replace_key: bool = False) -> None:
        """Raise Conflict if `enrol` would refuse this enrolment (another key, without replace_key). Raises
        Unavailable."""
        try:
            async with asyncio.timeout(JS_TIMEOUT_S):
                entry = await self._entry(await self._bucket(), enrolment.agent_id)
                self._check_key(entry, enrolment, replace_key=replace_key)
        except MalformedRecord:
            return  # enrol overwrites an unreadable record
        except NATS_OR_API_ERROR as e:
            raise Unavailable("nats", f"agent key registry: {type(e).__name__} {e}") from e

    def _check_key(self, entry: KeyValue.Entry | None, enrolment: Enrolment, *, replace_key: bool) -> None:
        if entry is None:
            return
        current = decode_enrolment(entry.value or b"", key=enrolment.agent_id, revision=entry.revision)
        if current.kind != enrolment.kind and current.active:
            # A person's identity never becomes an agent's, not even by a new key: its reviews would pass to a key
            # kept in clear.
            raise Conflict(
                f"agent {enrolment.agent_id}",
                f"it is enrolled as {current.kind.value} and this enrolment makes it {enrolment.kind.value}",
                fix="revoke it first, or choose another name",
            )
        if replace_key:
            return
        if current.public_key != enrolment.public_key and current.active:
            raise Conflict(
                f"agent {enrolment.agent_id}",
                f"it is enrolled with key {current.public_key[:12]}…",
                fix="revoke it first, or enrol with --replace-key to rotate its key",
            )

    async def _overwrite(self, enrolment: Enrolment) -> None:
        async with nats_call("agent key registry"):
            await (await self._bucket()).put(enrolment.agent_id, enrolment.model_dump_json().encode())

    async def revoke(self, agent_id: str) -> Enrolment:
        """Mark the agent revoked: the broker drops it, its past events stay verifiable. Raises NotFound."""
        current = await self.require(agent_id)
        if not current.active:
            return current
        return await self.enrol(current.revoked(datetime.now(UTC)))

    async def is_node_key(self, public_key: str) -> bool:
        """Whether `public_key` is a node's own key (recorded by `register_node`). Raises Unavailable."""
        if public_key in self._node_keys:
            return True
        view = self._view()
        if view is not None:
            if public_key not in view.node_keys:
                await view.refresh()
            return public_key in view.node_keys
        async with nats_call("agent key registry"):
            found = await self._entry(await self._bucket(), node_key_record(public_key)) is not None
        if found:
            self._node_keys.add(public_key)
        return found

    async def register_node(self, public_key: str, name: str) -> None:
        """Record a node's own key (node services only, at start; idempotent)."""
        async with nats_call("agent key registry"):
            kv = await self._bucket()
            if await self._entry(kv, node_key_record(public_key)) is None:
                await kv.put(node_key_record(public_key), name.encode())
        self._node_keys.add(public_key)

    async def node_identities(self) -> tuple[list[Enrolment], list[str]]:
        """The nodes' own enrolments (their record-signing identities) and keys (`register_node`): what every
        agent may see of the registry. Raises Unavailable."""
        nodes = [e for e in await self.enrolments() if e.agent_id.startswith(NODE_PREFIX)]
        prefix = kv_subject(AGENT_KEYS_BUCKET, node_key_record(""))
        async with nats_call("agent key registry"):
            await self._bucket()
            info = await self._js.stream_info(kv_stream(AGENT_KEYS_BUCKET), subjects_filter=f"{prefix}*")
        return nodes, sorted(subject.removeprefix(prefix) for subject in info.state.subjects or {})

    async def is_closed(self) -> bool:
        """Whether only enrolled agents are admitted (a node with authentication has run). Raises Unavailable."""
        if self._view() is not None:
            return True  # a confined connection is an agent's on a node with authentication
        async with nats_call("agent key registry"):
            return await self._is_closed(await self._bucket())

    async def close(self) -> None:
        """From now on only enrolled agents are admitted (idempotent)."""
        async with nats_call("agent key registry"):
            kv = await self._bucket()
            if await self._entry(kv, CLOSED_KEY) is None:
                await kv.put(CLOSED_KEY, b"1")
        self._closed = True
