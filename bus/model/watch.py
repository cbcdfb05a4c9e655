"""Standing questions by meaning ("watches"): what an agent asks a node to keep, what the watches bucket holds,
and the notices a node pushes to the watch's owner. One module for the watch's fields, limits and defaults."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from bus.model.auth import AgentId, PublicKey
from bus.model.requests import (
    MAX_KINDS,
    ArtifactId,
    Count,
    EventId,
    Kind,
    Message,
    NodeName,
    Project,
    Score,
    UtcTime,
)
from bus.subjects import KIND_PATTERN, PROJECT_PATTERN

# A claim at least this similar (cosine, 0..1) to a watch's words is pushed. Chosen on paraphrase pairs with the
# default model (all-MiniLM-L6-v2): paraphrases scored 0.33-0.75, unrelated pairs at most 0.21.
DEFAULT_THRESHOLD = 0.27
MAX_WATCHES_PER_AGENT = 32  # standing queries an agent may hold at once (expired ones do not count)
DEFAULT_WATCH_DAYS = 7.0
MAX_WATCH_DAYS = 30.0
MAX_ABOUT_CHARS = 1000
MAX_WATCH_PROJECTS = 16
# Notices are kept this long: a watcher offline for longer misses what is older, and a node catching up on the
# stream pushes no claim recorded longer ago than this (the stream's duplicate window covers the rest).
NOTICE_WINDOW_S = 7 * 86400.0
MAX_VECTOR_DIMENSION = 8192
WATCH_ID_PATTERN = r"^[0-9a-f]{32}$"

WatchId = Annotated[str, StringConstraints(pattern=WATCH_ID_PATTERN)]
About = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ABOUT_CHARS, pattern=r"\S")]
Threshold = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]


class WatchRegisterRequest(Message):
    """Keep a standing question: push every claim recorded from now on in `projects` (of `kinds`, every kind when
    null) whose meaning is at least `threshold` close to `about`, for `days`. `audit`: claims in every state
    (reviewers and admins), else the safe door of recall."""

    about: About = Field(description=f"a non-blank text of at most {MAX_ABOUT_CHARS} characters")
    projects: Annotated[list[Project], Field(min_length=1, max_length=MAX_WATCH_PROJECTS)] = Field(
        description=f"1 to {MAX_WATCH_PROJECTS} project slugs matching {PROJECT_PATTERN.pattern}"
    )
    kinds: Annotated[list[Kind], Field(max_length=MAX_KINDS)] | None = Field(
        None, description=f"null or a list of at most {MAX_KINDS} kind names matching {KIND_PATTERN.pattern}"
    )
    threshold: Threshold = Field(DEFAULT_THRESHOLD, description="a similarity above 0 and at most 1")
    days: Annotated[float, Field(gt=0.0, le=MAX_WATCH_DAYS, allow_inf_nan=False)] = Field(
        DEFAULT_WATCH_DAYS, description=f"days above 0 and at most {MAX_WATCH_DAYS:g}"
    )
    audit: bool = Field(False, description="true or false")


class WatchView(Message):
    """A watch as its owner sees it (without the vector)."""

    watch_id: WatchId
    agent_id: AgentId
    about: About
    projects: Annotated[list[Project], Field(min_length=1, max_length=MAX_WATCH_PROJECTS)]
    kinds: Annotated[list[Kind], Field(max_length=MAX_KINDS)] | None
    threshold: Threshold
    audit: bool
    created_at: UtcTime
    expires_at: UtcTime

    def expired(self, now: datetime) -> bool:
        return now >= self.expires_at


class WatchRecord(WatchView):
    """What the watches bucket holds under `<owner_key>.<watch_id>`: written by the node that registered it (agents
    may not write or read the bucket), with the vector of `about` under that node's model."""

    owner_key: PublicKey
    model_id: Annotated[str, StringConstraints(min_length=1, max_length=200)]
    dimension: Annotated[int, Field(ge=1, le=MAX_VECTOR_DIMENSION)]
    vector: Annotated[list[Annotated[float, Field(allow_inf_nan=False)]], Field(max_length=MAX_VECTOR_DIMENSION)]
    node: NodeName

    def view(self) -> WatchView:
        return WatchView.model_validate(self.model_dump(include=set(WatchView.model_fields)))


def watch_expiry(created_at: datetime, days: float) -> datetime:
    return created_at + timedelta(days=days)


class WatchReply(Message):
    node: NodeName
    watch: WatchView


class WatchStopRequest(Message):
    watch_id: WatchId = Field(description="a watch id (32 hex digits), as `epibus watch list` shows it")


class WatchStopReply(Message):
    node: NodeName
    stopped: bool  # False: no such watch of the asker's (already stopped, expired and swept, or never made)


class WatchListRequest(Message):
    pass


class WatchListReply(Message):
    node: NodeName
    watches: Annotated[list[WatchView], Field(max_length=MAX_WATCHES_PER_AGENT * 4)]
    limit: Count  # how many unexpired watches the asker may hold


class Notice(Message):
    """What a watch's owner is told: a claim that matched (`match`), or that a claim it was told of is no longer
    trusted (`no_longer_trusted`: retracted, mistyped, contradicted or rolled back after the push)."""

    notice: Literal["match", "no_longer_trusted"]
    watch_id: WatchId
    about: About
    event_id: EventId
    project: Project
    kind: Kind
    artifact_id: ArtifactId
    score: Score
    text: Annotated[str, StringConstraints(max_length=16_000)]
    author: AgentId
    trust: Annotated[str, StringConstraints(max_length=40)]
    lifecycle: Annotated[str, StringConstraints(max_length=40)]
    resolution: Annotated[str, StringConstraints(max_length=40)] | None
    recorded_at: UtcTime
    review: Literal["awaiting review", "reviewed"] | None = None  # under the project's review policy
    node: NodeName
