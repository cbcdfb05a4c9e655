"""Who may do what to whose claims: the authority policy. `bus.model.state.decide` calls `authorize` before anything
else, and every path that applies events decides with `decide` (the journal's projection, the mirror, the
client's fold before it publishes, replay, repair, reindex, a node catching up): one rule, so what one path
refuses every path refuses, with the same reason.

A decision must come out the same on every path, however late it runs, so it reads enrolments as they stood at
the event's place in the stream. A node publishes every enrolment change (enrol, new roles, projects or owner,
revoke) as an `enrolment` event signed by its own identity on `epi.epibus.enrolment.<agent>`, before it writes
the registry; the event at stream sequence S is decided with each agent's last enrolment record before S. An
agent with no record yet stands as a first-use enrolment: an agent of every project, its own owner (what a
server without authentication gives every agent)."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import ClassVar, Protocol

from bus.errors import Forbidden
from bus.model.auth import NODE_PREFIX, Enrolment, ReviewPolicy, first_use_enrolment, is_node_identity
from bus.model.event import Actor, Envelope, draft_event
from bus.model.ids import new_event_id
from bus.model.kinds import Body, FindingBody, ForgottenBody, ResolvedBody, RolledBackBody, VerifiedBody, register_kind
from bus.model.vocab import ResolutionKind, Role
from bus.subjects import ENROLMENT_KIND, POLICY_PROJECT, REVIEW_POLICY_KIND

# The rules, by the name a refusal gives.
RULE_ENROLMENT = "enrolment-records"
RULE_REVOKED = "revoked"
RULE_MEMBERSHIP = "membership"
RULE_VERIFIER_ROLE = "verifier-role"
RULE_ONE_OWNER = "one-owner"
RULE_AUTHOR_OR_ADMIN = "author-or-admin"

VERIFIER_ROLES = frozenset({Role.agent, Role.reviewer})
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class EnrolmentBody(Body):
    """An agent's enrolment from this point of the stream on, as the node that made the change wrote it."""

    kind: ClassVar[str] = ENROLMENT_KIND
    system_record: ClassVar[bool] = True  # published by nodes, never by hand
    enrolment: Enrolment

    def content_text(self) -> str:
        e = self.enrolment
        state = f"revoked at {e.revoked_at.isoformat()}" if e.revoked_at else "active"
        return (
            f"{e.agent_id} enrolled by {e.enrolled_by}: owner {e.owner}, roles {', '.join(e.roles)}, "
            f"projects {', '.join(e.projects)}, {state}"
        )


register_kind(EnrolmentBody)


class ReviewPolicyBody(Body):
    """A project's review policy from this point of the stream on, as the node that an admin asked wrote it."""

    kind: ClassVar[str] = REVIEW_POLICY_KIND
    system_record: ClassVar[bool] = True  # published by nodes, never by hand
    policy: ReviewPolicy

    def content_text(self) -> str:
        p = self.policy
        if p.human_review_impact is None:
            return f"{p.project}: no claim needs a person's review (set by {p.set_by})"
        return (
            f"{p.project}: claims of impact {p.human_review_impact:g} or more need a person's review, "
            f"{p.mode.value} until then (set by {p.set_by})"
        )


register_kind(ReviewPolicyBody)


class EventSigner(Protocol):
    """A key that signs events as its actor (bus.identity.signing.AgentKey): the model names what it needs and
    stays free of key files."""

    @property
    def actor(self) -> Actor: ...

    def sign(self, event: Envelope) -> Envelope: ...


def _node_record(node: EventSigner, body: EnrolmentBody | ReviewPolicyBody, filed_as: str, session_id: str) -> Envelope:
    draft = draft_event(
        body.kind,
        body,
        project=POLICY_PROJECT,
        actor=node.actor,
        session_id=session_id,
        artifact_id=filed_as,
        event_id=new_event_id(),
    )
    return node.sign(draft)


def enrolment_event(node: EventSigner, enrolment: Enrolment, *, session_id: str = "enrolment") -> Envelope:
    """The signed record of an enrolment change. `node` is the node's event identity (signing.node_event_key)."""
    return _node_record(node, EnrolmentBody(enrolment=enrolment), enrolment.agent_id, session_id)


def policy_event(node: EventSigner, policy: ReviewPolicy, *, session_id: str = "policy") -> Envelope:
    """The signed record of a project's review policy, filed under the project's name in the policy project."""
    return _node_record(node, ReviewPolicyBody(policy=policy), policy.project, session_id)


