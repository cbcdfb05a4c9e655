"""The body model of every kind and the kind registry. Bodies are chosen by `kind` through the registry, so custom
kinds can be added with `register_kind`, and an unregistered kind is an InvalidEvent."""

from __future__ import annotations

import difflib
import uuid
from dataclasses import dataclass
from typing import Annotated, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from bus.errors import ConfigError, InvalidEvent
from bus.model.fields import AgentId, ArtifactId, Count, Flag, Sha256, ShortText, Text, Timestamp, Unit
from bus.model.vocab import EvidenceKind, Lifecycle, ResolutionKind, Reversibility, Trust
from bus.subjects import KIND_PATTERN


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Evidence(Model):
    kind: EvidenceKind
    ref: Annotated[str, StringConstraints(min_length=1, max_length=2_000)]
    excerpt: Annotated[str, StringConstraints(max_length=4_000)] | None = None
    sha256: Sha256 | None = None


class Body(Model):
    """Base of every body. Subclasses set `kind` and say whether they act on an existing artifact."""

    kind: ClassVar[str]
    transition: ClassVar[bool] = False
    # True for records a subsystem writes about itself (the mesh's task steps): they are not claims, so no
    # hand-publishing command and no tombstone check.
    system_record: ClassVar[bool] = False

    def content_text(self) -> str:
        """The claim in words: what is embedded, hashed for tombstones, shown in a table."""
        return " ".join(str(v) for v in self.model_dump(mode="json").values() if isinstance(v, str))


IMPACT = "How much it matters, from 0 (not at all) to 1 (decisive)."
CONFIDENCE = "How sure, from 0 to 1; 0.8 or more on intuition alone is flagged as unearned."


class FindingBody(Body):
    """What was found to be true, how much it matters (impact) and how sure (confidence), with its evidence."""

    kind: ClassVar[str] = "finding"
    text: Text = Field(description="What was found, in a few sentences.")
    impact: Unit = Field(description=IMPACT)
    confidence: Unit = Field(description=CONFIDENCE)
    subject: ShortText = Field(description="What it is about, in a few words (a component, a topic).")
    evidence: tuple[Evidence, ...] = Field(default=(), description="Pointers to what shows it.")
    revises: ArtifactId | None = Field(default=None, description="The finding this one corrects or refines.")
    supersedes: ArtifactId | None = Field(default=None, description="The claim this one replaces (it is resolved).")

    def content_text(self) -> str:
        return self.text


class UnknownBody(Body):
    """An open question worth handing over: what is not known yet, and how much it matters."""

    kind: ClassVar[str] = "unknown"
    question: Text = Field(description="The open question.")
    impact: Unit = Field(description=IMPACT)

    def content_text(self) -> str:
        return self.question


class MistakeBody(Body):
    """A mistake made: what it was, why it was wrong, its cost, its root cause and how to prevent it."""

    kind: ClassVar[str] = "mistake"
    mistake: Text = Field(description="What was done wrong.")
    why_wrong: Text = Field(description="Why it was wrong.")
    cost_estimate: ShortText = Field(description="What it cost, in a few words (time, data, money).")
    root_cause: Text = Field(description="Why it happened.")
    prevention: Text = Field(description="What stops it from happening again.")


class DecisionBody(Body):
    """A choice made, the alternatives weighed and the rationale, and how hard it is to undo."""

    kind: ClassVar[str] = "decision"
    choice: Text = Field(description="What was decided.")
    alternatives: tuple[ShortText, ...] = Field(default=(), description="The options not taken.")
    rationale: Text = Field(description="Why this choice (required).")
    confidence: Unit = Field(description=CONFIDENCE)
    reversibility: Reversibility


class AssumptionBody(Body):
    """Something taken as true without checking it, and how confident that is."""

    kind: ClassVar[str] = "assumption"
    text: Text = Field(description="What is taken as true.")
    confidence: Unit = Field(description=CONFIDENCE)

    def content_text(self) -> str:
        return self.text


class DeadEndBody(Body):
    """An approach that was tried and failed, and why: so nobody tries it again blindly."""

    kind: ClassVar[str] = "dead_end"
    approach: Text = Field(description="What was tried.")
    why_failed: Text = Field(description="Why it did not work.")


