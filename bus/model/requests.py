"""What a client asks of the nodes over core NATS request subjects, and what they answer: one model per request
and per reply. The asking side builds its requests and reads every reply through them; the answering side
refuses a request that does not fit, naming the field, the value and what is allowed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    RootModel,
    StringConstraints,
    ValidationError,
)
from pydantic_core import ErrorDetails, from_json

from bus.errors import ConfigError, validation_message
from bus.model.auth import ANY_PROJECT, AgentId, Owner, ProjectScope, PublicKey
from bus.model.fields import AGENT_PATTERN, Unit
from bus.model.vocab import Identity, ReviewMode, Role
from bus.subjects import ARTIFACT_PATTERN, KIND_PATTERN, PROJECT_PATTERN

MAX_K = 1000  # hits per recall: more would not fit in one reply
MAX_TEXT_CHARS = 16_000  # as long as an event's longest free text, so any content can be a query
MAX_KINDS = 64
MAX_IDS = 10_000  # event ids in one request; a journal lookup asks LOOKUP_CHUNK at a time
LOOKUP_CHUNK = 1000  # event ids per lookup request: ~40 KB, far below NATS's 1 MiB max_payload
MAX_FINGERPRINTS = 100_000
MAX_NAME_CHARS = 200  # a node's name in a reply
MAX_SAMPLE = 1000
MAX_ERROR_CHARS = 2000  # an error line in a reply: a huge message is cut, so the reply fits any max_payload
MAX_VALUE_CHARS = 60  # how much of a refused value an error quotes
# A subject a node may publish to: dot-separated tokens, no wildcards, no whitespace.
SUBJECT_PATTERN = r"^[^\s.*>]+(\.[^\s.*>]+)*$"
EVENT_ID_PATTERN = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"

Project = Annotated[str, StringConstraints(pattern=PROJECT_PATTERN.pattern)]
Kind = Annotated[str, StringConstraints(pattern=KIND_PATTERN.pattern)]
ArtifactId = Annotated[str, StringConstraints(pattern=ARTIFACT_PATTERN.pattern)]
EventId = Annotated[str, StringConstraints(pattern=EVENT_ID_PATTERN)]
NodeName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS)]
Count = Annotated[int, Field(ge=0)]
Score = Annotated[float, Field(allow_inf_nan=False)]


def _in_utc(value: datetime) -> datetime:
    try:
        value.astimezone(UTC)  # the node compares it in UTC: 9999-12-31T23:59-23:59 is past the last day
    except OverflowError:
        raise ValueError("out of range once converted to UTC") from None
    return value


UtcTime = Annotated[AwareDatetime, AfterValidator(_in_utc)]
Texts = Annotated[list[Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]], Field(max_length=100)]


class Message(BaseModel):
    """A request or a reply: strict (no "5" for 5, no true for 1), and no field it does not declare."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# Requests, in the wire format clients have always sent.


class RecallRequest(Message):
    query: Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS, pattern=r"\S")] = Field(
        description=f"a non-blank string of at most {MAX_TEXT_CHARS} characters"
    )
    project: Project = Field(description=f"a project slug matching {PROJECT_PATTERN.pattern}")
    k: Annotated[int, Field(ge=1, le=MAX_K)] = Field(10, description=f"an integer from 1 to {MAX_K}")
    kinds: Annotated[list[Kind], Field(max_length=MAX_KINDS)] | None = Field(
        None, description=f"null or a list of at most {MAX_KINDS} kind names matching {KIND_PATTERN.pattern}"
    )
    include_resolved: bool = Field(False, description="true or false")
    as_of: UtcTime | None = Field(None, description="null or an ISO 8601 time with a timezone, in range in UTC")
    audit: bool = Field(False, description="true or false")


class VerifyRequest(Message):
    project: Project | None = Field(None, description=f"null or a project slug matching {PROJECT_PATTERN.pattern}")
    repair: bool = Field(False, description="true or false")


class ForgetProofRequest(Message):
    project: Project = Field(description=f"a project slug matching {PROJECT_PATTERN.pattern}")
    artifact_id: ArtifactId = Field(description=f"an artifact id matching {ARTIFACT_PATTERN.pattern}")
    event_ids: Annotated[list[EventId], Field(max_length=MAX_IDS)] = Field(
        description=f"a list of at most {MAX_IDS} event ids (UUIDs)"
    )
    fingerprints: Annotated[
        list[Annotated[str, StringConstraints(min_length=1, max_length=1000)]], Field(max_length=MAX_FINGERPRINTS)
    ] = Field([], description=f"a list of at most {MAX_FINGERPRINTS} strings of 1 to 1000 characters")
    embedded_texts: Texts = Field([], description=f"a list of at most 100 strings of {MAX_TEXT_CHARS} chars or fewer")
    scrub: bool = Field(False, description="true or false")