def enrolment_problem(event: Envelope) -> str | None:
    """Why an event in the policy project, or of a kind only it holds, records nothing (None: it is a record,
    an enrolment or a project's review policy)."""
    body = event.body
    if isinstance(body, EnrolmentBody):
        what, asks, filed_as = "enrolment records", "epibus agent add", body.enrolment.agent_id
        misfiled = f"the record is filed under {event.artifact_id} but enrols {filed_as}"
    elif isinstance(body, ReviewPolicyBody):
        what, asks, filed_as = "review policies", "epibus policy set", body.policy.project
        misfiled = f"the policy is filed under {event.artifact_id} but governs {filed_as}"
    else:
        return f"project {POLICY_PROJECT} holds only enrolment records and review policies"
    if event.project != POLICY_PROJECT:
        return f"{what} live in project {POLICY_PROJECT}, not {event.project}"
    if not is_node_identity(event.actor.agent_id, event.actor.public_key):
        return f"only a node publishes {what} (an admin asks one: {asks})"
    if event.artifact_id != filed_as:
        return misfiled
    if isinstance(body, EnrolmentBody) and filed_as.startswith(NODE_PREFIX):
        return f"{filed_as} is a node identity: nodes are not enrolled"
    return None


def enrolment_record(event: Envelope) -> Enrolment | None:
    """The enrolment an admitted event records, or None when it is not a valid enrolment record."""
    if not isinstance(event.body, EnrolmentBody) or enrolment_problem(event) is not None:
        return None
    return event.body.enrolment


def policy_record(event: Envelope) -> ReviewPolicy | None:
    """The review policy an admitted event records, or None when it is not a valid policy record."""
    if not isinstance(event.body, ReviewPolicyBody) or enrolment_problem(event) is not None:
        return None
    return event.body.policy


@dataclass(frozen=True)
class Authority:
    """The enrolment records a stream holds: for each agent, (stream sequence, enrolment) in stream order."""

    records: Mapping[str, tuple[tuple[int, Enrolment], ...]] = field(default_factory=dict)
    # Each project's review policies, (stream sequence, policy) in stream order.
    policies: Mapping[str, tuple[tuple[int, ReviewPolicy], ...]] = field(default_factory=dict)

    @classmethod
    def of(
        cls, records: Iterable[tuple[int, Enrolment]], policies: Iterable[tuple[int, ReviewPolicy]] = ()
    ) -> Authority:
        found: dict[str, list[tuple[int, Enrolment]]] = {}
        for seq, enrolment in sorted(records, key=lambda r: r[0]):
            found.setdefault(enrolment.agent_id, []).append((seq, enrolment))
        by_project: dict[str, list[tuple[int, ReviewPolicy]]] = {}
        for seq, policy in sorted(policies, key=lambda r: r[0]):
            by_project.setdefault(policy.project, []).append((seq, policy))
        return cls(
            {agent: tuple(rows) for agent, rows in found.items()},
            {project: tuple(rows) for project, rows in by_project.items()},
        )

    @property
    def last_seq(self) -> int:
        """The stream sequence of the newest record, an enrolment or a review policy."""
        newest = [rows[-1][0] for rows in (*self.records.values(), *self.policies.values())]
        return max(newest, default=0)

    def policies_in_order(self) -> list[tuple[int, ReviewPolicy]]:
        return sorted((row for rows in self.policies.values() for row in rows), key=lambda r: r[0])

    def policy(self, project: str, seq: int | None = None) -> ReviewPolicy | None:
        """The project's review policy in force before stream sequence `seq` (None: the latest), if any."""
        rows = self.policies.get(project, ())
        at = len(rows) if seq is None else bisect.bisect_left([s for s, _ in rows], seq)
        return rows[at - 1][1] if at else None

    def in_order(self) -> list[tuple[int, Enrolment]]:
        return sorted((row for rows in self.records.values() for row in rows), key=lambda r: r[0])

    def record(self, agent_id: str, seq: int) -> Enrolment | None:
        """The agent's last enrolment record before stream sequence `seq`, if it has one."""
        rows = self.records.get(agent_id, ())
        at = bisect.bisect_left([s for s, _ in rows], seq)
        return rows[at - 1][1] if at else None

    def standing(self, actor: Actor, seq: int) -> Enrolment:
        """What the actor may do at `seq`: its record, else a node's standing (an admin) or a first-use agent's."""
        if is_node_identity(actor.agent_id, actor.public_key):
            return _unrecorded(actor.agent_id, actor.public_key, node=True)
        return self.record(actor.agent_id, seq) or _unrecorded(actor.agent_id, actor.public_key, node=False)

    def owner(self, agent_id: str, seq: int) -> str:
        record = self.record(agent_id, seq)
        return record.owner if record is not None else agent_id


