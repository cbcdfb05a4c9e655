"""A node's erase service, the stream half of `forget`: an admin's client publishes the artifact's `forgotten`
event, then asks one node (a queue group) to erase the artifact's earlier messages. The node finds them itself,
by reading the artifact's subjects, and never erases by sequence numbers an asker sends."""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext

from bus.broker.nats_errors import JS_TIMEOUT_S, NATS_OR_API_ERROR, message_gone
from bus.enrolment.registry import AgentRegistry
from bus.enrolment.service_rules import erase_rule
from bus.errors import NotFound, Unavailable
from bus.intake.admission import Admission, Rejected
from bus.intake.batch_context import EnrolmentLog
from bus.intake.stream_read import read_stream
from bus.model.erasure import erased_record
from bus.model.requests import ErasedMessage, EraseReply, EraseRequest
from bus.services.responder import Service
from bus.subjects import ADMIN_QUEUE, FORGET_ERASE, STREAM, artifact_filter


async def erase_forgotten(
    js: JetStreamContext, registry: AgentRegistry, request: EraseRequest, *, node: str
) -> EraseReply:
    """Erase every message on the artifact's subjects before its last admitted `forgotten` event (earlier
    forgets of the id included: the last one carries what they kept). `delete_msg` overwrites the bytes.
    Idempotent: what is gone is not read again. Raises NotFound when the stream holds no forget of the
    artifact (publish it first: the journals redact on it), Unavailable."""
    admission = Admission(registry)
    found: list[tuple[int, str | None]] = []
    # Read after the artifact's messages below would miss nothing earlier; read first, every record before the
    # forget is in it too (records are never erased). A forget its actor may not make erases nothing.
    authority = await EnrolmentLog(js, admission).read()
    forget_seq = 0
    async for batch in read_stream(js, STREAM, filter_subject=artifact_filter(request.project, request.artifact_id)):
        for msg in batch:
            seq = msg.metadata.sequence.stream
            try:
                delivery = await admission.admit_msg(msg)
            except Rejected:  # not an event any store holds: erased with the rest, nothing to name
                found.append((seq, None))
                continue
            if erased_record(delivery.event, seq, authority) is not None:
                forget_seq = seq
            found.append((seq, str(delivery.event.event_id)))
    if not forget_seq:
        raise NotFound(
            "forgotten event",
            f"{request.project}/{request.artifact_id}",
            "the stream holds no forget of this artifact; `epibus forget` publishes it before asking to erase",
        )
    erased: list[ErasedMessage] = []
    for seq, event_id in found:
        if seq >= forget_seq:
            break
        try:
            async with asyncio.timeout(JS_TIMEOUT_S):
                await js.delete_msg(STREAM, seq)  # erases: the server overwrites the bytes
        except NATS_OR_API_ERROR as e:
            if message_gone(e):
                continue  # erased meanwhile
            raise Unavailable("nats", f"erasing stream seq {seq}: {type(e).__name__} {e}") from e
        erased.append(ErasedMessage(seq=seq, event_id=event_id))
    return EraseReply(node=node, forget_seq=forget_seq, erased=erased)


def erase_service(js: JetStreamContext, registry: AgentRegistry, *, node: str) -> Service[EraseRequest]:
    """The FORGET_ERASE service, answered by one node of the admin queue group: an admin asked."""

    async def answer(request: EraseRequest) -> EraseReply:
        return await erase_forgotten(js, registry, request, node=node)

    return Service(FORGET_ERASE, EraseRequest, EraseReply, answer, erase_rule, queue=ADMIN_QUEUE)
