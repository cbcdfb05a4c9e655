"""Who may ask a node's request services what. The guard finds who signed a request (the signature, then the
signer's enrolment in the agent registry) before its body is read; then the service's rule, one function per
rule below, decides on the validated request. A refusal is a Forbidden naming the rule.

A node with authentication answers signed requests only, and replies (even to refuse) only on an identity's
inbox (`_INBOX_<key>.…`): the node publishes with every permission, so a reply subject of the asker's choosing
(a stream's delete API, an event subject) is never published to; such a request is counted and logged. A node
without authentication (anyone may connect, ask unsigned and publish anywhere) answers unsigned requests as
before and refuses only a signature that does not verify: applying a rule to a signed request there would
keep out nobody who leaves the signature off."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Generic, TypeVar

from nats.aio.msg import Msg
from pydantic import BaseModel

from bus.enrolment.recent import RecentEnrolments
from bus.enrolment.registry import AgentRegistry
from bus.errors import ConfigError, Conflict, Forbidden
from bus.identity.signing import verify_request
from bus.model.auth import ANY_PROJECT as ANY
from bus.model.auth import AUDIT_ROLES, Enrolment, inbox_owner, inbox_prefix
from bus.model.requests import (
    ConsumerOpenRequest,
    EraseRequest,
    ForgetProofRequest,
    JournalReadRequest,
    PolicySetRequest,
    PolicyShowRequest,
    RecallRequest,
    ReindexRequest,
    TombstoneCheckRequest,
    VerifyRequest,
)
from bus.model.vocab import Role
from bus.model.watch import WatchRegisterRequest
from bus.subjects import (
    POLICY_PROJECT,
    SIGNATURE_HEADER,
    SIGNED_AT_HEADER,
    SIGNER_HEADER,
    SIGNER_KEY_HEADER,
    WATCH_STREAM,
    notices_filter,
    readable_project,
)

SIGNING_HEADERS = (SIGNER_HEADER, SIGNER_KEY_HEADER, SIGNED_AT_HEADER, SIGNATURE_HEADER)
Req = TypeVar("Req", bound=BaseModel)
Req_contra = TypeVar("Req_contra", bound=BaseModel, contravariant=True)


@dataclass(frozen=True)
class Asker:
    """Who signed a request: the node's own key (its operator, who may do everything) or an enrolled, active
    agent with its roles and projects."""

    agent_id: str
    public_key: str
    subject: str
    enrolment: Enrolment | None  # None: the node's own key

    def has_role(self, *roles: Role) -> bool:
        return self.enrolment is None or any(self.enrolment.has_role(role) for role in roles)

    def member_of(self, project: str) -> bool:
        return self.enrolment is None or self.enrolment.member_of(project)

    def refuse(self, rule: str) -> Forbidden:
        return Forbidden(self.agent_id, "ask", self.subject, rule)


Rule = Callable[[Asker, Req], None]
_ASKER: ContextVar[Asker | None] = ContextVar("epibus_asker", default=None)


@contextmanager
def answering(asker: Asker | None) -> Iterator[None]:
    """While a responder's handler runs: `current_asker()` names who signed the request."""
    token = _ASKER.set(asker)
    try:
        yield
    finally:
        _ASKER.reset(token)


def current_asker() -> Asker | None:
    """Who signed the request being answered: None on a node without authentication (unsigned), or when the
    node's own key signed it (Asker.enrolment None: the operator, who sees everything)."""
    return _ASKER.get()


@dataclass(frozen=True)
class Authorizer(Generic[Req_contra]):
    """What a responder checks: `replies_to` whether it may publish on the reply subject at all, `identify` on
    the raw message before its body is read (who signed it; None when nobody needs to, an unsigned request on a
    node without authentication), then `rule` on the validated request. The last two raise Forbidden."""

    replies_to: Callable[[str], bool]
    identify: Callable[[Msg], Awaitable[Asker | None]]
    rule: Callable[[Asker, Req_contra], None]