class ReindexRequest(Message):
    progress: Annotated[str, StringConstraints(max_length=255, pattern=SUBJECT_PATTERN)] | None = Field(
        None, description="null or a NATS subject without wildcards, at most 255 characters"
    )


class JournalRebuildRequest(Message):
    """An admin asks one node to rebuild its (SQLite) journal from the stream and swap it in."""

    node: NodeName = Field(description="the node whose journal is rebuilt, by name (`epibus status` shows it)")


class EraseRequest(Message):
    """An admin asks a node to erase from the stream the messages of an artifact whose `forgotten` event is there."""

    project: Project = Field(description=f"a project slug matching {PROJECT_PATTERN.pattern}")
    artifact_id: ArtifactId = Field(description=f"an artifact id matching {ARTIFACT_PATTERN.pattern}")


class EnrolRequest(Message):
    """An admin enrols an agent (or changes its roles, projects or owner)."""

    agent_id: AgentId = Field(description=f"an agent id matching {AGENT_PATTERN.pattern}")
    public_key: PublicKey = Field(description="the agent's nkey user public key: U followed by 55 base32 characters")
    owner: Owner | None = Field(None, description="null (the agent is its own owner) or who is behind it")
    roles: Annotated[list[Role], Field(min_length=1, max_length=len(Role))] = Field(
        [Role.agent], description=f"a list of roles out of {', '.join(Role)}"
    )
    projects: Annotated[list[ProjectScope], Field(min_length=1, max_length=256)] = Field(
        description=f"a list of project slugs, or [{ANY_PROJECT!r}] for every project"
    )
    replace_key: bool = Field(False, description="true to rotate the key of an agent enrolled with another")
    identity: Identity = Field(Identity.agent, description="agent or person (only a person holds reviewer)")
    if_absent: bool = Field(
        False, description="true to leave an agent already enrolled (or revoked) as it is: a local first connect"
    )


class RevokeRequest(Message):
    agent_id: AgentId = Field(description=f"an agent id matching {AGENT_PATTERN.pattern}")


class AgentListRequest(Message):
    pass


FleetNodeName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")]


class FleetInviteRequest(Message):
    """Invite node `name` to join: its hub answers with a one-time token valid for `ttl_s`."""

    name: FleetNodeName
    ttl_s: Annotated[float, Field(ge=60, le=7 * 86400)] = 3600.0
    hosts: Annotated[list[Annotated[str, StringConstraints(max_length=253)]], Field(max_length=16)] = []


class FleetInviteReply(Message):
    node: NodeName
    token: Annotated[str, StringConstraints(max_length=64_000)]
    expires_at: UtcTime


class FleetRemoveRequest(Message):
    name: FleetNodeName


class FleetJoinRequest(Message):
    """A joining node redeems its invite (the request is signed by the invite's key) with its own node key,
    which signs `proof`: its name and the invite key, so nobody joins with a key it does not hold."""

    name: FleetNodeName
    invite_key: PublicKey
    node_key: PublicKey
    host: Annotated[str, StringConstraints(max_length=253)]
    proof: Annotated[str, StringConstraints(max_length=200)]


class FleetReply(Message):
    node: NodeName
    member: JsonValue = None


class LookupRequest(RootModel[Annotated[list[EventId], Field(max_length=LOOKUP_CHUNK)]]):
    """Which of these event ids are journaled? A bare JSON list, as it has always been sent."""

    model_config = ConfigDict(frozen=True, strict=True)
    root: Annotated[list[EventId], Field(max_length=LOOKUP_CHUNK)] = Field(
        description=f"a JSON list of at most {LOOKUP_CHUNK} event ids (UUIDs)"
    )


# Replies. Every service answers an ErrorReply when it cannot answer with its own reply.


class ErrorReply(Message):
    node: NodeName
    error: Annotated[str, StringConstraints(max_length=MAX_ERROR_CHARS)]


class Vouched(Message):
    """Who vouched for a claim: agents and people who verified it, the last person and when."""

    agents: Count = 0
    people: Count = 0
    last_person: AgentId | None = None
    last_person_at: Annotated[str, StringConstraints(max_length=40)] | None = None