class ResolvedBody(Body):
    kind: ClassVar[str] = "resolved"
    transition: ClassVar[bool] = True
    resolution: ResolutionKind
    superseded_by: ArtifactId | None = None
    note: Text | None = None

    @model_validator(mode="after")
    def _successor_iff_superseded(self) -> ResolvedBody:
        if self.resolution is ResolutionKind.superseded and self.superseded_by is None:
            raise ValueError("resolution 'superseded' requires superseded_by (the replacing artifact id)")
        if self.resolution is not ResolutionKind.superseded and self.superseded_by is not None:
            raise ValueError(f"superseded_by is only allowed with resolution 'superseded', not {self.resolution}")
        return self


class VerifiedBody(Body):
    kind: ClassVar[str] = "verified"
    transition: ClassVar[bool] = True
    note: Text | None = None
    evidence: tuple[Evidence, ...] = ()


class ContradictedBody(Body):
    kind: ClassVar[str] = "contradicted"
    transition: ClassVar[bool] = True
    contradicted_by: ArtifactId
    reason: Text


class RolledBackBody(Body):
    kind: ClassVar[str] = "rolled_back"
    transition: ClassVar[bool] = True
    reason: Text


class ErasedState(Model):
    """What a forgotten artifact was from stream sequence `seq` on, without its content. A `forgotten` event
    carries the artifact's states, so a path that reads the stream after the artifact's messages were erased
    decides what other events did with it (contradicted by it, superseding it) exactly as live nodes did."""

    seq: Count
    kind: Annotated[str, StringConstraints(pattern=KIND_PATTERN.pattern)]
    author: AgentId
    created_event_id: uuid.UUID
    created_at: Timestamp
    impact: Unit | None = None
    confidence: Unit | None = None
    revises: ArtifactId | None = None
    supersedes: ArtifactId | None = None
    superseded_by: ArtifactId | None = None
    contradicted_by: ArtifactId | None = None
    trust: Trust
    lifecycle: Lifecycle
    resolution: ResolutionKind | None = None
    forgotten: Flag = False  # from `seq` on the artifact was gone (an earlier forget of the same id)


class ErasedEvent(Model):
    """An event the forget erases from the stream, by id and digest: its id stays taken on every path."""

    event_id: uuid.UUID
    digest: Sha256


class ForgottenBody(Body):
    kind: ClassVar[str] = "forgotten"
    transition: ClassVar[bool] = True
    reason: Text
    history: tuple[ErasedState, ...] = ()  # the artifact's states in stream order, content left out
    events: tuple[ErasedEvent, ...] = ()  # the artifact's events the forget erases


@dataclass(frozen=True)
class KindSpec:
    name: str
    body: type[Body]

    @property
    def transition(self) -> bool:
        return self.body.transition


_KINDS: dict[str, KindSpec] = {}


def register_kind(body: type[Body], *, name: str | None = None) -> KindSpec:
    """Register a body model under its kind name. Idempotent for the same model; a different model under a
    taken name raises ConfigError."""
    kind = name or body.kind
    if not KIND_PATTERN.fullmatch(kind):
        raise ConfigError("kind", f"{kind!r} must match {KIND_PATTERN.pattern}")
    if body.model_config.get("extra") != "forbid":
        raise ConfigError("kind", f"body model for {kind!r} must forbid extra keys (subclass bus.model.kinds.Body)")
    existing = _KINDS.get(kind)
    if existing is not None and existing.body is not body:
        raise ConfigError("kind", f"{kind!r} is already registered to {existing.body.__name__}")
    spec = KindSpec(kind, body)
    _KINDS[kind] = spec
    return spec


def kind_names() -> list[str]:
    return sorted(_KINDS)


def artifact_kind_names() -> list[str]:
    """The kinds an artifact can have: claims, not the transitions acting on them or subsystems' records."""
    return [k for k in kind_names() if not (_KINDS[k].body.transition or _KINDS[k].body.system_record)]


def is_registered(kind: str) -> bool:
    return kind in _KINDS


def body_model(kind: str) -> type[Body]:
    """The body model of a registered kind (KeyError for another: validate the kind first)."""
    return _KINDS[kind].body


def require_kind(kind: str) -> KindSpec:
    spec = _KINDS.get(kind)
    if spec is None:
        close = difflib.get_close_matches(kind, kind_names(), n=1)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        raise InvalidEvent("kind", f"{kind!r}{guess}", allowed=kind_names())
    return spec


BUILTIN_BODIES: tuple[type[Body], ...] = (
    FindingBody,
    UnknownBody,
    MistakeBody,
    DecisionBody,
    AssumptionBody,
    DeadEndBody,
    ResolvedBody,
    VerifiedBody,
    ContradictedBody,
    RolledBackBody,
    ForgottenBody,
)
for _body in BUILTIN_BODIES:
    register_kind(_body)
