"""The arguments of every epibus MCP tool, as models. The publish tools' models are made from the kinds' body
models, so a tool accepts exactly what the event does, with the same limits."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, JsonValue, StringConstraints, create_model

from bus.model.fields import AgentId, ArtifactId, ProjectSlug, ShortText, Text
from bus.model.kinds import Evidence, artifact_kind_names, kind_names, require_kind
from bus.model.vocab import EpistemicSource, ResolutionKind
from bus.model.watch import (
    DEFAULT_THRESHOLD,
    DEFAULT_WATCH_DAYS,
    MAX_ABOUT_CHARS,
    MAX_WATCH_DAYS,
    MAX_WATCH_PROJECTS,
    WATCH_ID_PATTERN,
)
from bus.subjects import KIND_PATTERN
from epibus.mcp_tools.schema import Capability, Limit, MessageId, Query, RepoPath, TaskId, ToolInput, When
from mesh.task import MAX_PAYLOAD_KEYS, CommitSha
from mesh.vocab import ActionCategory

Wait = Literal["published", "journaled"]


def _kinds_enum(schema: dict[str, Any]) -> None:
    schema["enum"] = kind_names()  # when the schema is made: kinds registered at run time are listed too


def _artifact_kinds_enum(schema: dict[str, Any]) -> None:
    schema["enum"] = artifact_kind_names()


# Kinds can be registered at run time, so the schema lists them when it is made and the tool checks the registry.
KindName = Annotated[
    str,
    StringConstraints(pattern=KIND_PATTERN.pattern),
    Field(description="A registered kind, e.g. finding.", json_schema_extra=_kinds_enum),
]
ArtifactKindName = Annotated[
    str,
    StringConstraints(pattern=KIND_PATTERN.pattern),
    Field(description="A kind of artifact, e.g. finding.", json_schema_extra=_artifact_kinds_enum),
]
SYSTEM_KINDS = frozenset({"coordinators", "enrolment", "task"})


def claim_kinds() -> list[str]:
    """The kinds an agent publishes as new claims: every registered kind that is not a state change of an
    existing artifact and not a record only nodes or the mesh write."""
    return [
        kind
        for kind in kind_names()
        if not require_kind(kind).transition
        and not getattr(require_kind(kind).body, "system_record", False)
        and kind not in SYSTEM_KINDS
    ]


class PublishCommon(ToolInput):
    project: ProjectSlug = Field(description="Project slug.")
    source: EpistemicSource | None = None
    goal_id: ShortText | None = Field(default=None, description="The goal this claim serves.")
    wait: Wait = Field(
        default="published",
        description="Return once the stream has it (published) or once this node's journal has it (journaled).",
    )
    strict: bool = Field(default=False, description="Refuse a claim that repeats a retracted or rolled-back one.")


def publish_input(kind: str) -> type[ToolInput]:
    """Arguments of the publish tool for `kind`: the common ones and the body model's fields, as declared there."""
    body = require_kind(kind).body
    fields: dict[str, Any] = {name: (info.annotation, info) for name, info in body.model_fields.items()}
    model: type[ToolInput] = create_model(
        f"Publish{body.__name__.removesuffix('Body')}", __base__=PublishCommon, **fields
    )
    return model


class ProjectInput(ToolInput):
    project: ProjectSlug = Field(description="Project slug.")


class ArtifactInput(ProjectInput):
    artifact_id: ArtifactId = Field(description="The artifact acted on or read.")


class RecallInput(ProjectInput):
    query: Query = Field(description="What to recall, in words.")
    k: Limit = Field(default=10, description="How many hits at most.")
    kinds: list[ArtifactKindName] | None = Field(default=None, max_length=20, description="Only these kinds.")


class SafeRecallInput(RecallInput):
    include_resolved: bool = Field(default=False, description="Also stale or superseded claims.")
    as_of: When | None = None


class ArtifactsInput(ProjectInput):
    kinds: list[ArtifactKindName] | None = Field(default=None, max_length=20, description="Only these kinds.")
    include_resolved: bool = Field(default=False, description="Also stale or superseded claims.")
    as_of: When | None = None
    limit: Limit = 50


class AuditInput(ProjectInput):
    kinds: list[ArtifactKindName] | None = Field(default=None, max_length=20, description="Only these kinds.")
    as_of: When | None = None
    limit: Limit = 200


class BriefingInput(ProjectInput):
    goal_id: ShortText | None = Field(default=None, description="Adds what was recorded under this goal.")
    goal_text: Query | None = Field(default=None, description="The goal in words: adds what the mirrors recall.")
    as_of: When | None = None
    limit: Limit = 10


