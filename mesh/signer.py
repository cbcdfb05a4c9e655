"""What an agent signs for the mesh: a step's event (and a change's counter-proposal's first step) into the
request a node checks and writes, a roster change's event, and its advertised capabilities."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from pydantic import ValidationError

from bus.identity.signing import AgentKey
from bus.model.event import invalid_event_of
from mesh.events import opening_record, unsigned_roster_event, unsigned_step_event
from mesh.task import (
    CAPABILITIES_PURPOSE,
    AgentCapabilities,
    Message,
    RosterChange,
    RosterDraft,
    TaskRecord,
    capabilities_document,
)
from mesh.vocab import TaskAction
from mesh.wire import RosterRequest, StepRequest


class MeshSigner:
    """Signs with `key` in session `session_id`."""

    def __init__(self, key: AgentKey, session_id: str) -> None:
        self.key = key
        self.session_id = session_id

    def step_request(
        self, record: TaskRecord, message: Message, revision: int, roster_version: int, at: datetime
    ) -> StepRequest:
        """The request for the node: `record` (what `message` makes, by `advance`) with its newest step signed by
        this agent (and, for a change, the counter-proposal's first step)."""
        key, session = self.key, self.session_id
        counter = None
        if record.last_step.action is TaskAction.change:
            counter = key.sign_v1(unsigned_step_event(opening_record(record), 0, key.actor, session)).signature
        signed = key.sign_v1(unsigned_step_event(record, len(record.steps) - 1, key.actor, session))
        assert signed.signature is not None
        return StepRequest(
            message=message,
            revision=revision,
            roster_version=roster_version,
            at=at,
            public_key=key.public_key,
            session_id=session,
            signature=signed.signature,
            counter_signature=counter,
        )

    def roster_change(
        self, project: str, draft: RosterDraft, *, revision: int, roster_version: int
    ) -> tuple[RosterRequest, RosterChange]:
        """The request for the node to make `draft` (against the roster at `revision`, version
        `roster_version`), and the change as the node will write it."""
        key, session = self.key, self.session_id
        event = key.sign_v1(
            unsigned_roster_event(project, draft, seq=roster_version + 1, actor=key.actor, session_id=session)
        )
        assert event.signature is not None
        request = RosterRequest(
            project=project,
            change=draft.change,
            agent=draft.agent,
            message_id=draft.message_id,
            revision=revision,
            sender=draft.actor,
            at=draft.at,
            public_key=key.public_key,
            session_id=session,
            signature=event.signature,
        )
        made = RosterChange(
            **draft.model_dump(), public_key=key.public_key, session_id=session, signature=event.signature
        )
        return request, made

    def capabilities(self, capabilities: Sequence[str], at: datetime) -> AgentCapabilities:
        """This agent's capabilities, signed. Raises InvalidEvent."""
        agent, chosen = self.key.agent_id, tuple(sorted(set(capabilities)))
        try:
            document = capabilities_document(agent, chosen, at)
            return AgentCapabilities.model_validate(
                {
                    "agent": agent,
                    "capabilities": chosen,
                    "updated_at": at,
                    "public_key": self.key.public_key,
                    "signature": self.key.sign_document(CAPABILITIES_PURPOSE, document),
                }
            )
        except ValidationError as e:
            raise invalid_event_of(e) from e
