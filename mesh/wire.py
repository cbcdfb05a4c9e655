"""What an agent sends a node to change the mesh, and what the node answers. Every request carries the agent's
signature over exactly what it decided (a step's event, a roster change's event, its capabilities); the node
recomputes the record the request makes, checks that signature against it and writes. A refusal comes back
as the error the node raised (the same type and words an agent checking locally would have raised)."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal, NoReturn

from pydantic import AwareDatetime, Field, JsonValue

from bus.errors import (
    Conflict,
    EpibusError,
    Forbidden,
    IllegalTransition,
    InvalidEvent,
    MalformedRecord,
    NotFound,
)
from bus.model.fields import AgentId, ProjectSlug, PublicKey
from bus.model.kinds import Model
from bus.model.requests import NodeName
from mesh.events import with_signatures
from mesh.task import AgentCapabilities, Message, SessionId, Signature, TaskRecord
from mesh.trust import UntrustedRecord

Revision = Annotated[int, Field(ge=0, strict=True)]


class StepRequest(Model):
    """Apply one protocol message. The agent computed the step against the task at `revision` (0: the task
    does not exist yet) and the roster at `roster_version`, at time `at`, and signed the step's event."""

    message: Message
    revision: Revision
    roster_version: Revision
    at: AwareDatetime
    public_key: PublicKey
    session_id: SessionId
    signature: Signature
    counter_signature: Signature | None = None  # a change: the signed first step of its counter-proposal

    @property
    def actor(self) -> str:
        return self.message.sender

    @property
    def project(self) -> str | None:
        return self.message.project

    def signed(self, record: TaskRecord) -> TaskRecord:
        """The record the message makes, with this request's signatures on its newest step."""
        return with_signatures(
            record,
            public_key=self.public_key,
            session_id=self.session_id,
            signature=self.signature,
            counter_signature=self.counter_signature,
        )


class RosterRequest(Model):
    """Add or remove a coordinator of `project`, computed against the roster at `revision` (0: none yet)."""

    project: ProjectSlug
    change: Literal["add", "remove"]
    agent: AgentId
    message_id: uuid.UUID
    revision: Revision
    sender: AgentId
    at: AwareDatetime
    public_key: PublicKey
    session_id: SessionId
    signature: Signature

    @property
    def actor(self) -> str:
        return self.sender


class AdvertiseRequest(Model):
    """Record what an agent advertises (signed by it)."""

    advertised: AgentCapabilities

    @property
    def actor(self) -> str:
        return self.advertised.agent

    @property
    def public_key(self) -> str:
        return self.advertised.public_key

    @property
    def project(self) -> str | None:
        return None


MeshRequest = type[StepRequest] | type[RosterRequest] | type[AdvertiseRequest]
ERRORS: dict[str, type[EpibusError]] = {
    cls.__name__: cls
    for cls in (IllegalTransition, Forbidden, InvalidEvent, NotFound, Conflict, MalformedRecord, UntrustedRecord)
}


class Refusal(Model):
    """An error the node raised, with what it says and the fields it carries."""

    error: Literal[
        "IllegalTransition", "Forbidden", "InvalidEvent", "NotFound", "Conflict", "MalformedRecord", "UntrustedRecord"
    ]
    message: Annotated[str, Field(max_length=4000)]
    fields: dict[str, JsonValue] = {}


class MeshReply(Model):
    node: NodeName
    revision: Revision | None = None  # of what the node wrote
    refused: Refusal | None = None


REFUSABLE: tuple[type[EpibusError], ...] = tuple(ERRORS.values())


def refusal_of(error: EpibusError) -> Refusal:
    """An error the node refuses with, as it goes on the wire: its type, its words and its fields (JSON)."""
    fields = json.loads(json.dumps(vars(error), default=str))
    return Refusal.model_validate({"error": type(error).__name__, "message": str(error)[:4000], "fields": fields})


def raise_refusal(refusal: Refusal) -> NoReturn:
    """Raise the error a node refused with, as the same type with the same words and fields."""
    error = ERRORS[refusal.error].__new__(ERRORS[refusal.error])
    error.args = (refusal.message,)
    fields: dict[str, Any] = dict(refusal.fields)
    if isinstance(allowed := fields.get("allowed"), list):
        fields["allowed"] = tuple(allowed)
    vars(error).update(fields)
    raise error


def require_fresh(at: datetime, now: datetime, max_skew_s: float, *, field: str) -> None:
    """A signed time must be near the node's clock: the node judges deadlines by it."""
    if abs((now - at).total_seconds()) > max_skew_s:
        raise InvalidEvent(
            f"{field}={at.isoformat()}",
            f"is more than {max_skew_s:.0f}s from the node's clock ({now.isoformat()}); check the agent's clock",
        )
