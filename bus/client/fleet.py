"""What a client asks of the nodes over core NATS request subjects, every request signed: recall by meaning,
forget (an admin's erase) with proof, reconciliation and reindexing. The `ask_*` functions take the connection
and the key that signs; FleetRequests asks them with the client's own (EpibusClient delegates its request
verbs to it)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from pydantic import ValidationError

from bus.broker.ask import Replies, ask_one, fan_out, refusal, refused_by_all
from bus.client.changes import StateChanges
from bus.client.connection import Connection
from bus.client.project_view import ProjectViews
from bus.client.recall import RecallAnswer, ask_all, recall_request
from bus.errors import AmbiguousId, InvalidEvent, NotFound, Unavailable
from bus.identity.signing import AgentKey
from bus.intake.stream_read import read_stream
from bus.model.erasure import erased_events, erased_history
from bus.model.event import validate_event
from bus.model.forget import ForgetProof, ForgetReport, content_fingerprints, free_texts
from bus.model.requests import (
    EraseReply,
    EraseRequest,
    ErrorReply,
    ForgetProofReply,
    ForgetProofRequest,
    JournalReadReply,
    JournalReadRequest,
    JournalRebuildReply,
    JournalRebuildRequest,
    ReindexProgress,
    ReindexReply,
    ReindexRequest,
    VerifyReply,
    VerifyRequest,
    build_request,
    describe_invalid,
)
from bus.outbox.outbox import Outbox
from bus.subjects import (
    FORGET_ERASE,
    JOURNAL_READ,
    JOURNAL_REBUILD,
    PROVE_FORGOTTEN,
    REINDEX,
    STREAM,
    VERIFY,
    artifact_filter,
)

log = logging.getLogger(__name__)


# A connection and the key that signs requests on it (the connection receives on that key's inboxes).
Asking = tuple[NatsClient, AgentKey]


class FleetRequests:
    """Requests signed by this client's key on its own connection. Another signer (an admin's, the node
    operator's) asks through the `ask_*` functions below with its own connection."""

    def __init__(
        self, connection: Connection, views: ProjectViews, changes: StateChanges, outbox: Callable[[], Outbox | None]
    ) -> None:
        self.connection = connection
        self.key = connection.key
        self.views = views
        self.changes = changes
        self.outbox = outbox  # the client's, once it is open

    async def forget(
        self, project: str, artifact_id: str, *, reason: str, eraser: Asking | None = None
    ) -> ForgetReport:
        """The privacy delete: publish `forgotten` (every node's journal redacts the artifact's events and its
        mirror deletes the points), ask a node to erase every earlier message on the artifact's subjects from
        the stream (`eraser` signs it, this client by default: an admin's request), and drop them from this
        client's outbox. An artifact already forgotten whose messages are still in the stream (the erase was
        refused, or no node answered) is only erased. Raises NotFound for an unknown artifact, Forbidden when the
        eraser is no admin, Unavailable. Follow it with `prove_forgotten`: each node then erases what is left in
        its files and scans them."""
        view = await self.views.project(project)
        messages = list(view.messages.get(artifact_id, []))
        earlier = view.erased.get((project, artifact_id), ())  # forgets of the artifact (or of one before it)
        if artifact_id in view.fold.artifacts:
            embedded = [view.fold.artifacts[artifact_id].content]
        else:  # forgotten already: only what is left before its last forget is to erase
            last = earlier[-1].forget_seq if earlier else 0
            forgotten_id = next((e for seq, e in messages if seq == last and e), "")
            messages = [(seq, e) for seq, e in messages if seq < last]
            if not messages:
                raise NotFound("artifact", artifact_id, f"nothing to forget in project {project}")
            embedded = []
        stored = await _artifact_messages(self.connection.js, project, artifact_id)
        texts = embedded + _message_texts([stored[seq] for seq, _ in messages if seq in stored])
        if embedded:
            # The artifact's states without its content: paths that read the stream after the erase below
            # decide what other events did with it (contradicted by it, superseding it) as the live nodes did.
            history = erased_history(view.fold.history.get(artifact_id, []), earlier)
            body = {
                "reason": reason,
                "history": [h.model_dump(mode="json") for h in history],
                "events": [e.model_dump(mode="json") for e in erased_events(view.fold.digests, messages, earlier)],
            }
            receipt = await self.changes.transition(
                "forgotten", body, project=project, artifact_id=artifact_id, view=view
            )
            forgotten_id = str(receipt.event_id)
        nc, signer = eraser if eraser is not None else (self.connection.require_nc(), self.key)
        erased = await ask_erase(nc, signer, project, artifact_id, timeout_s=self.connection.publish_timeout_s)
        outbox = self.outbox()
        if outbox is not None:
            await outbox.forget(project, artifact_id)
        seen = dict(messages)  # what this client saw, and what the node erased (it may have seen more)
        for seq, event_id in erased:
            seen[seq] = seen.get(seq) or event_id
        fingerprints = content_fingerprints(texts)
        return ForgetReport(project, artifact_id, forgotten_id, sorted(seen.items()), fingerprints, embedded or texts)

    async def prove_forgotten(
        self, report: ForgetReport, *, scrub: bool = True, timeout_s: float = 10.0
    ) -> ForgetProof:
        """See ask_forget_proof; signed by this client's key (`scrub` is for admins)."""
        return await ask_forget_proof(self.connection.require_nc(), self.key, report, scrub=scrub, timeout_s=timeout_s)

    async def verify_nodes(
        self, project: str | None = None, *, repair: bool = False, timeout_s: float = 60.0
    ) -> list[dict[str, Any]]:
        """See ask_verify; signed by this client's key."""
        return await ask_verify(self.connection.require_nc(), self.key, project, repair=repair, timeout_s=timeout_s)

    async def reindex_nodes(
        self, progress: Callable[[str, int, int], None] | None = None, *, timeout_s: float = 1800.0
    ) -> list[dict[str, Any]]:
        """See ask_reindex; signed by this client's key (an admin's)."""
        return await ask_reindex(self.connection.require_nc(), self.key, progress, timeout_s=timeout_s)

    async def recall(
        self,
        query: str,
        project: str,
        *,
        k: int = 10,
        kinds: list[str] | None = None,
        include_resolved: bool = False,
        as_of: datetime | None = None,
        timeout_s: float = 3.0,
    ) -> RecallAnswer:
        """The safe door across every node's mirror: never contradicted, rolled back, retracted or mistyped
        items. Raises Unavailable when no mirror answered (never an empty list that means "broken")."""
        request = recall_request(
            query, project, k=k, kinds=kinds, include_resolved=include_resolved, as_of=as_of, audit=False
        )
        return await ask_all(self.connection.require_nc(), request, signer=self.key, timeout_s=timeout_s)

    async def audit_recall(
        self,
        query: str,
        project: str,
        *,
        k: int = 10,
        kinds: list[str] | None = None,
        timeout_s: float = 3.0,
    ) -> RecallAnswer:
        """The audit door: every mirrored item whatever its state, with that state (reviewers and admins)."""
        request = recall_request(query, project, k=k, kinds=kinds, include_resolved=True, as_of=None, audit=True)
        return await ask_all(self.connection.require_nc(), request, signer=self.key, timeout_s=timeout_s)


