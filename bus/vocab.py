"""The closed vocabularies of the state, each value with its one-line help. The only module that defines them."""

from __future__ import annotations

from enum import StrEnum


class EpistemicSource(StrEnum):
    """How the claim was arrived at."""

    intuition = "intuition"
    search = "search"
    mixed = "mixed"


class ResolutionKind(StrEnum):
    """Why an artifact stopped being current."""

    stale = "stale"
    superseded = "superseded"
    retracted = "retracted"
    mistyped = "mistyped"


class Trust(StrEnum):
    """Provenance, orthogonal to lifecycle."""

    unverified = "unverified"
    verified = "verified"
    contradicted = "contradicted"
    rolled_back = "rolled_back"


class Lifecycle(StrEnum):
    """Freshness: active, or resolved with a ResolutionKind."""

    active = "active"
    resolved = "resolved"


class Reversibility(StrEnum):
    """How hard a decision is to undo."""

    exploratory = "exploratory"
    committal = "committal"
    forced = "forced"


class EvidenceKind(StrEnum):
    """What an evidence pointer points at."""

    file = "file"
    url = "url"
    commit = "commit"
    tool_output = "tool_output"
    message = "message"
    event = "event"


class ReceiptLevel(StrEnum):
    """How far a published event is known to have travelled."""

    outboxed = "outboxed"
    published = "published"
    journaled = "journaled"
    indexed = "indexed"


class DeadLetterReason(StrEnum):
    """Why a consumer gave an event up to the dead-letter stream."""

    invalid_event = "invalid_event"
    bad_signature = "bad_signature"
    unknown_actor_key = "unknown_actor_key"
    subject_mismatch = "subject_mismatch"
    max_deliver = "max_deliver"
    implausible_time = "implausible_time"
    duplicate_id_conflict = "duplicate_id_conflict"


class TaskState(StrEnum):
    """Where a mesh task stands; terminal states have no exit."""

    proposed = "proposed"
    accepted = "accepted"
    working = "working"
    completed = "completed"
    acknowledged = "acknowledged"
    declined = "declined"
    changed = "changed"
    failed = "failed"
    canceled = "canceled"
    expired = "expired"


class TaskAction(StrEnum):
    """A mesh protocol message: what an agent does to a task."""

    propose = "propose"
    accept = "accept"
    decline = "decline"
    change = "change"
    start = "start"
    complete = "complete"
    fail = "fail"
    cancel = "cancel"
    acknowledge = "acknowledge"
    expire = "expire"


class ActionCategory(StrEnum):
    """How much a proposed piece of work can change, which coordinator policies key on."""

    operational = "operational"
    tactical = "tactical"
    strategic = "strategic"
    irreversible = "irreversible"


class MeshRole(StrEnum):
    """Who an agent is to a task."""

    proposer = "proposer"
    coordinator = "coordinator"
    assignee = "assignee"


class Role(StrEnum):
    """What an enrolled identity may do in the fleet."""

    agent = "agent"
    reviewer = "reviewer"
    coordinator = "coordinator"
    admin = "admin"


HELP: dict[type[StrEnum], dict[str, str]] = {
    EpistemicSource: {
        "intuition": "no retrieval since the goal opened",
        "search": "shaped by a retrieval this session",
        "mixed": "partly intuition, partly retrieval",
    },
    ResolutionKind: {
        "stale": "true when written, aged out",
        "superseded": "replaced by a named artifact (superseded_by is required and must exist)",
        "retracted": "false when written: a genuine error",
        "mistyped": "belongs to another artifact type",
    },
    Trust: {
        "unverified": "nobody but the author has vouched for it",
        "verified": "checked by a signed actor who is not the author",
        "contradicted": "refuted by another existing artifact",
        "rolled_back": "undone; terminal",
    },
    Lifecycle: {
        "active": "current",
        "resolved": "no longer current; see its resolution kind",
    },
    Reversibility: {
        "exploratory": "cheap to undo, made to learn",
        "committal": "costly to undo",
        "forced": "no real alternative was available",
    },
    EvidenceKind: {
        "file": "a path in a working tree",
        "url": "a web address",
        "commit": "a git commit SHA",
        "tool_output": "captured output of a tool run",
        "message": "a chat or mail message",
        "event": "another epibus event id",
    },
    ReceiptLevel: {
        "outboxed": "durable in the local outbox (SQLite, synchronous=FULL)",
        "published": "stored by JetStream (PubAck received)",
        "journaled": "written to the SQL journal",
        "indexed": "written to the vector mirror",
    },
    DeadLetterReason: {
        "invalid_event": "the message is not a valid epibus event",
        "bad_signature": "the signature does not verify against the actor's key",
        "unknown_actor_key": "the actor's key differs from the one registered for that agent",
        "subject_mismatch": "the subject does not match the event's project, kind and artifact",
        "max_deliver": "the observer failed on every delivery attempt",
        "implausible_time": "recorded_at is too far from when the stream stored the event (clock skew or a replay)",
        "duplicate_id_conflict": "another event with different content already holds this event id",
    },
    TaskState: {
        "proposed": "waiting for a coordinator's decision",
        "accepted": "a coordinator accepted it and named the assignee",
        "working": "the assignee started it",
        "completed": "done, with a commit SHA; waiting for the proposer's acknowledgement",
        "acknowledged": "the proposer closed the handshake; terminal",
        "declined": "a coordinator declined it, with a reason; terminal",
        "changed": "a coordinator counter-proposed a linked new task instead; terminal",
        "failed": "the assignee gave up, with a reason; terminal",
        "canceled": "withdrawn by its proposer or a coordinator; terminal",
        "expired": "its deadline passed before it was decided or completed; terminal",
    },
    TaskAction: {
        "propose": "a peer proposes work to a project's coordinators",
        "accept": "a coordinator accepts a proposal and names the assignee",
        "decline": "a coordinator declines a proposal (reason required)",
        "change": "a coordinator counter-proposes: a new proposal linked to this one",
        "start": "the assignee starts accepted work",
        "complete": "the assignee finishes, with a commit SHA (40 or 64 lowercase hex)",
        "fail": "the assignee gives up (reason required)",
        "cancel": "the proposer or a coordinator withdraws the task",
        "acknowledge": "the proposer confirms a completion, closing the handshake",
        "expire": "a coordinator closes a task whose deadline passed",
    },
    ActionCategory: {
        "operational": "routine work inside current plans (restart, rerun, small fix)",
        "tactical": "changes how a goal is reached (refactor, new dependency)",
        "strategic": "changes what the goals are",
        "irreversible": "cannot be undone (deleting data, publishing, spending)",
    },
    MeshRole: {
        "proposer": "the agent that proposed the task",
        "coordinator": "an agent registered to decide the project's work",
        "assignee": "the agent a coordinator gave the work to",
    },
    Role: {
        "agent": "publishes and reads in its projects; verifies other authors' claims there",
        "reviewer": "a person's review: may audit and verify in its projects",
        "coordinator": "may be seated as a coordinator of its projects' mesh",
        "admin": "enrols and revokes agents, seats first coordinators, forgets, repairs and reindexes",
    },
}


def describe(vocab: type[StrEnum]) -> str:
    """One line per value, for --help texts."""
    return "; ".join(f"{value}: {HELP[vocab][value]}" for value in vocab.__members__)


def values(vocab: type[StrEnum]) -> list[str]:
    return [member.value for member in vocab]