class RecallHitReply(Message):
    artifact_id: str
    event_id: str
    kind: str
    content: str
    similarity: Score
    relevance: Score
    score: Score
    state: dict[str, Any]
    provenance: dict[str, Any]
    vouched: Vouched = Vouched()  # a node of an earlier release sends none
    review: Literal["awaiting review", "reviewed"] | None = None  # under the project's review policy


class RecallReply(Message):
    node: NodeName
    hits: Annotated[list[RecallHitReply], Field(max_length=MAX_K)]


class StoreCheckReply(Message):
    missing: Count
    extra: Count
    stale: Count
    mismatched: Count
    clean: bool
    sample_missing: Annotated[list[str], Field(max_length=MAX_SAMPLE)]
    sample_extra: Annotated[list[str], Field(max_length=MAX_SAMPLE)]
    sample_stale: Annotated[list[str], Field(max_length=MAX_SAMPLE)]
    sample_mismatched: Annotated[list[str], Field(max_length=MAX_SAMPLE)]


class VerifyReply(Message):
    node: NodeName
    stream_events: Count
    journal: StoreCheckReply
    mirror: StoreCheckReply | None
    repaired: bool
    clean: bool


class ForgetProofReply(Message):
    node: NodeName
    journal_rows: Count
    journal_content_left: Count
    projection_rows: Count
    mirror_points: Count
    scrubbed: dict[str, int | bool]
    cached_vectors: Count
    shared_vectors: Count = 0  # vectors of the content still on the fleet's shared vectors stream
    watch_notices: Count | None = None  # notices pushed about the claim still on the stream; None: not checked
    files: list[str]
    unreadable: list[str]
    scanned: Count
    unscrubbable: dict[str, str]


class ReindexReply(Message):
    node: NodeName
    points: Count
    last_seq: Count
    rejected: Count


class JournalRebuildReply(Message):
    """`rebuilt` false: the request named another node. `not_restored` null: the damaged file could not tell."""

    node: NodeName
    rebuilt: bool
    events: Count = 0
    last_seq: Count = 0
    rejected: Count = 0
    aside: str | None = None
    first_stream_seq: Count = 0
    not_restored: Count | None = None


class ErasedMessage(Message):
    seq: Annotated[int, Field(ge=1)]
    event_id: str | None  # None: the message was not an event any store admits


class EraseReply(Message):
    node: NodeName
    forget_seq: Annotated[int, Field(ge=1)]  # the `forgotten` event the erase is for; every message before it went
    erased: Annotated[list[ErasedMessage], Field(max_length=MAX_IDS)]


class EnrolmentReply(Message):
    node: NodeName
    enrolment: dict[str, Any]


class PolicySetRequest(Message):
    """An admin of the project sets its review policy (`human_review_impact` null: no claim needs a person)."""

    project: Project = Field(description=f"a project slug matching {PROJECT_PATTERN.pattern}")
    human_review_impact: Unit | None = Field(description="a number from 0 to 1, or null to ask no review")
    mode: ReviewMode = Field(ReviewMode.rank, description=f"one of {', '.join(ReviewMode)}")


class PolicyShowRequest(Message):
    project: Project = Field(description=f"a project slug matching {PROJECT_PATTERN.pattern}")


class PolicyReply(Message):
    node: NodeName
    project: Project
    policy: dict[str, Any] | None  # null: the project never had one


class AgentListReply(Message):
    node: NodeName
    agents: list[dict[str, Any]]


class ReindexProgress(Message):
    """Published on a reindex request's `progress` subject as a node goes."""

    node: NodeName
    done: Count
    total: Count


class LookupOutcome(Message):
    status: str
    reason: str | None
    flags: list[str]


class LookupReply(Message):
    node: NodeName = "journal"  # journal observers before this model sent no name
    journaled: Annotated[list[str], Field(max_length=LOOKUP_CHUNK)]
    outcomes: dict[str, LookupOutcome] = {}


class IndexedReply(Message):
    """A node's answer on MIRROR_LOOKUP: whether it runs a mirror, and which of the ids asked it has indexed."""

    node: NodeName
    mirror: bool
    indexed: Annotated[list[str], Field(max_length=LOOKUP_CHUNK)]


JOURNAL_READS = ("events", "artifacts", "audit", "briefing", "lineage", "vocab_report")