async def ask_erase(
    nc: NatsClient, signer: AgentKey, project: str, artifact_id: str, *, timeout_s: float
) -> list[tuple[int, str | None]]:
    """Ask a node (an admin's request) to erase from the stream every message on the artifact's subjects before
    its last `forgotten` event; the node finds them itself. Returns what it erased: (stream seq, event id).
    Raises Forbidden, Refused (no `forgotten` event yet, ...), Unavailable."""
    request = build_request(EraseRequest, project=project, artifact_id=artifact_id)
    reply = await ask_one(nc, FORGET_ERASE, request, EraseReply, signer=signer, timeout_s=timeout_s)
    return [(m.seq, m.event_id) for m in reply.erased]


async def ask_rebuild_journal(
    nc: NatsClient, signer: AgentKey, node: str, *, timeout_s: float = 3600.0
) -> JournalRebuildReply:
    """Ask node `node` (an admin's request) to rebuild its SQLite journal from the stream and swap it in, the
    damaged file kept aside. Raises Forbidden, Refused (e.g. not a SQLite journal), Unavailable (it did not
    answer in time)."""
    request = build_request(JournalRebuildRequest, node=node)
    replies = await fan_out(
        nc, JOURNAL_REBUILD, request, JournalRebuildReply, signer=signer, timeout_s=timeout_s, expect=[node]
    )
    for answer in replies.answers:
        if answer.node != node:
            continue
        if isinstance(answer, ErrorReply):
            raise refusal(answer, signer, JOURNAL_REBUILD)
        return answer
    raise Unavailable("epibus node", f"node {node} did not answer the rebuild within {timeout_s:g}s; is it running?")


async def ask_forget_proof(
    nc: NatsClient, signer: AgentKey, report: ForgetReport, *, scrub: bool = True, timeout_s: float = 10.0
) -> ForgetProof:
    """Read every store back: the stream by sequence, and each node's journal and mirror by event id. With
    `scrub` (admins), a node that has applied the forget first erases what is left of the content in its files
    (outbox rows, cached vectors, SQLite WALs, the mirror's WAL and pages; idempotent); then every node scans
    every file it owns for the report's fingerprints and names the files that hold one. Raises Forbidden when
    every node that answered refused the signer."""
    stored = await _artifact_messages(nc.jetstream(), report.project, report.artifact_id)
    erased = [seq for seq, _ in report.messages if seq not in stored]
    request = build_request(
        ForgetProofRequest,
        project=report.project,
        artifact_id=report.artifact_id,
        event_ids=[e for _, e in report.messages if e],
        fingerprints=report.fingerprints,
        embedded_texts=report.embedded_texts,
        scrub=scrub,
    )
    replies = await fan_out(nc, PROVE_FORGOTTEN, request, ForgetProofReply, signer=signer, timeout_s=timeout_s)
    refused = refused_by_all(replies, signer, PROVE_FORGOTTEN)
    if refused is not None:
        raise refused
    nodes = {a.node: a.model_dump(mode="json") for a in replies.answers}
    nodes |= {n: {"node": n, "error": _no_answer(timeout_s)} for n in replies.missing}  # a live node proves nothing
    return ForgetProof(report, erased, nodes, replies.malformed)


