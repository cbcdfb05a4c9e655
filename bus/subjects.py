"""The only module that builds subject, stream, bucket, key and header names: every name on the wire.

Events live on `epi.<project>.<kind>.<artifact_id>` in stream EPI (`epi.>`). Dead letters live on
`epidlq.<consumer>.<reason>` in stream EPI_DLQ, not under `epi.dlq.…`: JetStream refuses two
streams whose subjects overlap (err_code 10065) and EPI must keep `epi.>` so foreign messages on any
`epi.` subject are captured and quarantined rather than lost."""

from __future__ import annotations

import re
from typing import NamedTuple

from bus.errors import ConfigError

STREAM = "EPI"
STREAM_SUBJECTS = ("epi.>",)
DLQ_STREAM = "EPI_DLQ"
DLQ_SUBJECTS = ("epidlq.>",)
# Vectors a node embedded, shared so the fleet embeds each text once: `epivec.<text key>`, the newest only, read and
# written by nodes alone (agents have no permission there: a vector is a copy of a claim's meaning).
VECTORS_STREAM = "EPI_VEC"
VECTORS_SUBJECTS = ("epivec.>",)
VECTOR_MODEL_HEADER = "Epibus-Vector-Model"
VECTOR_DIMENSION_HEADER = "Epibus-Vector-Dimension"
AGENT_KEYS_BUCKET = "epibus_agents"
TOMBSTONES_BUCKET = "epibus_tombstones"
# Core NATS request subject (not stored in any stream): "which of these event ids are journaled?"
JOURNAL_LOOKUP = "epibus.journal.has"
# Core NATS request answered by one node of the `epibus-journal` queue group: a read of its journal (events,
# artifacts, audit, briefing, lineage, vocab report) for a signed asker, under the same membership rules as recall.
JOURNAL_READ = "epibus.journal.read"
JOURNAL_QUEUE = "epibus-journal"
# Core NATS request every node answers: "which of these event ids has your mirror indexed?" (a node without a
# mirror says so, rather than leaving the asker to wait).
MIRROR_LOOKUP = "epibus.mirror.has"
# Core NATS request subject every node with a mirror answers (no queue group: the asker merges all answers).
RECALL = "epibus.recall"
# Core NATS request every node answers: "is this artifact gone from your journal and mirror?"
PROVE_FORGOTTEN = "epibus.forget.prove"
# Core NATS request every node answers with its reconciliation of stream, journal and mirror.
VERIFY = "epibus.verify"
# Core NATS request: rebuild a node's mirror into a new collection and swap it in (progress on the request's
# `progress` inbox).
REINDEX = "epibus.reindex"
JOURNAL_REBUILD = "epibus.journal.rebuild"  # one node rebuilds its journal from the stream

# Core NATS request answered by one node of the `epibus-consumers` queue group: open a pull consumer for the
# signing agent, named for it and filtered to one of its projects (agents may not create consumers themselves).
CONSUMER_OPEN = "epibus.consumer.open"
CONSUMER_QUEUE = "epibus-consumers"
# Core NATS request, one node of `epibus-tombstones` answers: which of these claims' content hashes are
# tombstoned in a project (agents may not list the bucket: its keys are every project's hashes).
TOMBSTONE_CHECK = "epibus.tombstones.check"
TOMBSTONE_QUEUE = "epibus-tombstones"
# Core NATS request, one node of `epibus-enrolments` answers: the enrolment records an agent may see (of the agents
# it shares a project with; agents may not read the registry or the records: they name the whole fleet).
ENROLMENT_VIEW = "epibus.enrolments.view"
ENROLMENT_VIEW_QUEUE = "epibus-enrolments"

# Core NATS requests answered by one node of the `epibus-admin` queue group: enrol, revoke and list agents, and
# erase a forgotten artifact's messages from the stream (an admin asks; the node finds the messages itself).
FORGET_ERASE = "epibus.forget.erase"
ENROL = "epibus.agent.enrol"
REVOKE = "epibus.agent.revoke"
LIST_AGENTS = "epibus.agent.list"
POLICY_SET = "epibus.policy.set"
POLICY_SHOW = "epibus.policy.show"
ADMIN_QUEUE = "epibus-admin"
# Core NATS requests answered by a fleet's hub (the node holding the fleet CA): an admin invites a node or removes
# one; a joining node redeems its invite, signed by the invite's one-time key.
FLEET_INVITE = "epibus.fleet.invite"
FLEET_REMOVE = "epibus.fleet.remove"
FLEET_JOIN = "epibus.fleet.join"
FLEET_QUEUE = "epibus-fleet"
# A fleet hub's JetStream domain: a joined node's server maps its clients' `$JS.API.>` to `$JS.fleet.API.>`.
FLEET_DOMAIN = "fleet"