class JournalReadRequest(Message):
    """A read of a node's journal, answered as the CLI's `--json` shows it. `project` None (events only): every
    project, for agents of every project."""

    read: Literal["events", "artifacts", "audit", "briefing", "lineage", "vocab_report", "projects"]
    project: Project | None = None
    kinds: Annotated[list[Kind], Field(max_length=MAX_KINDS)] | None = None
    include_resolved: bool = False
    as_of: UtcTime | None = None
    since: UtcTime | None = None
    until: UtcTime | None = None
    actor: Annotated[str, StringConstraints(pattern=AGENT_PATTERN.pattern)] | None = None
    artifact_id: ArtifactId | None = None  # or a unique prefix of one, resolved by the node
    goal: Annotated[str, StringConstraints(max_length=200)] | None = None
    limit: Annotated[int, Field(ge=1, le=100_000)] = 50
    oldest_first: bool = False


class LookupFailure(Message):
    """An artifact prefix that named no artifact, or several: the error's fields, so the asker raises it as is."""

    error: Literal["NotFound", "AmbiguousId"]
    fields: dict[str, JsonValue]


class JournalReadReply(Message):
    node: NodeName
    result: JsonValue = None
    lookup: LookupFailure | None = None


MAX_HASHES = 2000  # content hashes per tombstone check: ~140 KB, below any max_payload
ContentHash = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class TombstoneCheckRequest(Message):
    """Which of these content hashes are tombstoned in `project`: an agent asks of the claims it is about to
    publish, so it learns nothing of a project's tombstones beyond what it already holds the text of."""

    project: Project
    hashes: Annotated[list[ContentHash], Field(min_length=1, max_length=MAX_HASHES)]


class TombstoneCheckReply(Message):
    node: NodeName
    tombstoned: Annotated[list[ContentHash], Field(max_length=MAX_HASHES)]


# The longest an agent's consumer lives after its last pull: a crashed reader frees its slot by then.
MAX_CONSUMER_IDLE_S = 60.0


class ConsumerOpenRequest(Message):
    """Open a pull consumer for `owner_key` (the signing agent) on `stream`, filtered to one of its projects (on
    EPI_WATCH: to the notices pushed to it): from `start_seq`, or the newest message of each subject
    (`last_per_subject`). Nothing to ack."""

    owner_key: PublicKey
    stream: Literal["EPI", "KV_epibus_mesh", "EPI_WATCH"]
    filter_subject: Annotated[str, StringConstraints(min_length=1, max_length=300, pattern=r"^[^\s]+$")]
    start_seq: Annotated[int, Field(ge=1)] | None = None
    last_per_subject: bool = False
    idle_s: Annotated[float, Field(gt=0, le=MAX_CONSUMER_IDLE_S)] = 30.0


class ConsumerOpenReply(Message):
    """The consumer made (`name`), or None with `full` saying which limit refused it; `slots` is the limit."""

    node: NodeName
    name: Annotated[str, StringConstraints(max_length=200)] | None
    slots: Count
    open: Annotated[list[Annotated[str, StringConstraints(max_length=200)]], Field(max_length=1024)]


R = TypeVar("R", bound=BaseModel)


def build_request(model: type[R], **fields: Any) -> R:
    """A request from the asking side's own arguments. Raises ConfigError naming the first field that does not
    fit, what it was and what is allowed."""
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        raise ConfigError(model.__name__, refusal(model, e.errors()[0])) from e


@dataclass(frozen=True)
class Malformed:
    """A reply that is not the answer it claims to be: who sent it (its `node`, if it names one) and why."""

    origin: str | None
    reason: str


def read_reply(data: bytes, model: type[R], *, max_bytes: int) -> R | ErrorReply | Malformed:
    """One reply to a request: the service's answer, the error it answered with, or why it is neither."""
    if len(data) > max_bytes:
        return Malformed(None, f"reply of {len(data)} bytes is over {max_bytes}")
    try:
        return model.model_validate_json(data)
    except ValidationError as answer_error:
        try:
            return ErrorReply.model_validate_json(data)
        except ValidationError:
            return Malformed(_claimed_node(data), "; ".join(refusal(model, e) for e in answer_error.errors()[:3]))


def _claimed_node(data: bytes) -> str | None:
    try:
        claimed = from_json(data)
    except ValueError:
        return None
    node = claimed.get("node") if isinstance(claimed, dict) else None
    return node if isinstance(node, str) and 0 < len(node) <= MAX_NAME_CHARS else None


