"""What a client checks before it publishes: the agent is a member of the event's project, nothing is sent to
the nodes' reserved project, no id twice in one call, linked claims are legal against the project as the stream
has it (a superseding claim gets compare-and-set headers), and the flags known before publishing."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from bus.client.connection import Connection
from bus.client.project_view import ProjectViews
from bus.errors import Forbidden, InvalidEvent, Unavailable
from bus.model.authority import NO_RECORDS, authorize
from bus.model.event import Envelope
from bus.model.state import claim_flags, decide
from bus.model.tombstones import FLAG_PREVIOUSLY_RETRACTED, content_hash
from bus.services.tombstone_registry import TombstoneRegistry
from bus.subjects import POLICY_PROJECT, cas_headers

log = logging.getLogger(__name__)
TOMBSTONE_CHECK_TIMEOUT_S = 2.0


class PublishChecks:
    """The checks of one client, with what it could not check counted (and logged)."""

    def __init__(self, connection: Connection, views: ProjectViews) -> None:
        self.connection = connection
        self.views = views
        self.unchecked_tombstones = 0  # publishes whose tombstone pre-check could not run (counted, logged)
        self.unchecked_links = 0  # linked claims published while offline, unchecked (counted, logged)

    def require_member(self, project: str, action: str) -> None:
        """Raise Forbidden unless this agent's enrolment (known once connected) covers `project`: the broker
        confines an agent to its projects, and reads that do not pass the broker (a local journal) apply the same
        rule here. Before the first connect nothing is known, and nothing is refused."""
        enrolment, key = self.connection.enrolment, self.connection.key
        if enrolment is not None and not enrolment.member_of(project):
            raise Forbidden(
                key.agent_id,
                action,
                f"project {project}",
                f"it is enrolled in {', '.join(enrolment.projects)}; an admin adds the project with "
                f"`epibus agent add {key.agent_id} --key {key.public_key} --project {project}`",
            )

    def admit(self, event: Envelope) -> None:
        """The membership rule for one event. The reserved project is refused by the authority rule that names
        it, not here; elsewhere the broker would refuse it (a timeout to nats-py) and an outbox would retry it
        for ever."""
        if event.project != POLICY_PROJECT:
            self.require_member(event.project, "publish in")

    def refuse_batch(self, events: Sequence[Envelope]) -> None:
        """Raise Forbidden for an event in the reserved project (every store would reject it: only nodes write
        there), InvalidEvent for an id given twice."""
        for event in events:
            if event.project == POLICY_PROJECT:
                authorize(event, 0, lambda _artifact_id: None, NO_RECORDS)
        if len(events) > 1 and len({event.event_id for event in events}) != len(events):
            raise InvalidEvent("event_id", "appears twice in one publish_many call")

    async def links(self, events: Sequence[Envelope]) -> dict[str, str] | None:
        """Claims that revise or supersede another artifact are checked against the project as the stream has
        it (IllegalTransition, nothing written). A superseding claim changes the superseded artifact, so it is
        published alone with compare-and-set on that artifact's subjects: a verify, rollback or resolution of
        it landing meanwhile makes JetStream refuse the claim (Conflict). Two new claims superseding one
        artifact at once land on their own subjects; the projection applies the first and rejects the second
        with the reason (a `journaled` receipt says so). Returns the headers to use, else None."""
        linked = [e for e in events if not e.body.transition and (_link(e, "revises") or _link(e, "supersedes"))]
        if not linked:
            return None
        superseding = [e for e in linked if _link(e, "supersedes")]
        if superseding and len(events) > 1:
            raise InvalidEvent(
                "body.supersedes", "a superseding claim must be published on its own (publish), not in a batch"
            )
        if not self.connection.connected:
            self.unchecked_links += len(linked)  # the journal's projection rejects what is illegal, with the reason
            log.warning("%d linked claim(s) published unchecked: NATS is not connected", len(linked))
            return None
        views = {project: await self.views.project(project) for project in {e.project for e in linked}}
        for event in events:
            view = views.get(event.project)
            if view is not None:
                fold = view.fold
                fold.absorb(decide(event, view.next_seq, fold.artifacts.get, lambda _h: False, view.authority))
        if not superseding:
            return None
        target = _link(superseding[0], "supersedes")
        assert target is not None
        view = views[superseding[0].project]
        return cas_headers(superseding[0].project, target, view.subject_seq.get(target, 0))

    async def flags(self, events: Sequence[Envelope], *, strict: bool) -> dict[str, tuple[str, ...]]:
        """Flags known before publishing; tombstones need NATS (checked within 2 s, else counted and left
        to the journal's projection, unless strict)."""
        registry = self.views.tombstones if self.connection.connected else None
        flags, unchecked = await prepublish_flags(registry, events, strict=strict, timeout_s=TOMBSTONE_CHECK_TIMEOUT_S)
        self.unchecked_tombstones += len(unchecked)
        return flags


def _link(event: Envelope, name: str) -> str | None:
    value = getattr(event.body, name, None)
    return value if isinstance(value, str) else None


async def prepublish_flags(
    registry: TombstoneRegistry | None, events: Sequence[Envelope], *, strict: bool, timeout_s: float
) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """Flags of the claims among `events` before they are published, and the projects whose tombstones
    could not be checked (registry None: not connected). Strict refuses a repeat of a retracted claim
    (InvalidEvent) and an unchecked project (Unavailable)."""
    claims = [e for e in events if not e.body.transition and not e.body.system_record]
    tombstoned: dict[str, set[str]] = {}
    unchecked: list[str] = []
    for project in sorted({e.project for e in claims}):
        try:
            if registry is None:
                raise Unavailable("nats", "not connected")
            digests = {content_hash(e.body.content_text()) for e in claims if e.project == project}
            tombstoned[project] = await registry.tombstoned(project, digests, timeout_s=timeout_s)
        except Unavailable as e:
            if strict:
                raise Unavailable("nats", f"tombstones cannot be checked ({e.cause}); retry, or drop strict") from e
            # Publishing must not wait on the check: the journal's projection flags the claim anyway.
            unchecked.append(project)
            log.warning("tombstones of %s not checked before publishing: %s", project, e)
    flags: dict[str, tuple[str, ...]] = {}
    for event in claims:
        found = claim_flags(event, tombstoned.get(event.project, set()).__contains__)
        if strict and FLAG_PREVIOUSLY_RETRACTED in found:
            raise InvalidEvent(
                f"event {event.event_id}",
                "repeats a claim that was retracted or rolled back in this project; "
                "publish without strict to record it anyway (flagged previously_retracted)",
            )
        if found:
            flags[str(event.event_id)] = tuple(sorted(found))
    return flags, unchecked
