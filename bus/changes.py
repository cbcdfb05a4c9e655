"""State changes from the client: the project as the stream has it, transitions validated against
it and published with per-artifact compare-and-set, rollback planning and applying. A mixin of EpibusClient."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from nats.js import JetStreamContext

from bus.event import Envelope
from bus.kinds import Body
from bus.project_view import ProjectView, load_artifact, load_project
from bus.publish import Receipt
from bus.registry import AgentRegistry
from bus.rollback import RollbackPlan, plan_rollback
from bus.state import decide
from bus.subjects import cas_headers

log = logging.getLogger(__name__)


class ChangesCore(Protocol):
    """What the mixin needs of the client it is mixed into."""

    _registry: AgentRegistry | None

    @property
    def js(self) -> JetStreamContext: ...

    def event(
        self, kind: str, body: Body | dict[str, Any], *, project: str, artifact_id: str | None = None
    ) -> Envelope: ...

    async def publish_expecting(
        self, event: Envelope, *, expected_headers: dict[str, str], timeout_s: float | None = None
    ) -> Receipt: ...

    async def project_view(self, project: str) -> ProjectView: ...

    async def change_view(self, event: Envelope) -> ProjectView: ...

    async def transition(
        self,
        kind: str,
        body: Body | dict[str, Any],
        *,
        project: str,
        artifact_id: str,
        view: ProjectView | None = None,
        timeout_s: float | None = None,
    ) -> Receipt: ...


class StateChanges:
    _registry: AgentRegistry | None  # the client's agent-key registry, made on first use

    async def project_view(self: ChangesCore, project: str) -> ProjectView:
        """The project folded from the stream now (the client's view for validating state changes)."""
        self._registry = self._registry or AgentRegistry(self.js)
        return await load_project(self.js, project, self._registry)

    async def change_view(self: ChangesCore, event: Envelope) -> ProjectView:
        """What deciding `event` reads: the artifacts it names and those they link to, read from their own
        subjects (a cost that does not grow with the project), or the whole project when the decision reads
        what only its fold knows (`bus.project_view.load_artifact`)."""
        self._registry = self._registry or AgentRegistry(self.js)
        read = await load_artifact(self.js, event, self._registry)
        if read.view is not None:
            return read.view
        log.debug(
            "folding project %s to decide %s on %s: %s",
            event.project,
            event.kind,
            event.artifact_id,
            read.whole_project,
        )
        return await self.project_view(event.project)

    async def transition(
        self: ChangesCore,
        kind: str,
        body: Body | dict[str, Any],
        *,
        project: str,
        artifact_id: str,
        view: ProjectView | None = None,
        timeout_s: float | None = None,
    ) -> Receipt:
        """Validate a state change against the artifact's current state and the enrolments in force, then publish
        it so that JetStream refuses it if any other event landed on the artifact since (Conflict). Raises
        Forbidden naming the rule the agent breaks or IllegalTransition (nothing written), Conflict (re-read and
        retry deliberately) or Unavailable."""
        event = self.event(kind, body, project=project, artifact_id=artifact_id)
        view = view or await self.change_view(event)
        fold = view.fold
        change = decide(event, view.next_seq, fold.artifacts.get, fold.tombstones.__contains__, view.authority)
        expected = view.subject_seq.get(artifact_id, 0)
        receipt = await self.publish_expecting(
            event, expected_headers=cas_headers(project, artifact_id, expected), timeout_s=timeout_s
        )
        view.fold.absorb(change)
        if receipt.stream_seq is not None:
            view.subject_seq[artifact_id] = receipt.stream_seq
        return receipt

    async def plan_rollback(
        self: ChangesCore, project: str, artifact_id: str, *, cascade: bool = False
    ) -> RollbackPlan:
        """What a rollback of artifact_id would do; writes nothing. Raises IllegalTransition."""
        view = await self.project_view(project)
        return plan_rollback(view.fold.artifacts, artifact_id, cascade=cascade)

    async def rollback(
        self: ChangesCore, project: str, artifact_id: str, *, reason: str, cascade: bool = False
    ) -> tuple[RollbackPlan, list[Receipt]]:
        """Plan, then roll back every artifact in the plan, each with its own compare-and-set. Every one is
        checked first, so one this agent may not roll back (Forbidden) stops the run before anything is
        published. A Conflict stops the run; the receipts say what was rolled back before it."""
        view = await self.project_view(project)
        plan = plan_rollback(view.fold.artifacts, artifact_id, cascade=cascade)
        fold = view.fold
        for target in plan.to_roll_back:
            event = self.event("rolled_back", {"reason": reason}, project=project, artifact_id=target)
            decide(event, view.next_seq, fold.artifacts.get, fold.tombstones.__contains__, view.authority)
        receipts = []
        for target in plan.to_roll_back:
            receipts.append(
                await self.transition("rolled_back", {"reason": reason}, project=project, artifact_id=target, view=view)
            )
        return plan, receipts