def describe_invalid(model: type[BaseModel], error: ValidationError) -> str:
    """One line for a request that does not fit its model: each refused field (up to three), its value and
    what is allowed. Unknown fields come first: a misspelt field is also a missing one, and the cause."""
    errors = sorted(error.errors(), key=lambda e: e["type"] != "extra_forbidden")
    line = "; ".join(refusal(model, e) for e in errors[:3])
    if len(errors) > 3:
        line += f" (and {len(errors) - 3} more)"
    return line


def describe_undecodable(model: type[BaseModel], data: bytes, error: UnicodeDecodeError) -> str:
    """One line for a request body that is not UTF-8 text."""
    problem = f"not UTF-8 ({error.reason} at byte {error.start})"
    return f"body={_shown(data)} refused: {problem}; allowed: {_allowed(model, ())}"


def refusal(model: type[BaseModel], error: ErrorDetails) -> str:
    """`field=value refused: problem; allowed: ...` for one validation error of `model`."""
    where = _where(error)
    if error["type"] == "missing":
        return f"{where} is missing; allowed: {_allowed(model, error['loc'])}"
    problem = validation_message(error)
    if error["type"] == "json_invalid":
        problem = f"not JSON ({error.get('ctx', {}).get('error', problem)})"
    elif error["type"] == "extra_forbidden":
        problem = f"{where} is not a field of this request"
    return f"{where}={_shown(error.get('input'))} refused: {problem}; allowed: {_allowed(model, error['loc'])}"


def _where(error: ErrorDetails) -> str:
    where = "body" if error["loc"] and isinstance(error["loc"][0], int) else ""  # an item of a bare list
    for part in error["loc"]:
        where += f"[{part}]" if isinstance(part, int) else f".{part}" if where else str(part)
    return where or "body"


def _allowed(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    fields = model.model_fields
    top = loc[0] if loc else None
    if isinstance(top, str) and top in fields and fields[top].description:
        return str(fields[top].description)
    if isinstance(model, type) and issubclass(model, RootModel):
        return str(fields["root"].description)
    return "a JSON object with the fields " + ", ".join(fields)


def _shown(value: Any) -> str:
    """The value as JSON, as the asker sent it; cut to MAX_VALUE_CHARS."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    text = json.dumps(value, default=repr)
    if len(text) <= MAX_VALUE_CHARS:
        return text
    return f"{text[:MAX_VALUE_CHARS]}...({len(text)} chars)"


MAX_VIEW_RECORDS = 200  # enrolment records per view reply: ~100 KB, below any max_payload
MAX_VIEW_AGENTS = 100


class SharedEnrolment(Message):
    """An enrolment as a node shows it to an agent: its projects cut to those the agent shares (maybe none now)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)

    agent_id: AgentId
    public_key: PublicKey
    owner: Owner
    roles: Annotated[list[Role], Field(min_length=1, max_length=len(Role))]
    projects: Annotated[list[ProjectScope], Field(max_length=256)]
    enrolled_by: Owner
    enrolled_at: UtcTime
    revoked_at: UtcTime | None = None
    identity: Identity | None = None


class EnrolmentViewRecord(Message):
    seq: Annotated[int, Field(ge=1)]
    enrolment: SharedEnrolment


class EnrolmentViewRequest(Message):
    """The enrolment records after stream sequence `after_seq` that the signer may see: those of the agents it
    shares a project with (ever: a removal is seen too), cut to the projects shared."""

    after_seq: Annotated[int, Field(ge=0)] = 0
    agents: Annotated[list[AgentId], Field(max_length=MAX_VIEW_AGENTS)] = []  # their registry records, if visible


class EnrolmentViewReply(Message):
    node: NodeName
    records: Annotated[list[EnrolmentViewRecord], Field(max_length=MAX_VIEW_RECORDS)]
    last_seq: Annotated[int, Field(ge=0)]  # where the next page starts (after it), seen or not
    more: bool
    scope: Annotated[list[ProjectScope], Field(max_length=256)] | None  # the projects cut to (None: all of them)
    current: Annotated[list[SharedEnrolment], Field(max_length=MAX_VIEW_AGENTS)]  # the asked agents' registry records
    nodes: Annotated[list[SharedEnrolment], Field(max_length=10_000)]  # the nodes' own identities
    node_keys: Annotated[list[PublicKey], Field(max_length=10_000)]
