"""State changes from the client: transitions validated against the project as the stream has it
(`bus.client.project_view`) and published with per-artifact compare-and-set, rollback planning and applying.
EpibusClient delegates its state-change verbs here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from bus.client.project_view import ProjectView, ProjectViews
from bus.errors import NotFound
from bus.model.event import Envelope
from bus.model.kinds import Body
from bus.model.rollback import RollbackPlan, plan_rollback
from bus.model.state import decide
from bus.outbox.publish import Receipt
from bus.subjects import cas_headers


class Publishing(Protocol):
    """What state changes need of the client: its events, and its compare-and-set publish."""

    def event(
        self, kind: str, body: Body | dict[str, Any], *, project: str, artifact_id: str | None = None
    ) -> Envelope: ...

    async def publish_expecting(
        self, event: Envelope, *, expected_headers: dict[str, str], timeout_s: float | None = None
    ) -> Receipt: ...


def require_artifact(artifacts: Mapping[str, object], project: str, artifact_id: str) -> None:
    """A change names an artifact that exists: NotFound otherwise, as an unknown prefix is (one error for one
    situation; the state rules would call it an illegal transition from `absent`)."""
    if artifact_id not in artifacts:
        hint = f"no artifact with this id in project {project!r}; list them with `epibus audit -p {project}`"
        raise NotFound("artifact", artifact_id, hint)


class StateChanges:
    """The state changes of the client `publishing`, decided on `views`."""

    def __init__(self, views: ProjectViews, publishing: Publishing) -> None:
        self.views = views
        self.publishing = publishing

    async def transition(
        self,
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
        event = self.publishing.event(kind, body, project=project, artifact_id=artifact_id)
        view = view or await self.views.for_change(event)
        fold = view.fold
        require_artifact(fold.artifacts, project, artifact_id)
        change = decide(event, view.next_seq, fold.artifacts.get, fold.tombstones.__contains__, view.authority)
        expected = view.subject_seq.get(artifact_id, 0)
        receipt = await self.publishing.publish_expecting(
            event, expected_headers=cas_headers(project, artifact_id, expected), timeout_s=timeout_s
        )
        view.fold.absorb(change)
        if receipt.stream_seq is not None:
            view.subject_seq[artifact_id] = receipt.stream_seq
        return receipt

    async def plan_rollback(self, project: str, artifact_id: str, *, cascade: bool = False) -> RollbackPlan:
        """What a rollback of artifact_id would do; writes nothing. Raises IllegalTransition."""
        view = await self.views.project(project)
        require_artifact(view.fold.artifacts, project, artifact_id)
        return plan_rollback(view.fold.artifacts, artifact_id, cascade=cascade)

    async def rollback(
        self, project: str, artifact_id: str, *, reason: str, cascade: bool = False
    ) -> tuple[RollbackPlan, list[Receipt]]:
        """Plan, then roll back every artifact in the plan, each with its own compare-and-set. Every one is
        checked first, so one this agent may not roll back (Forbidden) stops the run before anything is
        published. A Conflict stops the run; the receipts say what was rolled back before it."""
        view = await self.views.project(project)
        require_artifact(view.fold.artifacts, project, artifact_id)
        plan = plan_rollback(view.fold.artifacts, artifact_id, cascade=cascade)
        fold = view.fold
        for target in plan.to_roll_back:
            event = self.publishing.event("rolled_back", {"reason": reason}, project=project, artifact_id=target)
            decide(event, view.next_seq, fold.artifacts.get, fold.tombstones.__contains__, view.authority)
        receipts = []
        for target in plan.to_roll_back:
            receipts.append(
                await self.transition("rolled_back", {"reason": reason}, project=project, artifact_id=target, view=view)
            )
        return plan, receipts