# Core NATS requests answered by one node of the `epibus-mesh` queue group: the node is the only writer of the
# mesh bucket; an agent asks it to apply a signed protocol step, a roster change or its capabilities.
MESH_STEP = "epibus.mesh.step"
MESH_ROSTER = "epibus.mesh.roster"
MESH_ADVERTISE = "epibus.mesh.advertise"
MESH_QUEUE = "epibus-mesh"

# Standing questions by meaning ("watches"). The bucket holds every agent's questions, so only nodes read and
# write it (an agent asks one: epibus.watch.*); notices live on
# `epiwatch.<owner key>.<watch id>.<project>.<artifact id>` in stream EPI_WATCH, and an agent reads only its own
# key's subjects, through a consumer a node opens for it.
WATCHES_BUCKET = "epibus_watches"
WATCH_STREAM = "EPI_WATCH"
WATCH_SUBJECTS = ("epiwatch.>",)
WATCH_REGISTER = "epibus.watch.register"
WATCH_STOP = "epibus.watch.stop"
WATCH_LIST = "epibus.watch.list"
WATCH_QUEUE = "epibus-watch"

# Node presence: each node's signed heartbeat, kept only a few seconds after its last write (a fan-out waits for
# exactly the live nodes). Written by nodes only: the broker refuses agents' writes.
NODES_BUCKET = "epibus_nodes"
NODES_STREAM = f"KV_{NODES_BUCKET}"  # as kv_stream(NODES_BUCKET), which is defined below

# Mesh state: one KV bucket; keys are built only by the functions below.
MESH_BUCKET = "epibus_mesh"
MESH_STREAM = f"KV_{MESH_BUCKET}"  # as kv_stream(MESH_BUCKET)

PROJECT_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
# The fleet's own records: nodes publish every enrolment change on `epi.epibus.enrolment.<agent>`, ordered with
# the events it governs. No agent is a member of this project and the broker refuses agents' publishes to it.
POLICY_PROJECT = "epibus"
ENROLMENT_KIND = "enrolment"
REVIEW_POLICY_KIND = "review_policy"
ENROLMENTS_FILTER = f"epi.{POLICY_PROJECT}.{ENROLMENT_KIND}.*"
# Every record a node keeps in the policy project: enrolments and projects' review policies.
AUTHORITY_FILTER = f"epi.{POLICY_PROJECT}.*.*"
KIND_PATTERN = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
ARTIFACT_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
CONSUMER_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class EventAddress(NamedTuple):
    project: str
    kind: str
    artifact_id: str


def event_subject(project: str, kind: str, artifact_id: str) -> str:
    return f"epi.{project}.{kind}.{artifact_id}"


def parse_event_subject(subject: str) -> EventAddress | None:
    """The address in an event subject, or None when the subject is not one epibus would publish."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[0] != "epi":
        return None
    _, project, kind, artifact_id = parts
    if not (
        PROJECT_PATTERN.fullmatch(project) and KIND_PATTERN.fullmatch(kind) and ARTIFACT_PATTERN.fullmatch(artifact_id)
    ):
        return None
    return EventAddress(project, kind, artifact_id)


def events_filter(project: str | None = None, kind: str | None = None) -> str:
    """A consumer filter for one project and/or one kind; every event when both are None.
    Raises ConfigError for a project or kind that no subject could hold."""
    if project is not None and not PROJECT_PATTERN.fullmatch(project):
        raise ConfigError("project", f"{project!r} must match {PROJECT_PATTERN.pattern}")
    if kind is not None and not KIND_PATTERN.fullmatch(kind):
        raise ConfigError("kind", f"{kind!r} must match {KIND_PATTERN.pattern}")
    if project is None and kind is None:
        return "epi.>"
    return f"epi.{project or '*'}.{kind or '*'}.*"


def project_subjects(project: str | None) -> str:
    """Every subject of one project's events (`epi.<project>.>`), of every project when None: a broker scope."""
    return f"epi.{project or '*'}.>"


# Every core NATS request epibus answers is under this prefix; the server's system account under the other.
REQUESTS_WILDCARD = "epibus.>"
SYSTEM_WILDCARD = "$SYS.>"


def artifact_filter(project: str, artifact_id: str) -> str:
    """Every event of one artifact, across kinds: the per-artifact compare-and-set scope."""
    return f"epi.{project}.*.{artifact_id}"


def stream_info_subject(stream: str) -> str:
    """JetStream's API subject for a stream's info; its answer carries the server's clock (`ts`), which nats-py's
    StreamInfo leaves out."""
    return js_api("STREAM.INFO", stream)


def stream_leader_stepdown_subject(stream: str) -> str:
    """The JetStream API request that makes a stream's leader step down (a placement may prefer a server)."""
    return js_api("STREAM.LEADER.STEPDOWN", stream)