class ServiceGuard:
    """Identifies the signers of one node's requests. `enforce`: the node authenticates its clients, so every
    request must be signed by the node's key or an enrolled, active agent, and the rules apply."""

    def __init__(self, registry: AgentRegistry, node_key: str, *, enforce: bool) -> None:
        self.registry = registry
        self.node_key = node_key
        self.enforce = enforce
        self._recent: RecentEnrolments[str, Enrolment | None] = RecentEnrolments()

    def authorizer(self, rule: Rule[Req], *, always: bool = False) -> Authorizer[Req]:
        """`always`: apply the rule on a node without authentication too (the enrolment services: the registry
        is written for admins only, whatever the server)."""
        enforce = always or self.enforce

        def replies_to(reply: str) -> bool:
            return not enforce or inbox_owner(reply) is not None

        async def identify(msg: Msg) -> Asker | None:
            return await self.identify(msg, enforce=enforce)

        return Authorizer(replies_to, identify, rule)

    def drop(self, agent_id: str) -> None:
        """Forget a cached enrolment (this node changed it)."""
        self._recent.drop(agent_id)

    async def identify(self, msg: Msg, *, enforce: bool) -> Asker | None:
        headers = msg.headers or {}
        if not enforce and not any(h in headers for h in SIGNING_HEADERS):
            return None
        signer = verify_request(headers, msg.subject, msg.reply, msg.data, now=datetime.now(UTC))
        if not enforce:
            return None
        if signer.public_key == self.node_key:
            return Asker(signer.agent_id, signer.public_key, msg.subject, None)
        enrolment = await self._enrolment(signer.agent_id, msg.subject)
        if enrolment is None or enrolment.public_key != signer.public_key:
            rule = "the signing key is not an enrolled agent's; an admin enrols it with `epibus agent add`"
            raise Forbidden(signer.agent_id, "ask", msg.subject, rule)
        if not enrolment.active:
            raise Forbidden(signer.agent_id, "ask", msg.subject, f"it was revoked at {enrolment.revoked_at}")
        return Asker(signer.agent_id, signer.public_key, msg.subject, enrolment)

    async def _enrolment(self, agent_id: str, subject: str) -> Enrolment | None:
        async def read() -> Enrolment | None:
            try:
                return await self.registry.get(agent_id)
            except Conflict as e:  # an unreadable record is quarantined, never trusted
                raise Forbidden(agent_id, "ask", subject, f"its enrolment record is unreadable ({e.detail})") from e

        return await self._recent.get(agent_id, read)


# The rules, one per decision. Admins hold the fleet-wide ones; the node's own key passes every rule.


def admin_rule(asker: Asker, request: BaseModel) -> None:
    """Enrolment, reindexing, erasing: admins only."""
    if not asker.has_role(Role.admin):
        raise asker.refuse("only an admin may (its roles: " + ", ".join(_roles(asker)) + ")")


def policy_rule(asker: Asker, request: PolicySetRequest) -> None:
    """A project's review policy: set by an admin who is a member of it."""
    admin_rule(asker, request)
    _member(asker, request.project)


def policy_show_rule(asker: Asker, request: PolicyShowRequest) -> None:
    """A project's review policy: read by its members."""
    _member(asker, request.project)


def enrolled_rule(asker: Asker, request: BaseModel) -> None:
    """Any enrolled, active agent (the guard has checked that): the journal lookup, the enrolment view (which
    shows each asker what its projects share)."""


def recall_rule(asker: Asker, request: RecallRequest) -> None:
    """Recall from a project's mirror: its members; the audit door (every state): reviewers and admins."""
    _member(asker, request.project)
    if request.audit and not asker.has_role(*AUDIT_ROLES):
        raise asker.refuse("audit: true (the audit door) is for reviewers and admins")


