"""Who may connect to a node's NATS and what the broker lets each identity do: an agent's enrolment record,
the broker permissions it gets, and the nats-server authorization block built from them. The only module that
decides broker permissions.

An agent authenticates with the nkey it signs events with. The node's own service identity has every
permission; an enrolled agent publishes events only under its projects, asks node services, reads through the
JetStream calls its commands need and may never delete, purge or reconfigure a stream, delete a message, or
write the buckets that decide things (agent registry, tombstones, the mesh, node heartbeats)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from bus.model.fields import AGENT_PATTERN, Unit
from bus.model.vocab import Identity, ReviewMode, Role
from bus.subjects import (
    AGENT_KEYS_BUCKET,
    DLQ_SUBJECTS,
    JS_API,
    MESH_BUCKET,
    NODES_BUCKET,
    NODES_STREAM,
    POLICY_PROJECT,
    PROJECT_PATTERN,
    REQUESTS_WILDCARD,
    STREAM,
    SYSTEM_WILDCARD,
    TOMBSTONES_BUCKET,
    WATCH_STREAM,
    WATCH_SUBJECTS,
    WATCHES_BUCKET,
    agent_consumer_name,
    capabilities_key,
    in_js_domain,
    js_api,
    kv_stream,
    kv_subject,
    project_subjects,
    roster_key,
    task_key,
)

ANY_PROJECT = "*"
# How many consumers one agent may hold open on each stream it reads (`epibus up --agent-consumers`).
DEFAULT_CONSUMER_SLOTS = 8
OWNER_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@:+-]{0,127}$")
PUBLIC_KEY_PATTERN = re.compile(r"^U[A-Z2-7]{55}$")
# Who may read through the audit doors (every state, retracted and rolled-back claims included).
AUDIT_ROLES = (Role.reviewer, Role.admin)


def _project_scope(value: str) -> str:
    if value != ANY_PROJECT and not PROJECT_PATTERN.fullmatch(value):
        raise ValueError(f"{value!r} is neither a project slug ({PROJECT_PATTERN.pattern}) nor {ANY_PROJECT!r}")
    if value == POLICY_PROJECT:
        raise ValueError(f"{POLICY_PROJECT!r} holds the fleet's enrolment records; no agent is a member of it")
    return value


AgentId = Annotated[str, StringConstraints(pattern=AGENT_PATTERN.pattern)]
PublicKey = Annotated[str, StringConstraints(pattern=PUBLIC_KEY_PATTERN.pattern)]
Owner = Annotated[str, StringConstraints(pattern=OWNER_PATTERN.pattern)]
ProjectScope = Annotated[str, AfterValidator(_project_scope)]


class Enrolment(BaseModel):
    """One agent identity as the registry holds it. `owner` names the person or system behind it: two
    identities with one owner are one author (neither verifies the other's claims)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    agent_id: AgentId
    public_key: PublicKey
    owner: Owner
    roles: tuple[Role, ...] = Field(min_length=1, max_length=len(Role))
    projects: tuple[ProjectScope, ...] = Field(min_length=1, max_length=256)
    enrolled_by: Owner
    enrolled_at: datetime
    revoked_at: datetime | None = None
    # None: enrolled before identities had a kind, an agent (a reviewer role it holds no longer makes its
    # verifications a person's review).
    identity: Identity | None = None

    @model_validator(mode="after")
    def _reviewers_are_people(self) -> Enrolment:
        if self.identity is Identity.agent and Role.reviewer in self.roles:
            raise ValueError(reviewer_refusal(self.agent_id))
        return self

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    @property
    def is_person(self) -> bool:
        return self.identity is Identity.person

    def member_of(self, project: str) -> bool:
        if project == POLICY_PROJECT:
            return False  # only nodes write there, and not as members
        return ANY_PROJECT in self.projects or project in self.projects

    def has_role(self, role: Role) -> bool:
        return role in self.roles

    def revoked(self, at: datetime) -> Enrolment:
        return self.model_copy(update={"revoked_at": at})

    def same_standing(self, other: Enrolment) -> bool:
        """Whether two records give an identity the same key, owner, roles, projects, revocation and kind."""
        return (
            self.public_key == other.public_key
            and self.owner == other.owner
            and set(self.roles) == set(other.roles)
            and set(self.projects) == set(other.projects)
            and self.active == other.active
            and self.kind == other.kind
        )

    @property
    def kind(self) -> Identity:
        """Its identity kind; a record from before kinds were recorded is an agent's."""
        return self.identity or Identity.agent


class ReviewPolicy(BaseModel):
    """What a project asks of its claims. `human_review_impact` None: no claim needs a person."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    project: Annotated[str, StringConstraints(pattern=PROJECT_PATTERN.pattern)]
    human_review_impact: Unit | None = None
    mode: ReviewMode = ReviewMode.rank
    set_by: AgentId
    set_at: datetime


def reviewer_refusal(agent_id: str) -> str:
    """Why an agent identity may not hold the reviewer role (its verifications would pass for a person's)."""
    return (
        f"{agent_id} is an agent identity and only a person may hold the reviewer role (a reviewer's verification "
        f"is recorded as a person's review); enrol the person with `epibus person add`"
    )


FIRST_USE = "first-use"
NODE_PREFIX = "node-"


def node_identity(public_key: str) -> str:
    """The agent id a node signs its enrolment records with: its key, named. The id names the key, so no other
    key can pass for that node, and an admin never enrols an agent under a `node-` id."""
    return NODE_PREFIX + public_key.lower()


def is_node_identity(agent_id: str, public_key: str) -> bool:
    return agent_id == node_identity(public_key)


def first_use_enrolment(agent_id: str, public_key: str, *, enrolled_at: datetime) -> Enrolment:
    """What a server without authentication binds to an agent the first time its key is seen: an agent of
    every project and its own owner. A node with authentication enrols agents explicitly instead."""
    return Enrolment(
        agent_id=agent_id,
        public_key=public_key,
        owner=agent_id,
        roles=(Role.agent,),
        projects=(ANY_PROJECT,),
        enrolled_by=FIRST_USE,
        enrolled_at=enrolled_at,
    )


def inbox_prefix(public_key: str) -> str:
    """The only inboxes an identity may subscribe to: replies addressed to anyone else never reach it."""
    return f"_INBOX_{public_key}"


_INBOX = re.compile(r"^_INBOX_(U[A-Z2-7]{55})(\.[^\s.*>]+)+$")


def inbox_owner(subject: str) -> str | None:
    """The public key whose inbox `subject` is (`_INBOX_<key>.<token>…`, no wildcards), or None when it is no
    identity's inbox."""
    match = _INBOX.fullmatch(subject)
    return match.group(1) if match else None


def _event_subjects(projects: Sequence[str]) -> list[str]:
    if ANY_PROJECT in projects:
        return [project_subjects(None)]
    return [project_subjects(project) for project in sorted(set(projects))]


# The JetStream API calls an agent's commands make. An agent never creates a consumer: a node opens one for it
# (epibus.consumer.open) named for its key, filtered to one of its projects, pull only; the broker lets it pull
# from, inspect and delete exactly those names (bus/services/consumer_slots.py). The stream lookups allowed carry their
# filter in the subject (direct get of the newest matching message). Everything else under $JS.API is refused:
# creating consumers (a push consumer would deliver where its creator likes), other consumers' messages,
# stream info of the buckets whose keys name projects (a subjects filter in the body lists every key: the mesh
# is read by direct get, tombstones are checked by a node), message gets by sequence.
def _agent_api(enrolment: Enrolment, consumer_slots: int) -> list[str]:
    scopes = _event_subjects(enrolment.projects)
    mesh = kv_stream(MESH_BUCKET)
    own_consumers = [
        js_api(call, stream, agent_consumer_name(enrolment.public_key, slot))
        for stream in (STREAM, mesh, WATCH_STREAM)  # on EPI_WATCH a node opens them on the agent's own notices only
        for slot in range(consumer_slots)
        for call in ("CONSUMER.MSG.NEXT", "CONSUMER.INFO", "CONSUMER.DELETE")
    ]
    return [
        js_api("INFO"),
        *own_consumers,
        *(js_api("DIRECT.GET", STREAM, scope) for scope in scopes),
        # Not the registry nor the enrolment records: they name every agent, key and project of the fleet. An
        # agent asks a node for the enrolments it shares a project with (epibus.enrolments.view).
        # Task records and rosters of its projects, everyone's capabilities; written only by a node (epibus.mesh.*).
        *(js_api("DIRECT.GET", mesh, scope) for scope in _mesh_scopes(enrolment.projects)),
        # Node heartbeats: read before every fan-out, to know whose answers to wait for; written only by nodes.
        js_api("STREAM.INFO", NODES_STREAM),
        js_api("STREAM.MSG.GET", NODES_STREAM),
    ]


def _mesh_scopes(projects: Sequence[str]) -> list[str]:
    if ANY_PROJECT in projects:
        return [kv_subject(MESH_BUCKET, ">")]
    keys = [key for project in sorted(set(projects)) for key in (task_key(project, ">"), roster_key(project))]
    return [kv_subject(MESH_BUCKET, key) for key in [*keys, capabilities_key("*")]]


# Refused even where an allow above would match: deny wins in nats-server.
_AGENT_DENY = [
    *(
        js_api(call, ">")
        for call in (
            "STREAM.CREATE",
            "STREAM.UPDATE",
            "STREAM.DELETE",
            "STREAM.PURGE",
            "STREAM.MSG.DELETE",
            "STREAM.SNAPSHOT",
            "STREAM.RESTORE",
            "CONSUMER.CREATE",
            "CONSUMER.DURABLE.CREATE",
        )
    ),
    kv_subject(AGENT_KEYS_BUCKET, ">"),
    kv_subject(TOMBSTONES_BUCKET, ">"),
    kv_subject(NODES_BUCKET, ">"),  # node heartbeats: an agent announcing itself would be waited for
    kv_subject(MESH_BUCKET, ">"),  # task records, rosters, capabilities: an agent asks a node (epibus.mesh.*) to write
    project_subjects(POLICY_PROJECT),  # enrolment records: published by nodes only
    kv_subject(WATCHES_BUCKET, ">"),  # every agent's standing questions: an agent asks a node (epibus.watch.*)
    *WATCH_SUBJECTS,  # notices: pushed by nodes only
    *DLQ_SUBJECTS,
    SYSTEM_WILDCARD,
]


def agent_permissions(
    enrolment: Enrolment,
    *,
    consumer_slots: int,
    suspended: bool = False,
    events_held: bool = False,
    js_domain: str | None = None,
) -> dict[str, Any]:
    """The broker permissions of one enrolled agent, with `consumer_slots` consumers per stream it reads. A
    `suspended` agent (over its publish budget) keeps its reads and loses publishing events and asking nodes;
    while `events_held` (the node's disk is below its reserve) it may ask nodes, so reads through them go on.
    `js_domain`: on a fleet's leaf, whose server maps `$JS.API.>` to the fleet's domain before it checks
    permissions, each JetStream API subject is stated in that form too."""
    events = [] if events_held else _event_subjects(enrolment.projects)
    writes = [] if suspended else [*events, REQUESTS_WILDCARD]
    return {
        "publish": {
            "allow": in_domain([*writes, *_agent_api(enrolment, consumer_slots)], js_domain),
            "deny": in_domain(_AGENT_DENY, js_domain),
        },
        "subscribe": {"allow": [f"{inbox_prefix(enrolment.public_key)}.>"]},
    }


def in_domain(subjects: Sequence[str], js_domain: str | None) -> list[str]:
    """`subjects`, each JetStream API subject followed by its twin in `js_domain` (`$JS.<domain>.API.…`)."""
    out: list[str] = []
    for subject in subjects:
        out.append(subject)
        if js_domain is not None and subject.startswith(f"{JS_API}."):
            out.append(in_js_domain(subject, js_domain))
    return out


def render_authorization(
    node_keys: Sequence[str],
    enrolments: Iterable[Enrolment],
    *,
    consumer_slots: int = DEFAULT_CONSUMER_SLOTS,
    suspended: frozenset[str] = frozenset(),
    events_held: bool = False,
    js_domain: str | None = None,
    extra_users: Sequence[dict[str, Any]] = (),
) -> str:
    """The nats-server `authorization` block: the node identities with every permission, each active enrolled
    agent with its own, and `extra_users` as given (a fleet's joining nodes). A revoked or unknown key is not a
    user, so it cannot connect. (nats-server's config format reads JSON.)"""
    users: list[dict[str, Any]] = [{"nkey": key} for key in sorted(set(node_keys))]
    listed = set(node_keys)
    for enrolment in sorted(enrolments, key=lambda e: e.agent_id):
        if not enrolment.active or enrolment.public_key in listed:
            continue
        if is_node_identity(enrolment.agent_id, enrolment.public_key):
            continue  # its record lets it sign enrolment records; the node connects with its own key
        listed.add(enrolment.public_key)
        permissions = agent_permissions(
            enrolment,
            consumer_slots=consumer_slots,
            suspended=enrolment.public_key in suspended,
            events_held=events_held,
            js_domain=js_domain,
        )
        users.append({"nkey": enrolment.public_key, "permissions": permissions})
    users += [user for user in extra_users if user["nkey"] not in listed]
    return "authorization " + json.dumps({"users": users}, indent=1) + "\n"