def dlq_subject(consumer: str, reason: str) -> str:
    return f"epidlq.{consumer}.{reason}"


def parse_dlq_subject(subject: str) -> tuple[str, str] | None:
    """(consumer, reason) of a dead letter's subject, or None when it is not one dlq_subject builds."""
    parts = subject.split(".")
    if len(parts) != 3 or parts[0] != "epidlq":
        return None
    return parts[1], parts[2]


def vector_subject(text_key: str) -> str:
    """Where the shared vector of one text lives: its key (a sha256 of model id and text) names it."""
    if not re.fullmatch(r"[0-9a-f]{64}", text_key):
        raise ConfigError("text key", f"{text_key[:80]!r} is not a sha256 in hex")
    return f"epivec.{text_key}"


def dlq_filter(consumer: str | None = None) -> str:
    return f"epidlq.{consumer}.*" if consumer else "epidlq.>"


def task_key(project: str, task_id: str) -> str:
    """The mesh bucket key of one task."""
    return f"task.{project}.{task_id}"


def tasks_key_filter(project: str | None = None) -> str:
    """The KV stream subject filter for every task of a project (every project when None)."""
    return kv_subject(MESH_BUCKET, task_key(project or "*", "*"))


def roster_key(project: str) -> str:
    """The mesh bucket key holding a project's coordinators."""
    return f"roster.{project}"


def capabilities_key(agent_id: str) -> str:
    """The mesh bucket key holding the capabilities an agent advertises."""
    return f"agent.{agent_id}"


def node_key_record(public_key: str) -> str:
    """The agent registry key recording that `public_key` is a node's own identity (its operator's key)."""
    return f"node.{public_key}"


def heartbeat_key(public_key: str) -> str:
    """The nodes bucket key of the heartbeat signed by `public_key`: the key names its signer."""
    return f"node.{public_key}"


def heartbeat_subject(key: str) -> str:
    """The KV stream subject of a nodes bucket key (`$KV.<bucket>.<key>`)."""
    return kv_subject(NODES_BUCKET, key)


def heartbeats_filter() -> str:
    return heartbeat_subject(">")


AGENT_CONSUMER_PREFIX = "agent_"


def agent_consumer_name(public_key: str, slot: int) -> str:
    """The name of an agent's consumer in slot `slot`: the broker lets an agent pull from, inspect and delete
    exactly the names built from its own key, so the name is the permission."""
    return f"{AGENT_CONSUMER_PREFIX}{public_key}_{slot}"


ANY_PROJECT_TOKEN = "*"


def readable_project(stream: str, filter_subject: str) -> str:
    """The project a consumer filter on `stream` is confined to: a slug, `*` for a filter across projects (for
    agents of every project), or the fleet's own project for enrolment records and the mesh's capability
    records, which every agent reads. Raises ConfigError naming the filter forms allowed."""
    tokens = filter_subject.split(".")
    if tokens in (["epi", ">"], ["$KV", MESH_BUCKET, "task", ">"]):
        return ANY_PROJECT_TOKEN
    if stream == STREAM:
        allowed = "epi.<project|*>.>, epi.<project|*>.<kind|*>.<artifact|*|>>"
        project = tokens[1] if len(tokens) >= 3 and tokens[0] == "epi" else ""
        if _project_ok(project) and _event_tail_ok(tokens[2:]):
            return project
    elif stream == MESH_STREAM:
        allowed = "$KV.epibus_mesh.task.<project|*>.<task|*>, $KV.epibus_mesh.roster.<project>, $KV.epibus_mesh.agent.*"
        head, rest = tokens[:2], tokens[2:]
        if head == ["$KV", MESH_BUCKET] and rest:
            if rest[0] == "task" and len(rest) == 3 and _project_ok(rest[1]) and _token_ok(rest[2]):
                return rest[1]
            if rest[0] == "roster" and len(rest) == 2 and _project_ok(rest[1]):
                return rest[1]
            if rest[0] == "agent" and len(rest) == 2 and _token_ok(rest[1]):
                return POLICY_PROJECT
    else:
        raise ConfigError("stream", f"{stream!r} has no consumers for agents", allowed=(STREAM, MESH_STREAM))
    raise ConfigError("filter_subject", f"{filter_subject[:200]!r} is no filter of a project", allowed=[allowed])


def _project_ok(token: str) -> bool:
    return token == ANY_PROJECT_TOKEN or PROJECT_PATTERN.fullmatch(token) is not None


def _token_ok(token: str) -> bool:
    return token == "*" or ARTIFACT_PATTERN.fullmatch(token) is not None