async def ask_journal(nc: NatsClient, signer: AgentKey, request: JournalReadRequest, *, timeout_s: float = 30.0) -> Any:
    """One node's answer to a journal read (plain JSON values), signed by `signer`. Raises Forbidden naming the
    rule that refused the signer, Refused (the node failed: an unknown artifact prefix, a journal outage),
    Unavailable (no node answered)."""
    reply = await ask_one(nc, JOURNAL_READ, request, JournalReadReply, signer=signer, timeout_s=timeout_s)
    if reply.lookup is not None:  # the same error the node's read raised, as a direct read raises it
        raise (NotFound if reply.lookup.error == "NotFound" else AmbiguousId)(**reply.lookup.fields)  # type: ignore[arg-type]
    return reply.result


async def ask_verify(
    nc: NatsClient, signer: AgentKey, project: str | None = None, *, repair: bool = False, timeout_s: float = 60.0
) -> list[dict[str, Any]]:
    """Every node's reconciliation of the stream, its journal and its mirror (repaired when asked: admins; every
    project, project None: admins). A reply that is no node's answer, and a live node that did not answer, are
    listed as failed answers (`error`: malformed reply and why, or no answer). Raises Unavailable when no node
    answered."""
    request = build_request(VerifyRequest, project=project, repair=repair)
    replies = await fan_out(nc, VERIFY, request, VerifyReply, signer=signer, timeout_s=timeout_s)
    return _answers_of("verify", replies, timeout_s, signer, VERIFY)


async def ask_reindex(
    nc: NatsClient,
    signer: AgentKey,
    progress: Callable[[str, int, int], None] | None = None,
    *,
    timeout_s: float = 1800.0,
) -> list[dict[str, Any]]:
    """Ask every node (an admin's request) to rebuild its mirror from the stream into a new collection and swap
    it in. `progress(node, done_seq, last_seq)` is called as they go: the nodes publish it on an inbox of the
    signer. A reply that is no node's answer is listed as a failed answer. Raises Unavailable if no node
    answered."""
    inbox = nc.new_inbox()

    async def on_progress(msg: Msg) -> None:
        try:
            update = ReindexProgress.model_validate_json(msg.data)
        except ValidationError as e:  # not a node's progress: the answer itself still tells
            log.warning("progress update on %s ignored: %s", inbox, describe_invalid(ReindexProgress, e))
            return
        if progress is not None:
            progress(update.node, update.done, update.total)

    subscription = await nc.subscribe(inbox, cb=on_progress)
    try:
        request = build_request(ReindexRequest, progress=inbox)
        replies = await fan_out(nc, REINDEX, request, ReindexReply, signer=signer, timeout_s=timeout_s)
    finally:
        await subscription.unsubscribe()
    return _answers_of("reindex", replies, timeout_s, signer, REINDEX)


def _answers_of(
    service: str, replies: Replies[Any], timeout_s: float, signer: AgentKey, subject: str
) -> list[dict[str, Any]]:
    """Each node's answer as a dict, then each malformed reply as a failed one. Raises Unavailable when no node
    answered (malformed replies are no node's answer), Forbidden when every node that answered refused."""
    refused = refused_by_all(replies, signer, subject)
    if refused is not None:
        raise refused
    if not replies.answers:
        bad = "; ".join(f"{origin}: {why}" for origin, why in replies.malformed.items())
        raise Unavailable(
            service, f"no node answered within {timeout_s}s; is `epibus up` running?" + (f" ({bad})" if bad else "")
        )
    answers = [a.model_dump(mode="json") for a in replies.answers]
    missing = [{"node": node, "error": _no_answer(timeout_s)} for node in replies.missing]
    return answers + missing + [{"node": origin, "error": why} for origin, why in replies.malformed.items()]


def _no_answer(timeout_s: float) -> str:
    return f"live node did not answer within {timeout_s}s"


async def _artifact_messages(js: JetStreamContext, project: str, artifact_id: str) -> dict[int, Msg]:
    """The messages on one artifact's subjects now in the stream, by sequence: a read filtered to the artifact
    (the broker lets an agent read its own projects only, never a message by sequence). Raises Unavailable."""
    found: dict[int, Msg] = {}
    async for batch in read_stream(js, STREAM, filter_subject=artifact_filter(project, artifact_id)):
        found |= {msg.metadata.sequence.stream: msg for msg in batch}
    return found


def _message_texts(messages: list[Msg]) -> list[str]:
    """The free texts of these events (what a file holding a copy would hold). A message that is not a valid
    event gives none."""
    texts: list[str] = []
    for msg in messages:
        try:
            event = validate_event(json.loads(msg.data or b""))
        except (InvalidEvent, ValueError):  # not an event: the stream erase covers it, no text to look for
            continue
        texts += free_texts(event.body)
    return texts