def verify_rule(asker: Asker, request: VerifyRequest) -> None:
    """Reconcile a project: its members; every project (project null) or a repair: admins."""
    if request.project is None and not asker.has_role(Role.admin):
        raise asker.refuse("project: null (every project) is for admins; name a project it is a member of")
    if request.project is not None:
        _member(asker, request.project)
    if request.repair and not asker.has_role(Role.admin):
        raise asker.refuse("repair: true is for admins")


def reindex_rule(asker: Asker, request: ReindexRequest) -> None:
    """Rebuild the mirrors: admins; progress goes to an inbox of the signer only (the node publishes with every
    permission, so it must not publish where the asker chooses)."""
    admin_rule(asker, request)
    if request.progress is not None and not request.progress.startswith(inbox_prefix(asker.public_key) + "."):
        raise asker.refuse("progress must be an inbox of the signing key (_INBOX_<its key>.…)")


def forget_proof_rule(asker: Asker, request: ForgetProofRequest) -> None:
    """Prove a forget: members of the project; scrubbing the node's files: admins."""
    _member(asker, request.project)
    if request.scrub and not asker.has_role(Role.admin):
        raise asker.refuse("scrub: true is for admins")


def erase_rule(asker: Asker, request: EraseRequest) -> None:
    """Erase a forgotten artifact's messages from the stream: admins."""
    admin_rule(asker, request)


def consumer_rule(asker: Asker, request: ConsumerOpenRequest) -> None:
    """Open a consumer: for the signing key only, filtered to one project the signer is a member of (or to the
    fleet's own records, which every enrolled agent reads); across projects only for an agent of every project."""
    if request.owner_key != asker.public_key:
        raise asker.refuse("owner_key must be the signing key: an agent opens consumers for itself only")
    if request.stream == WATCH_STREAM:
        own = notices_filter(asker.public_key)
        if request.filter_subject != own:
            raise asker.refuse(f"filter_subject must be {own}: an agent reads the notices pushed to it only")
        return
    try:
        project = readable_project(request.stream, request.filter_subject)
    except ConfigError as e:
        raise asker.refuse(str(e)) from e
    if project != POLICY_PROJECT:
        _member(asker, project)


def tombstone_check_rule(asker: Asker, request: TombstoneCheckRequest) -> None:
    """Check claims against a project's tombstones: its members, who may publish claims there."""
    _member(asker, request.project)


def journal_read_rule(asker: Asker, request: JournalReadRequest) -> None:
    """Read a node's journal: members of the project (every project, project null: agents of every project);
    the audit read (every state): reviewers and admins of it, as the audit door of recall. The projects read:
    any agent (it is answered with the projects it is a member of)."""
    if request.read == "projects":
        return
    if request.project is None:
        if not asker.member_of(ANY):
            raise asker.refuse("project: null (every project) is for agents of every project; name a project (-p)")
    else:
        _member(asker, request.project)
    if request.read == "audit" and not asker.has_role(*AUDIT_ROLES):
        raise asker.refuse("the audit read (every state, with the verification log) is for reviewers and admins")


def watch_register_rule(asker: Asker, request: WatchRegisterRequest) -> None:
    """Keep a standing question: a member of every project it names; an audit watch (claims in every state):
    reviewers and admins, as the audit door of recall."""
    for project in request.projects:
        _member(asker, project)
    if request.audit and not asker.has_role(*AUDIT_ROLES):
        raise asker.refuse("an audit watch (claims in every state) is for reviewers and admins")


def watch_own_rule(asker: Asker, request: BaseModel) -> None:
    """List or stop watches: any enrolled agent; the node answers with the signer's own watches only."""


def _member(asker: Asker, project: str) -> None:
    if not asker.member_of(project):
        raise asker.refuse(f"project {project}: only its members may (its projects: {', '.join(_projects(asker))})")


def _roles(asker: Asker) -> list[str]:
    return [str(role) for role in asker.enrolment.roles] if asker.enrolment else ["operator"]


def _projects(asker: Asker) -> list[str]:
    return list(asker.enrolment.projects) if asker.enrolment else ["*"]
