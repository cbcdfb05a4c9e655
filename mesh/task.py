"""The mesh's data: proposals, protocol messages, the steps a task went through and the task record the KV
bucket holds. Frozen pydantic models with extra="forbid"; the rules that move a task live in mesh.protocol."""

from __future__ import annotations

import hashlib
import re
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, Field, JsonValue, StringConstraints, ValidationError, field_validator

from bus.errors import InvalidEvent
from bus.model.event import canonical_json, invalid_event_of
from bus.model.fields import AgentId, ProjectSlug, PublicKey, ShortText, Text
from bus.model.kinds import Evidence, Model
from mesh.vocab import ActionCategory, MeshRole, TaskAction, TaskState

TASK_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TaskId = Annotated[str, StringConstraints(pattern=TASK_ID_PATTERN.pattern)]
Capability = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.:-]{0,63}$")]
# A git object id: SHA-1 (40) or SHA-256 (64), lowercase hex, as `git rev-parse` prints it.
CommitSha = Annotated[str, StringConstraints(pattern=r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")]
SHA_RULE = "must be a commit SHA: 40 or 64 lowercase hex characters"
Signature = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{86}$")]  # ed25519, base64url unpadded
SessionId = Annotated[str, StringConstraints(min_length=1, max_length=128)]
Digest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
MAX_PAYLOAD_KEYS = 64


class Targets(Model):
    """Who the work is for: named agents and/or the capabilities the assignee must have. Both empty means
    the coordinator chooses."""

    agents: tuple[AgentId, ...] = ()
    capabilities: tuple[Capability, ...] = ()


class Proposal(Model):
    task_id: TaskId
    project: ProjectSlug
    title: ShortText
    summary: Text
    proposer: AgentId
    targets: Targets = Targets()
    category: ActionCategory
    deadline: AwareDatetime | None = None
    parent_id: TaskId | None = None
    payload: dict[str, JsonValue] = Field(default_factory=dict, max_length=MAX_PAYLOAD_KEYS)

    @field_validator("deadline")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        return None if value is None else value.astimezone(UTC)


class Completion(Model):
    sha: CommitSha
    evidence: tuple[Evidence, ...] = ()
    note: Text | None = None


class Message(Model):
    """One protocol message. `message_id` (a UUIDv7) makes retries idempotent: the same id twice gives the
    same outcome and one event."""

    message_id: uuid.UUID
    action: TaskAction
    project: ProjectSlug
    task_id: TaskId
    sender: AgentId
    proposal: Proposal | None = None  # propose: the proposal; change: the counter-proposal
    assignee: AgentId | None = None  # accept
    reason: Text | None = None  # decline, fail, cancel, expire
    completion: Completion | None = None  # complete
    policy: ShortText | None = None  # a decision: which policy made it ("manual" for a person)

    @field_validator("message_id")
    @classmethod
    def _uuid7(cls, value: uuid.UUID) -> uuid.UUID:
        if value.version != 7:
            raise ValueError(f"must be a UUIDv7, got version {value.version}")
        return value


class Step(Model):
    """One applied message, kept in the task's history: the audit of who did what, when, and why."""

    message_id: uuid.UUID
    action: TaskAction
    actor: AgentId
    roles: tuple[MeshRole, ...]
    from_state: TaskState | None
    to_state: TaskState
    at: AwareDatetime
    # The project's roster as it was judged against: its first `roster_version` changes (mesh.store.Roster).
    roster_version: Annotated[int, Field(ge=0, strict=True)] = 0
    assignee: AgentId | None = None
    reason: Text | None = None
    completion: Completion | None = None
    policy: ShortText | None = None
    child_id: TaskId | None = None
    counter: Proposal | None = None  # change: the counter-proposal the child task carries
    counter_opening: Step | None = None  # change: the child's first step, signed, so anyone can create it
    # The step's event, signed by its actor (mesh.events.step_event rebuilds it): any node can publish it, and
    # nobody without the actor's key can forge a step that a recorder would publish.
    public_key: PublicKey | None = None
    session_id: SessionId | None = None
    signature: Signature | None = None
    digest: Digest | None = None  # of the message


class TaskRecord(Model):
    """A task as the mesh bucket holds it: the proposal, where it stands, and every step that got it there."""

    proposal: Proposal
    state: TaskState
    assignee: AgentId | None = None
    decided_by: AgentId | None = None
    decided_policy: ShortText | None = None
    completion: Completion | None = None
    reason: Text | None = None
    child_id: TaskId | None = None
    steps: tuple[Step, ...] = Field(min_length=1)  # the proposal at least: a task exists from its first step

    @property
    def task_id(self) -> str:
        return self.proposal.task_id

    def step_for(self, message_id: uuid.UUID) -> Step | None:
        return next((s for s in self.steps if s.message_id == message_id), None)

    @property
    def last_step(self) -> Step:
        return self.steps[-1]


MAX_ROSTER_CHANGES = 1000  # a project's roster keeps every change (readers judge steps against any of them)


class RosterDraft(Model):
    """One change of a project's coordinators, before it is signed."""

    message_id: uuid.UUID
    change: Literal["add", "remove"]
    agent: AgentId
    coordinators: tuple[AgentId, ...]  # after this change
    actor: AgentId
    at: AwareDatetime


class RosterChange(RosterDraft):
    """A change signed by whoever made it: the signature is that of the change's `coordinators` event
    (mesh.events.roster_event rebuilds it), which names the coordinators after it."""

    public_key: PublicKey
    session_id: SessionId
    signature: Signature


class Roster(Model):
    """A project's coordinators: every change that made them, in order (append-only). A step records how many
    of these changes it was judged against (`Step.roster_version`)."""

    project: ProjectSlug
    changes: tuple[RosterChange, ...] = Field(default=(), max_length=MAX_ROSTER_CHANGES)

    @property
    def version(self) -> int:
        return len(self.changes)

    @property
    def coordinators(self) -> tuple[str, ...]:
        return self.changes[-1].coordinators if self.changes else ()

    def at_version(self, version: int) -> frozenset[str]:
        """The coordinators after the first `version` changes."""
        return frozenset(self.changes[version - 1].coordinators) if version > 0 else frozenset()

    def change_for(self, message_id: uuid.UUID) -> RosterChange | None:
        return next((c for c in self.changes if c.message_id == message_id), None)


class AgentCapabilities(Model):
    """What an agent advertises, signed by it (`document` is what the signature covers)."""

    agent: AgentId
    capabilities: tuple[Capability, ...] = Field(max_length=64)
    updated_at: AwareDatetime
    public_key: PublicKey
    signature: Signature

    def document(self) -> bytes:
        return capabilities_document(self.agent, self.capabilities, self.updated_at)


CAPABILITIES_PURPOSE = "mesh capabilities"


def capabilities_document(agent: str, capabilities: tuple[str, ...], updated_at: datetime) -> bytes:
    return canonical_json(
        {"agent": agent, "capabilities": list(capabilities), "updated_at": updated_at.astimezone(UTC).isoformat()}
    )


def proposal_digest(proposal: Proposal) -> str:
    """What a step's signature binds of the proposal it acts on: all of it (targets, payload, deadline...)."""
    return hashlib.sha256(canonical_json(proposal.model_dump(mode="json"))).hexdigest()


def message_digest(message: Message) -> str:
    """What a retried message must match: the same id with other content is a different message."""
    return hashlib.sha256(canonical_json(message.model_dump(mode="json"))).hexdigest()


def parse_message(raw: dict[str, Any]) -> Message:
    """A message from untrusted input; raises InvalidEvent naming the task and field."""
    try:
        return Message.model_validate(raw)
    except ValidationError as e:
        error = invalid_event_of(e)
        task = raw.get("task_id", "?")
        action = raw.get("action", "?")
        field = error.field.replace("completion.sha", "sha")
        problem = SHA_RULE if field.startswith("sha") else error.problem
        raise InvalidEvent(f"task {task} {action}.{field}", problem, allowed=error.allowed) from e
