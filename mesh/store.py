"""Mesh state in one JetStream KV bucket: tasks, each project's coordinators and the
capabilities agents advertise. Every write is compare-and-set on the key's revision, so two coordinators (or a
retried message) cannot both apply a decision. The one choke point from nats-py KV errors to epibus errors."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from pydantic import AwareDatetime

from bus.errors import Conflict, MalformedRecord, NotFound, Unavailable
from bus.event import AgentId, Model, ProjectSlug
from bus.jetstream import JS_TIMEOUT_S, NATS_OR_API_ERROR, open_bucket
from bus.reader import read_stream
from bus.records import Quarantine, decode_json
from bus.subjects import (
    MESH_BUCKET,
    MESH_STREAM,
    capabilities_key,
    kv_subject_key,
    roster_key,
    task_key,
    tasks_key_filter,
)
from bus.vocab import TaskState
from mesh.protocol import counter_record
from mesh.task import Capability, Step, TaskRecord

T = TypeVar("T")
# KV keeps this many revisions per key: every step of a task stays readable by a watcher that was away.
KV_OPERATION = "KV-Operation"


class Roster(Model):
    """A project's coordinators and the message ids that changed them (so a retried change applies once)."""

    project: ProjectSlug
    coordinators: tuple[AgentId, ...] = ()
    applied: tuple[uuid.UUID, ...] = ()


class AgentCapabilities(Model):
    agent: AgentId
    capabilities: tuple[Capability, ...]
    updated_at: AwareDatetime


@dataclass(frozen=True)
class TaskEntry:
    """A task record and the KV revision (stream sequence) that holds it."""

    record: TaskRecord
    revision: int


@dataclass(frozen=True)
class RosterEntry:
    roster: Roster
    revision: int  # 0: no roster written yet


def decode_task(data: bytes, *, key: str, revision: int | None) -> TaskRecord:
    """The task record the bucket holds under `key`. Raises MalformedRecord for anything else, and for a record
    that parses but cannot be true: a state its last step did not reach, steps that do not follow each other,
    or a task that belongs under another key."""
    record = decode_json(TaskRecord, data, bucket=MESH_BUCKET, key=key, revision=revision)
    expected = task_key(record.proposal.project, record.task_id)
    if key != expected:
        raise MalformedRecord(MESH_BUCKET, key, revision, f"holds a task that belongs under {expected}")
    before: TaskState | None = None
    for number, step in enumerate(record.steps, start=1):
        if step.from_state != before:
            moved = f"moves from {step.from_state or 'nothing'}, but the task was {before or 'absent'}"
            raise MalformedRecord(MESH_BUCKET, key, revision, f"step {number} {moved}")
        before = step.to_state
    if record.state != before:
        raise MalformedRecord(MESH_BUCKET, key, revision, f"says {record.state}, but its last step reached {before}")
    return record


def decode_roster(data: bytes, *, key: str, revision: int | None) -> Roster:
    """A project's coordinators as the bucket holds them under `key`. Raises MalformedRecord."""
    roster = decode_json(Roster, data, bucket=MESH_BUCKET, key=key, revision=revision)
    if key != roster_key(roster.project):
        raise MalformedRecord(
            MESH_BUCKET, key, revision, f"holds a roster that belongs under {roster_key(roster.project)}"
        )
    return roster


def decode_capabilities(data: bytes, *, key: str, revision: int | None) -> AgentCapabilities:
    """What an agent advertises, as the bucket holds it under `key`. Raises MalformedRecord."""
    advertised = decode_json(AgentCapabilities, data, bucket=MESH_BUCKET, key=key, revision=revision)
    expected = capabilities_key(advertised.agent)
    if key != expected:
        raise MalformedRecord(MESH_BUCKET, key, revision, f"holds a capabilities record that belongs under {expected}")
    return advertised


def is_value(msg: Msg) -> bool:
    """False for KV delete/purge markers."""
    return not (msg.headers and msg.headers.get(KV_OPERATION) in ("DEL", "PURGE"))


