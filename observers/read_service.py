"""Reads of a journal as one request: `read_journal` answers a JournalReadRequest with what the CLI's `--json`
shows, whether a node answers it for a signed agent (`epibus.journal.read`, the membership rules of recall) or
the node's operator reads the file directly (`--journal`). One function for both, so they cannot differ."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import JsonValue
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from bus.enrolment.service_rules import current_asker, journal_read_rule
from bus.errors import AmbiguousId, ConfigError, NotFound, StoreDamaged, Unavailable
from bus.model.ids import id_prefix, only_match
from bus.model.requests import JournalReadReply, JournalReadRequest, LookupFailure
from bus.services.responder import Service
from bus.subjects import JOURNAL_QUEUE, JOURNAL_READ
from observers.journal import EventQuery, Journal
from observers.reads import (
    artifact_ids_like,
    artifact_lineage,
    artifacts,
    audit_artifacts,
    briefing,
    vocab_report,
)


def read_journal(journal: Journal, request: JournalReadRequest) -> Any:
    """The answer as plain JSON values. Raises NotFound or AmbiguousId for an artifact prefix, ConfigError
    for a read that needs a project, Unavailable or ComponentFailed (the journal)."""
    project = request.project
    artifact = _artifact(journal, project, request.artifact_id)
    kinds = set(request.kinds) if request.kinds else None
    if request.read == "events":
        query = EventQuery(
            project=project,
            kind=request.kinds[0] if request.kinds else None,
            actor=request.actor,
            artifact_id=artifact,
            since=request.since,
            until=request.until,
            limit=request.limit,
            newest_first=not request.oldest_first,
        )
        return [_event(row) for row in journal.query(query)]
    if request.read == "projects":
        return journal.projects()
    if project is None:
        raise ConfigError("project", f"the {request.read} read is of one project; name it (-p)")
    if request.read == "artifacts":
        views = artifacts(
            journal, project, kinds=kinds, include_resolved=request.include_resolved, as_of=request.as_of,
            limit=request.limit,
        )  # fmt: skip
        return [v.as_dict() for v in views]
    if request.read == "audit":
        views = audit_artifacts(journal, project, kinds=kinds, as_of=request.as_of, limit=request.limit)
        return [v.as_dict() for v in views]
    if request.read == "briefing":
        return briefing(journal, project, request.goal, as_of=request.as_of, limit=request.limit).as_dict()
    if request.read == "lineage":
        if artifact is None:
            raise ConfigError("artifact_id", "the lineage read names an artifact")
        return artifact_lineage(journal, project, artifact, as_of=request.as_of).as_dict()
    return vocab_report(journal, project, as_of=request.as_of).as_dict()


def _event(row: Any) -> dict[str, Any]:
    text = None if row.status == "forgotten" else row.event().body.content_text()
    return dict(row.as_dict()) | {"text": text}


def _artifact(journal: Journal, project: str | None, value: str | None) -> str | None:
    """The artifact id `value` names: itself, or the one id it is a unique prefix of in the project."""
    if value is None or (digits := id_prefix(value)) is None:
        return value
    found = artifact_ids_like(journal, project, value, digits)
    where = f"in project {project!r}" if project else "in any project"
    hint = f"list them with `epibus audit -p {project}`" if project else "list them with `epibus events`"
    return only_match(value, "artifact_id", found, what="artifact", where=where, hint=hint)


READ_ATTEMPTS = 3  # a journal that did not answer (locked, an I/O error, a dropped connection) is asked again


def _passing(error: BaseException) -> bool:
    """An outage that may pass; damage does not (it is named with its repair at once)."""
    return isinstance(error, Unavailable) and not isinstance(error, StoreDamaged)


async def read_answering(journal: Journal, request: JournalReadRequest) -> Any:
    """`read_journal` on a thread, asked again (bounded, backing off to 0.4 s) while the journal has an outage
    that may pass; the last Unavailable is raised."""
    async for attempt in AsyncRetrying(
        stop=stop_after_attempt(READ_ATTEMPTS),
        wait=wait_exponential(multiplier=0.1, max=0.4),
        retry=retry_if_exception(_passing),
        reraise=True,
    ):
        with attempt:
            return await asyncio.to_thread(read_journal, journal, request)
    raise AssertionError("unreachable: tenacity returns or re-raises")


def journal_read_service(journal: Journal, *, node: str) -> Service[JournalReadRequest]:
    """`epibus.journal.read`: one node of the queue group answers from its journal."""

    async def answer(request: JournalReadRequest) -> JournalReadReply:
        try:
            result = await read_answering(journal, request)
            asker = current_asker()
            if request.read == "projects" and asker is not None and asker.enrolment is not None:
                result = [p for p in result if asker.member_of(p)]  # an agent learns only of its own projects
            return JournalReadReply(node=node, result=result)
        except NotFound as e:
            fields: dict[str, JsonValue] = {"what": e.what, "key": e.key, "hint": e.hint}
            return JournalReadReply(node=node, lookup=LookupFailure(error="NotFound", fields=fields))
        except AmbiguousId as e:
            fields = {"field": e.field, "prefix": e.prefix, "what": e.what, "where": e.where, "more": e.more}
            fields["matches"] = list(e.matches)
            failure = LookupFailure(error="AmbiguousId", fields=fields)
            return JournalReadReply(node=node, lookup=failure)

    return Service(JOURNAL_READ, JournalReadRequest, JournalReadReply, answer, journal_read_rule, queue=JOURNAL_QUEUE)
