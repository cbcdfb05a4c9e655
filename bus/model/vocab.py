"""The closed vocabularies of the bus, each value with its one-line help. The only module that defines them; a
layer above registers its own vocabularies' help here (`register_help`), so `describe` serves every one."""

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


class Role(StrEnum):
    """What an enrolled identity may do in the fleet."""

    agent = "agent"
    reviewer = "reviewer"
    coordinator = "coordinator"
    admin = "admin"


class ReviewMode(StrEnum):
    """What the safe door does with a claim that awaits a person's review under its project's policy."""

    rank = "rank"
    withhold = "withhold"


class Identity(StrEnum):
    """Who stands behind an enrolled key: a program, or a person who typed a passphrase to sign."""

    agent = "agent"
    person = "person"


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
    Role: {
        "agent": "publishes and reads in its projects; verifies other authors' claims there",
        "reviewer": "a person's review: may audit and verify in its projects (persons only)",
        "coordinator": "may be seated as a coordinator of its projects' mesh",
        "admin": "enrols and revokes agents, seats first coordinators, forgets, repairs and reindexes",
    },
    ReviewMode: {
        "rank": "shown, marked awaiting review, after every claim that is not awaiting one",
        "withhold": "not shown by the safe door until a person reviews it (the audit door shows it)",
    },
    Identity: {
        "agent": "a program's key, kept in clear under its home; never holds reviewer",
        "person": "a person's key, encrypted with their passphrase (`epibus person add`); signs only at the CLI",
    },
}


def register_help(vocab: type[StrEnum], lines: dict[str, str]) -> None:
    """Register a vocabulary defined in another layer (the mesh's), with one line per value.
    Raises ValueError when a value has no line or a line names no value: help never drifts from its enum."""
    if set(lines) != {member.value for member in vocab}:
        raise ValueError(f"help of {vocab.__name__} must cover exactly {sorted(m.value for m in vocab)}")
    HELP[vocab] = dict(lines)


def describe(vocab: type[StrEnum]) -> str:
    """One line per value, for --help texts."""
    return "; ".join(f"{value}: {HELP[vocab][value]}" for value in vocab.__members__)


def values(vocab: type[StrEnum]) -> list[str]:
    return [member.value for member in vocab]