class MeshStore:
    """The mesh bucket, created on first use. `replicas`: None keeps an existing bucket's replicas."""

    def __init__(
        self,
        js: JetStreamContext,
        *,
        replicas: int | None = None,
        timeout_s: float = JS_TIMEOUT_S,
        create: bool = True,
    ) -> None:
        self.js = js
        self.replicas = replicas
        self.create = create  # False: a reader that must not create the bucket (NotFound instead)
        self.timeout_s = timeout_s
        self.quarantine = Quarantine("mesh store")
        self._kv: KeyValue | None = None

    @asynccontextmanager
    async def _answering(self, what: str) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self.timeout_s):
                yield
        except NATS_OR_API_ERROR as e:
            raise Unavailable("nats", f"mesh bucket, {what}: {type(e).__name__} {e}".strip()) from e

    async def bucket(self) -> KeyValue:
        if self._kv is None:
            async with self._answering("open"):
                try:
                    self._kv = await open_bucket(self.js, MESH_BUCKET, replicas=self.replicas, create=self.create)
                except nats.js.errors.BucketNotFoundError:
                    raise NotFound("mesh bucket", MESH_BUCKET, "nobody has used the mesh on this bus yet") from None
        return self._kv

    async def _get(self, key: str) -> tuple[bytes, int] | None:
        kv = await self.bucket()
        async with self._answering(f"get {key}"):
            try:
                entry = await kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return None
        if entry.revision is None:
            raise Unavailable("nats", f"mesh bucket, get {key}: the answer carried no revision")
        return entry.value or b"", entry.revision

    async def _write(self, key: str, value: bytes, *, last: int) -> int:
        """Compare-and-set: `last=0` creates. Raises Conflict when another write got there first."""
        kv = await self.bucket()
        async with self._answering(f"write {key}"):
            try:
                return await kv.update(key, value, last=last)
            except nats.js.errors.KeyWrongLastSequenceError as e:
                raise Conflict(
                    f"mesh key {key}", f"revision {last} is no longer current ({e.description})", lost_race=True
                ) from e

    # -- tasks -----------------------------------------------------------------------------------------

    async def get_task(self, project: str, task_id: str) -> TaskEntry | None:
        """Raises MalformedRecord (quarantined) when the task's record cannot be understood."""
        key = task_key(project, task_id)
        found = await self._get(key)
        if found is None:
            return None
        try:
            return TaskEntry(decode_task(found[0], key=key, revision=found[1]), found[1])
        except MalformedRecord as e:
            self.quarantine.add(e)
            raise

    async def write_task(self, record: TaskRecord, *, last: int) -> int:
        key = task_key(record.proposal.project, record.task_id)
        return await self._write(key, record.model_dump_json().encode(), last=last)

    async def find_task(self, task_id: str) -> TaskEntry | None:
        """A task by id in whatever project holds it. Raises Conflict when several projects hold that id
        (ids chosen by hand can repeat): name the project then."""
        await self.bucket()
        subject = tasks_key_filter().removesuffix("*") + task_id
        unreadable: list[MalformedRecord] = []
        found = self._decoded(await self._current(subject, f"find task {task_id}"), unreadable)
        if not found and unreadable:
            raise unreadable[0]
        if len(found) > 1:
            projects = sorted(e.record.proposal.project for e in found)
            raise Conflict(f"task id {task_id}", f"projects {projects} each hold one", fix="name the project (-p)")
        return found[0] if found else None

    async def tasks(self, project: str | None = None) -> list[TaskEntry]:
        """The current record of every task (of one project, or all); records that cannot be understood are
        left out and quarantined (`self.quarantine`)."""
        await self.bucket()
        return self._decoded(await self._current(tasks_key_filter(project), "list tasks"), [])

    def _decoded(self, messages: list[Msg], unreadable: list[MalformedRecord]) -> list[TaskEntry]:
        entries: list[TaskEntry] = []
        for msg in messages:
            revision = msg.metadata.sequence.stream
            try:
                entries.append(
                    TaskEntry(decode_task(msg.data, key=kv_subject_key(msg.subject), revision=revision), revision)
                )
            except MalformedRecord as e:
                self.quarantine.add(e)
                unreadable.append(e)
        return entries

    async def _current(self, subject_filter: str, what: str) -> list[Msg]:
        """The newest value of every key matching the filter (keys whose newest message deletes them left
        out). A last-per-subject consumer also delivers writes made while it reads: the newest one wins."""
        await self.bucket()
        newest: dict[str, Msg] = {}
        async with self._answering(what):
            async for batch in read_stream(self.js, MESH_STREAM, filter_subject=subject_filter, last_per_subject=True):
                for msg in batch:
                    seen = newest.get(msg.subject)
                    if seen is None or seen.metadata.sequence.stream < msg.metadata.sequence.stream:
                        newest[msg.subject] = msg
        return sorted((m for m in newest.values() if is_value(m)), key=lambda m: m.metadata.sequence.stream)

    # -- coordinators and capabilities -----------------------------------------------------------------

    async def get_roster(self, project: str) -> RosterEntry:
        key = roster_key(project)
        found = await self._get(key)
        if found is None:
            return RosterEntry(Roster(project=project), 0)
        try:
            return RosterEntry(decode_roster(found[0], key=key, revision=found[1]), found[1])
        except MalformedRecord as e:  # never read as "no coordinators": anyone may add the first one
            self.quarantine.add(e)
            raise

    async def write_roster(self, roster: Roster, *, last: int) -> int:
        return await self._write(roster_key(roster.project), roster.model_dump_json().encode(), last=last)

    async def get_capabilities(self, agent: str) -> AgentCapabilities | None:
        key = capabilities_key(agent)
        found = await self._get(key)
        if found is None:
            return None
        try:
            return decode_capabilities(found[0], key=key, revision=found[1])
        except MalformedRecord as e:
            self.quarantine.add(e)
            raise

    async def set_capabilities(self, advertised: AgentCapabilities) -> None:
        kv = await self.bucket()
        key = capabilities_key(advertised.agent)
        async with self._answering(f"put {key}"):
            await kv.put(key, advertised.model_dump_json().encode())

    async def all_capabilities(self) -> dict[str, tuple[str, ...]]:
        await self.bucket()
        found: dict[str, tuple[str, ...]] = {}
        for msg in await self._current(f"$KV.{MESH_BUCKET}.{capabilities_key('*')}", "list capabilities"):
            key, revision = kv_subject_key(msg.subject), msg.metadata.sequence.stream
            try:
                advertised = decode_capabilities(msg.data, key=key, revision=revision)
            except MalformedRecord as e:
                self.quarantine.add(e)
                continue
            found[advertised.agent] = advertised.capabilities
        return found


async def ensure_counter_task(store: MeshStore, change: Step) -> TaskRecord:
    """Create the counter-proposal task a `change` step describes, unless it exists (idempotent)."""
    child = counter_record(change)
    try:
        await store.write_task(child, last=0)
    except Conflict:
        existing = await store.get_task(child.proposal.project, child.task_id)
        if existing is None or existing.record.steps[0].message_id != child.steps[0].message_id:
            raise
        return existing.record
    return child


async def retry_on_conflict(attempt: Callable[[], Awaitable[T]], *, what: str, attempts: int = 8) -> T:
    """Re-run a read-decide-write `attempt` when its compare-and-set lost a race: each run re-reads, so the
    loser re-decides against the winner's state (never a blind retry of the same write)."""
    for _ in range(attempts - 1):
        try:
            return await attempt()
        except Conflict as e:
            if not e.lost_race:
                raise
            await asyncio.sleep(0)
    try:
        return await attempt()
    except Conflict as e:
        if not e.lost_race:
            raise
        raise Conflict(what, f"still contended after {attempts} attempts ({e.detail})") from e


def utc_now() -> datetime:
    return datetime.now(UTC)