class LineageInput(ArtifactInput):
    as_of: When | None = None


class EventsInput(ProjectInput):
    kind: KindName | None = None
    actor: AgentId | None = None
    artifact_id: ArtifactId | None = None
    since: When | None = None
    until: When | None = None
    limit: Limit = 50
    oldest_first: bool = False


class VerifyInput(ArtifactInput):
    note: Text | None = Field(default=None, description="What was checked, and how.")
    evidence: list[Evidence] = Field(default_factory=list, max_length=50)


class ContradictInput(ArtifactInput):
    contradicted_by: ArtifactId = Field(description="The existing artifact that refutes it (not itself).")
    reason: Text


class ResolveInput(ArtifactInput):
    resolution: ResolutionKind
    superseded_by: ArtifactId | None = Field(default=None, description="The replacing artifact (superseded only).")
    note: Text | None = None


class RollbackInput(ArtifactInput):
    reason: Text = "rolled back"
    apply: bool = Field(default=False, description="Write the rollback; without it, only the plan is returned.")
    cascade: bool = Field(default=False, description="Also roll back the descendants built on it.")


class VocabReportInput(ProjectInput):
    as_of: When | None = None


class WhoamiInput(ToolInput):
    pass


class ProposeInput(ProjectInput):
    title: ShortText
    summary: Text = Field(description="What is to be done and why.")
    category: ActionCategory = ActionCategory.operational
    to: list[AgentId] = Field(default_factory=list, max_length=50, description="Target agents.")
    capabilities: list[Capability] = Field(default_factory=list, max_length=50, description="Capabilities needed.")
    deadline: When | None = Field(default=None, description="ISO 8601 time, or a duration from now like 2h.")
    parent_id: TaskId | None = Field(default=None, description="The task this one follows from.")
    payload: dict[str, JsonValue] | None = Field(
        default=None, max_length=MAX_PAYLOAD_KEYS, description="A JSON object for the assignee."
    )
    task_id: TaskId | None = Field(default=None, description="Default: the message id.")
    message_id: MessageId | None = None


class MeshListInput(ToolInput):
    project: ProjectSlug | None = Field(default=None, description="Only this project.")


class TaskRef(ToolInput):
    task_id: TaskId
    project: ProjectSlug | None = Field(default=None, description="The task's project (default: found by id).")


class TaskInput(TaskRef):
    message_id: MessageId | None = None


class AcceptInput(TaskInput):
    assignee: AgentId | None = Field(default=None, description="Who does it (default: the one targeted agent).")


class ReasonedTaskInput(TaskInput):
    reason: Text


class CancelInput(TaskInput):
    reason: Text | None = None


class CompleteInput(TaskInput):
    sha: CommitSha = Field(description="The commit: 40 or 64 lowercase hex characters.")
    repo: RepoPath | None = Field(
        default=None, description="Absolute path of a git repository: refuse unless the SHA is a commit there."
    )
    note: Text | None = Field(default=None, description="A result note.")
    evidence: list[Evidence] = Field(default_factory=list, max_length=50)


class WatchInput(ToolInput):
    about: Annotated[str, StringConstraints(min_length=1, max_length=MAX_ABOUT_CHARS, pattern=r"\S")] = Field(
        description="What to be told of, in words."
    )
    projects: list[ProjectSlug] = Field(min_length=1, max_length=MAX_WATCH_PROJECTS, description="Projects to watch.")
    kinds: list[ArtifactKindName] | None = Field(default=None, max_length=20, description="Only these kinds.")
    threshold: float = Field(default=DEFAULT_THRESHOLD, gt=0, le=1, description="How close a claim must be (cosine).")
    days: float = Field(default=DEFAULT_WATCH_DAYS, gt=0, le=MAX_WATCH_DAYS, description="How long it stands.")
    audit: bool = Field(default=False, description="Claims in every state (reviewers and admins).")


class WatchStopInput(ToolInput):
    watch_id: Annotated[str, StringConstraints(pattern=WATCH_ID_PATTERN)] = Field(description="The watch to stop.")


class NoticesInput(ToolInput):
    after_seq: int = Field(default=0, ge=0, description="Notices after this sequence: the last `seq` you were given.")
    limit: int = Field(default=20, ge=1, le=200, description="How many notices at most.")
    wait_s: float = Field(default=0.0, ge=0, le=30, description="Seconds to wait when none is there yet.")