def _event_tail_ok(tail: list[str]) -> bool:
    if tail == [">"]:
        return True
    if len(tail) == 2 and (tail[0] == "*" or KIND_PATTERN.fullmatch(tail[0])):
        return tail[1] == ">" or _token_ok(tail[1])
    return False


def kv_subject_key(subject: str) -> str:
    """The key of a mesh KV stream message subject (`$KV.<bucket>.<key>`)."""
    return subject.removeprefix(kv_subject(MESH_BUCKET, ""))


def kv_stream(bucket: str) -> str:
    """The JetStream stream that holds a KV bucket."""
    return f"KV_{bucket}"


def kv_subject(bucket: str, key: str) -> str:
    """The stream subject of a KV key (`$KV.<bucket>.<key>`); `key` may be a wildcard (`>`, `a.*`)."""
    return f"$KV.{bucket}.{key}"


# JetStream's API subjects; `js_api("STREAM.INFO", name)` is `$JS.API.STREAM.INFO.<name>`.
JS_API = "$JS.API"


def js_api(*parts: str) -> str:
    """A JetStream API subject (also a pattern when a part is a wildcard), for permissions and raw requests."""
    return ".".join((JS_API, *parts))


def in_js_domain(subject: str, domain: str) -> str:
    """A JetStream API subject as addressed to JetStream domain `domain` (`$JS.<domain>.API.…`)."""
    return f"$JS.{domain}.API" + subject.removeprefix(JS_API)


# Headers. JetStream's own: the event id deduplicates, and the expected last sequence on a subject filter makes
# a state change compare-and-set per artifact (a stale sequence is refused with err_code 10071).
MSG_ID_HEADER = "Nats-Msg-Id"
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
EXPECTED_LAST_SUBJECT_SEQ_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"


def cas_headers(project: str, artifact_id: str, expected_seq: int) -> dict[str, str]:
    """Compare-and-set headers: JetStream refuses the publish if anything was written on the artifact's
    subjects (any kind) after `expected_seq`. A fresh dict each call: nats-py writes into the one it gets."""
    return {
        EXPECTED_LAST_SUBJECT_SEQ: str(expected_seq),
        EXPECTED_LAST_SUBJECT_SEQ_SUBJECT: artifact_filter(project, artifact_id),
    }


# A dead letter's headers: why it was dead-lettered, and where the original message was.
DLQ_REASON = "Epibus-Dlq-Reason"
DLQ_ERROR = "Epibus-Dlq-Error"
DLQ_SUBJECT = "Epibus-Dlq-Subject"
DLQ_STREAM_SEQ = "Epibus-Dlq-Stream-Seq"
DLQ_CONSUMER = "Epibus-Dlq-Consumer"
DLQ_AT = "Epibus-Dlq-At"
DLQ_DIGEST = "Epibus-Dlq-Sha256"  # of the original message, whole
DLQ_SIZE = "Epibus-Dlq-Size"  # the original message's size in bytes
DLQ_TRUNCATED = "Epibus-Dlq-Truncated"  # present when only this many first bytes were kept

# A signed request's headers (bus/identity/signing.py signs and checks them).
SIGNER_HEADER = "Epibus-Signer"
SIGNER_KEY_HEADER = "Epibus-Signer-Key"
SIGNED_AT_HEADER = "Epibus-Signed-At"
SIGNATURE_HEADER = "Epibus-Signature"
# An event's signature and signing key (an nkey user public key, 'U…') travel beside its body in these headers.
EVENT_SIGNATURE_HEADER = "Epibus-Event-Signature"
EVENT_KEY_HEADER = "Epibus-Event-Key"


class NoticeAddress(NamedTuple):
    owner_key: str
    watch_id: str
    project: str
    artifact_id: str


def watch_key(owner_key: str, watch_id: str) -> str:
    """The watches bucket key of one watch: its owner's key first, so an owner's watches share a prefix."""
    return f"{owner_key}.{watch_id}"


def notice_subject(owner_key: str, watch_id: str, project: str, artifact_id: str) -> str:
    """Where the notices of one watch about one artifact live."""
    return f"epiwatch.{owner_key}.{watch_id}.{project}.{artifact_id}"


def notices_filter(owner_key: str) -> str:
    """Every notice pushed to one owner: the one filter a node opens an agent's notice consumer with."""
    return f"epiwatch.{owner_key}.>"


def pushed_filter(project: str, artifact_id: str) -> str:
    """Every notice about one artifact, whoever it was pushed to (follow-ups and forget find them by it)."""
    return f"epiwatch.*.*.{project}.{artifact_id}"


def parse_notice_subject(subject: str) -> NoticeAddress | None:
    parts = subject.split(".")
    if len(parts) != 5 or parts[0] != "epiwatch":
        return None
    return NoticeAddress(*parts[1:])