@functools.lru_cache(maxsize=4096)  # asked for every event by an agent without a record: build it once
def _unrecorded(agent_id: str, public_key: str, *, node: bool) -> Enrolment:
    first_use = first_use_enrolment(agent_id, public_key, enrolled_at=EPOCH)
    # A node's own identity: an admin of every project, enrolled by itself.
    return first_use.model_copy(update={"roles": (Role.admin,), "enrolled_by": agent_id}) if node else first_use


NO_RECORDS = Authority()


class Authored(Protocol):
    """What the rules read of an artifact's state (bus.model.state.ArtifactState): who wrote it, and its id."""

    @property
    def artifact_id(self) -> str: ...
    @property
    def author(self) -> str: ...


Lookup = Callable[[str], Authored | None]


def authorize(event: Envelope, seq: int, lookup: Lookup, authority: Authority) -> None:
    """Raise Forbidden, naming the rule, when the event's actor may not do what the event does at stream
    sequence `seq`. Pure. Whether the change is legal at all is `decide`'s business; this says who may."""
    actor, publish, where = event.actor.agent_id, f"publish {event.kind}", f"in project {event.project}"
    if event.project == POLICY_PROJECT or isinstance(event.body, EnrolmentBody):
        problem = enrolment_problem(event)
        if problem is not None:
            raise Forbidden(actor, publish, where, _rule(RULE_ENROLMENT, problem))
        return
    standing = authority.standing(event.actor, seq)
    if standing.revoked_at is not None:
        why = f"its enrolment was revoked at {standing.revoked_at.isoformat()}"
        raise Forbidden(actor, publish, where, _rule(RULE_REVOKED, why))
    if not standing.member_of(event.project):
        why = f"it is not a member of project {event.project} (its projects: {', '.join(standing.projects)})"
        raise Forbidden(actor, publish, where, _rule(RULE_MEMBERSHIP, why))
    body = event.body
    if isinstance(body, VerifiedBody):
        _require_verifier(event, seq, lookup, authority, standing)
    elif isinstance(body, ResolvedBody | RolledBackBody | ForgottenBody):
        _require_author_or_admin(event, seq, lookup(event.artifact_id), authority, standing)
    elif isinstance(body, FindingBody) and body.supersedes is not None:
        _require_author_or_admin(event, seq, lookup(body.supersedes), authority, standing)


def human_review(event: Envelope, seq: int, authority: Authority) -> bool:
    """A verification is a person's review when its signer was enrolled as a person at that point of the stream
    (a person's key is kept encrypted and signs only at the CLI; no agent identity may hold reviewer)."""
    return authority.standing(event.actor, seq).is_person


def _rule(name: str, why: str) -> str:
    return f"rule {name}: {why}"


def _action(event: Envelope) -> str:
    body = event.body
    if isinstance(body, ResolvedBody):
        return "retract" if body.resolution is ResolutionKind.retracted else f"resolve (as {body.resolution})"
    if isinstance(body, FindingBody):
        return "supersede"
    return {"rolled_back": "roll back", "forgotten": "forget", "verified": "verify"}.get(event.kind, event.kind)


def _require_verifier(event: Envelope, seq: int, lookup: Lookup, authority: Authority, standing: Enrolment) -> None:
    actor = event.actor.agent_id
    target = lookup(event.artifact_id)
    what = f"claim {event.artifact_id} in project {event.project}"
    if not VERIFIER_ROLES & set(standing.roles):
        why = f"only an agent or a reviewer verifies; its roles are {', '.join(standing.roles)}"
        raise Forbidden(actor, "verify", what, _rule(RULE_VERIFIER_ROLE, why))
    if target is None or target.author == actor:
        return  # decide refuses a missing claim and a verification by its author, each with its own reason
    owner = authority.owner(target.author, seq)
    if owner == standing.owner:
        why = f"it and the author {target.author} have one owner ({owner}); another owner must verify"
        raise Forbidden(actor, "verify", what, _rule(RULE_ONE_OWNER, why))


def _require_author_or_admin(
    event: Envelope, seq: int, target: Authored | None, authority: Authority, standing: Enrolment
) -> None:
    actor = event.actor.agent_id
    if target is None or target.author == actor or standing.has_role(Role.admin):
        return  # a missing target is refused (or forgotten as nothing) by decide
    owner = authority.owner(target.author, seq)
    if owner == standing.owner:
        return  # two identities of one owner are one author
    action = _action(event)
    why = f"only the author's identities (owner {owner}) or an admin may {action} another's claim"
    what = f"{target.author}'s claim {target.artifact_id} in project {event.project}"
    raise Forbidden(actor, action, what, _rule(RULE_AUTHOR_OR_ADMIN, why))
