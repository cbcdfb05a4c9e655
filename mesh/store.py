"""Mesh state in one JetStream KV bucket: tasks, each project's coordinators and the
capabilities agents advertise. Only a node writes it (mesh.service; the broker refuses agents' writes), every
write compare-and-set on the key's revision, so two coordinators (or a retried message) cannot both apply a
decision. Every read is verified (mesh.trust): what is not trustworthy is quarantined, never returned. The one
choke point from nats-py KV errors to epibus errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from bus.broker.kv import compare_and_set, read_entry
from bus.broker.nats_errors import JS_TIMEOUT_S, nats_call
from bus.broker.streams import open_bucket
from bus.enrolment.registry import AgentRegistry
from bus.errors import Conflict, MalformedRecord, NotFound
from bus.intake.stream_read import read_stream
from bus.model.auth import ANY_PROJECT
from bus.model.records import Quarantine, decode_json
from bus.subjects import (
    MESH_BUCKET,
    MESH_STREAM,
    capabilities_key,
    kv_subject,
    kv_subject_key,
    roster_key,
    task_key,
    tasks_key_filter,
)
from mesh.protocol import counter_record
from mesh.task import AgentCapabilities, Roster, Step, TaskRecord
from mesh.trust import UntrustedRecord, extends, verify_capabilities, verify_roster, verify_task
from mesh.verified import Verified, VerifiedTasks, roster_used
from mesh.vocab import TaskState

__all__ = ["AgentCapabilities", "MeshStore", "Roster", "RosterEntry", "TaskEntry"]

T = TypeVar("T")
# KV keeps this many revisions per key: every step of a task stays readable by a watcher that was away.
KV_OPERATION = "KV-Operation"
ROSTER_FRESH_S = 2.0  # a verified roster judges the tasks read this soon after it (they need no newer one)
# A roster read again unchanged is verified again this long after it last was (the registry it is judged by,
# an admin's enrolment or a registry closed to first use, can change without the roster changing).
ROSTER_REVERIFY_S = 2.0


@dataclass(frozen=True)
class TaskEntry:
    """A task record and the KV revision (stream sequence) that holds it."""

    record: TaskRecord
    revision: int

    def summary(self, why: str | None = None) -> dict[str, Any]:
        """The task as one flat JSON object (what listings show), with why it is listed when given."""
        record = self.record
        step = record.last_step
        return {
            "task_id": record.task_id,
            "project": record.proposal.project,
            "state": record.state.value,
            "title": record.proposal.title,
            "category": record.proposal.category.value,
            "proposer": record.proposal.proposer,
            "assignee": record.assignee,
            "deadline": record.proposal.deadline.isoformat() if record.proposal.deadline else None,
            "last_action": step.action.value,
            "last_actor": step.actor,
            "updated_at": step.at.isoformat(),
            "revision": self.revision,
            "sha": record.completion.sha if record.completion else None,
            **({"why": why} if why is not None else {}),
        }


@dataclass(frozen=True)
class RosterEntry:
    roster: Roster
    revision: int  # 0: no roster written yet


@dataclass(frozen=True)
class _KnownRoster:
    entry: RosterEntry
    data: bytes
    read_at: float  # monotonic
    verified_at: float


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
        projects: Sequence[str] | None = None,
    ) -> None:
        self.js = js
        # The projects a confined agent may read (the broker and the node refuse the rest); None: every one.
        self.projects = self.readable(projects)
        self.replicas = replicas
        self.create = create  # False: a reader that must not create the bucket (NotFound instead)
        self.timeout_s = timeout_s
        self.quarantine = Quarantine("mesh store")
        self.registry = AgentRegistry(js)
        self._kv: KeyValue | None = None
        self._rosters: dict[str, _KnownRoster] = {}
        self.verified = VerifiedTasks()

    @staticmethod
    def readable(projects: Sequence[str] | None) -> tuple[str, ...] | None:
        return None if projects is None or ANY_PROJECT in projects else tuple(sorted(set(projects)))

    def _answering(self, what: str) -> AbstractAsyncContextManager[None]:
        return nats_call(f"mesh bucket, {what}", timeout_s=self.timeout_s)

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
            entry = await read_entry(kv, key)
        if entry is None or entry.revision is None:  # read_entry raised for a missing revision: mypy cannot see it
            return None
        return entry.value or b"", entry.revision

    async def _write(self, key: str, value: bytes, *, last: int) -> int:
        """Compare-and-set: `last=0` creates. Raises Conflict when another write got there first."""
        kv = await self.bucket()
        async with self._answering(f"write {key}"):
            return await compare_and_set(kv, key, value, last=last, what=f"mesh key {key}")

    # -- tasks -----------------------------------------------------------------------------------------

    async def get_task(self, project: str, task_id: str) -> TaskEntry | None:
        """Raises MalformedRecord (quarantined) when the task's record cannot be understood or trusted."""
        key = task_key(project, task_id)
        found = await self._get(key)
        if found is None:
            return None
        return await self.task_entry(found[0], key=key, revision=found[1])

    async def task_entry(self, data: bytes, *, key: str, revision: int) -> TaskEntry:
        """`verified_task`, quarantining what it raises."""
        try:
            return await self.verified_task(data, key=key, revision=revision)
        except MalformedRecord as e:
            self.quarantine.add(e)
            raise

    async def verified_task(self, data: bytes, *, key: str, revision: int) -> TaskEntry:
        """A task record as the bucket holds it, decoded and verified. Raises MalformedRecord or
        UntrustedRecord. Only what this store has not verified yet is checked (mesh.verified)."""
        known = self.verified.get(key)
        same = known is not None and known.data == data
        record = known.record if known is not None and same else decode_task(data, key=key, revision=revision)
        needed = max(step.roster_version for step in record.steps)
        roster = await self._roster_for(record.proposal.project, needed, key=key, revision=revision)
        basis = known.record if known is not None and known.judged_by(roster) else None
        if not (same and basis is not None):
            await verify_task(record, roster, self.registry, key=key, revision=revision, verified=basis)
        self.verified.add(key, Verified(revision, data, record, roster_used(record, roster)))
        return TaskEntry(record, revision)

    def known_task(self, project: str, task_id: str, roster: Roster | None = None) -> TaskEntry | None:
        """The newest revision of the task this store has verified, without reading the bucket: a basis to
        decide on, which the node's compare-and-set refuses if it is no longer current. With `roster`, only
        if it was verified against that roster's changes."""
        known = self.verified.get(task_key(project, task_id))
        if known is None or (roster is not None and not known.judged_by(roster)):
            return None
        return TaskEntry(known.record, known.revision)

    def known_roster(self, project: str) -> RosterEntry | None:
        """The project's verified roster if it was read moments ago (ROSTER_FRESH_S), without reading."""
        known = self._rosters.get(project)
        if known is None or time.monotonic() - known.read_at >= ROSTER_FRESH_S:
            return None
        return known.entry

    async def _roster_for(self, project: str, needed: int, *, key: str, revision: int) -> Roster:
        """The verified roster to judge a task by: one read moments ago will do unless the task needs a newer
        version. A roster that is not trustworthy makes every task judged by it untrustworthy."""
        cached = self._rosters.get(project)
        if (
            cached is not None
            and cached.entry.roster.version >= needed
            and time.monotonic() - cached.read_at < ROSTER_FRESH_S
        ):
            return cached.entry.roster
        try:
            return (await self.get_roster(project)).roster
        except MalformedRecord as e:
            raise UntrustedRecord(
                MESH_BUCKET, key, revision, f"the roster of project {project} it is judged by is not: {e.reason}"
            ) from e

    async def write_task(self, record: TaskRecord, *, last: int) -> int:
        """Node services only (the broker refuses agents' writes)."""
        key = task_key(record.proposal.project, record.task_id)
        return await self._write(key, record.model_dump_json().encode(), last=last)

    async def write_made_task(self, record: TaskRecord, roster: Roster, *, last: int) -> int:
        """`write_task` for a record `made` by this process (see `made`), remembered as verified."""
        key = task_key(record.proposal.project, record.task_id)
        data = record.model_dump_json().encode()
        revision = await self._write(key, data, last=last)
        self.made(record, data, revision=revision, roster=roster)
        return revision

    def made(self, record: TaskRecord, data: bytes, *, revision: int, roster: Roster) -> None:
        """Remember as verified a record this process made: `advance` applied to the revision it holds verified
        (judged by `roster`, which the new step was judged by too) and the new step signed by its sender's
        registered key (the agent signed it; the node checked that signature). Such a record passes
        mesh.trust.verify_task by construction, so the next step decides on it without reading it back. Made
        from anything else (no verified basis, another roster), it is not remembered: read, it is verified."""
        key = task_key(record.proposal.project, record.task_id)
        if len(record.steps) > 1:
            basis = self.verified.get(key)
            if basis is None or len(basis.record.steps) != len(record.steps) - 1 or not extends(record, basis.record):
                return
            if not basis.judged_by(roster):
                return
        if record.last_step.roster_version != roster.version:
            return
        self.verified.add(key, Verified(revision, data, record, roster_used(record, roster)))

    async def find_task(self, task_id: str) -> TaskEntry | None:
        """A task by id in whatever project holds it. Raises Conflict when several projects hold that id
        (ids chosen by hand can repeat): name the project then."""
        await self.bucket()
        unreadable: list[MalformedRecord] = []
        messages: list[Msg] = []
        for project in self.projects or ["*"]:
            subject = kv_subject(MESH_BUCKET, task_key(project, task_id))
            messages += await self._current(subject, f"find task {task_id}")
        found = await self._decoded(messages, unreadable)
        if not found and unreadable:
            raise unreadable[0]
        if len(found) > 1:
            projects = sorted(e.record.proposal.project for e in found)
            raise Conflict(f"task id {task_id}", f"projects {projects} each hold one", fix="name the project (-p)")
        return found[0] if found else None

    async def tasks(self, project: str | None = None) -> list[TaskEntry]:
        """The current record of every task (of one project, or all); records that cannot be understood or
        trusted are left out and quarantined (`self.quarantine`)."""
        await self.bucket()
        messages: list[Msg] = []
        for one in [project] if project is not None or self.projects is None else self.projects:
            messages += await self._current(tasks_key_filter(one), "list tasks")
        return await self._decoded(messages, [])

    async def _decoded(self, messages: list[Msg], unreadable: list[MalformedRecord]) -> list[TaskEntry]:
        entries: list[TaskEntry] = []
        for msg in messages:
            try:
                entries.append(
                    await self.task_entry(
                        msg.data, key=kv_subject_key(msg.subject), revision=msg.metadata.sequence.stream
                    )
                )
            except MalformedRecord as e:
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
        """The project's verified roster (revision 0: none written yet). Raises MalformedRecord or
        UntrustedRecord (quarantined): never read as "no coordinators", which would let anyone seat the first."""
        key = roster_key(project)
        found = await self._get(key)
        now = time.monotonic()
        known = self._rosters.get(project)
        verified_at = now
        if found is None:
            entry, data = RosterEntry(Roster(project=project), 0), b""
        elif (
            known is not None
            and (known.entry.revision, known.data) == (found[1], found[0])
            and now - known.verified_at < ROSTER_REVERIFY_S
        ):
            entry, data, verified_at = known.entry, known.data, known.verified_at
        else:
            data = found[0]
            try:
                roster = decode_roster(data, key=key, revision=found[1])
                await verify_roster(roster, self.registry, key=key, revision=found[1])
            except MalformedRecord as e:
                self.quarantine.add(e)
                self._rosters.pop(project, None)  # nothing is judged by a roster read before it was replaced
                raise
            entry = RosterEntry(roster, found[1])
        self._rosters[project] = _KnownRoster(entry, data, now, verified_at)
        return entry

    async def write_roster(self, roster: Roster, *, last: int) -> int:
        """Node services only."""
        return await self._write(roster_key(roster.project), roster.model_dump_json().encode(), last=last)

    async def get_capabilities(self, agent: str) -> AgentCapabilities | None:
        key = capabilities_key(agent)
        found = await self._get(key)
        if found is None:
            return None
        try:
            advertised = decode_capabilities(found[0], key=key, revision=found[1])
            await verify_capabilities(advertised, self.registry, key=key, revision=found[1])
        except MalformedRecord as e:
            self.quarantine.add(e)
            raise
        return advertised

    async def set_capabilities(self, advertised: AgentCapabilities) -> int:
        """Node services only."""
        kv = await self.bucket()
        key = capabilities_key(advertised.agent)
        async with self._answering(f"put {key}"):
            return await kv.put(key, advertised.model_dump_json().encode())

    async def all_capabilities(self) -> dict[str, tuple[str, ...]]:
        await self.bucket()
        found: dict[str, tuple[str, ...]] = {}
        for msg in await self._current(kv_subject(MESH_BUCKET, capabilities_key("*")), "list capabilities"):
            key, revision = kv_subject_key(msg.subject), msg.metadata.sequence.stream
            try:
                advertised = decode_capabilities(msg.data, key=key, revision=revision)
                await verify_capabilities(advertised, self.registry, key=key, revision=revision)
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
