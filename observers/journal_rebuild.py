"""Rebuilding a damaged SQLite journal from the stream while the node runs: replay every event into a fresh
file beside it, pause the live journal observer, replay what arrived meanwhile, then swap the fresh file in
(the damaged one is kept aside, never deleted) and let the observer go on. The rebuilt file takes the old one's
identity when it can still be read, so the node's durable consumer carries on where it was.

What the stream no longer holds (messages its limits dropped, or a forget erased) cannot come back: the report
says how many rows the damaged file holds that the rebuilt one does not, when the damaged file can say."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from nats.js import JetStreamContext

from bus.enrolment.service_rules import admin_rule
from bus.errors import ConfigError, Unavailable
from bus.intake.reader import replay
from bus.intake.stream_read import stream_bounds
from bus.model.requests import JournalRebuildReply, JournalRebuildRequest
from bus.services.responder import Service
from bus.subjects import JOURNAL_REBUILD, STREAM
from observers.journal import Journal, JournalObserver

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebuildCounts:
    events: int  # rows in the rebuilt journal
    last_seq: int  # the stream sequence it reached
    rejected: int  # messages the admission refused (kept out, as the live observer does)
    aside: str  # where the damaged file is kept
    first_stream_seq: int  # the oldest message the stream still holds
    not_restored: int | None  # rows the damaged file holds that the stream could not give back; None: unreadable


def aside_path(file: Path) -> Path:
    """Where a journal file replaced by a rebuild is kept (never deleted): beside it, named by the time."""
    return file.with_name(f"{file.name}.aside-{datetime.now(UTC):%Y%m%dT%H%M%SZ}")


def _remove(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def _not_restored(aside: Path, rebuilt: Journal) -> int | None:
    """Rows of the damaged file missing from the rebuilt journal; None when the damaged file cannot tell."""
    damaged = Journal(f"sqlite:///{aside}")
    try:
        kept = set(damaged.event_ids())
    except Unavailable as e:  # StoreDamaged included: the damage is why it was rebuilt
        log.warning(
            "the damaged journal %s cannot list its events (%s): what it held beyond the stream is unknown", aside, e
        )
        return None
    finally:
        damaged.close()
    return len(kept - set(rebuilt.event_ids()))


async def rebuild_journal(
    js: JetStreamContext,
    journal: Journal,
    observer: JournalObserver,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> RebuildCounts:
    """Rebuild `journal` (a SQLite file) from the stream and swap it in; `observer` is the live one, paused
    around the swap. Raises ConfigError for a journal that is not a SQLite file, Unavailable when the stream
    cannot be read (nothing is swapped then)."""
    if journal.file is None:
        raise ConfigError(
            "journal",
            f"{journal.safe_url} is not a SQLite file: restore PostgreSQL from its backup, or create an empty "
            "database and run `epibus replay --journal URL`",
        )
    fresh = journal.file.with_name(journal.file.name + ".rebuilding")
    _remove(fresh)  # a rebuild cut short leaves one
    try:
        identity: str | None = await asyncio.to_thread(journal.identity)
    except Unavailable as e:
        identity = None
        log.warning("the damaged journal's identity cannot be read (%s): the node's journal consumer starts anew", e)
    rebuilt = Journal(f"sqlite:///{fresh}")
    try:
        await asyncio.to_thread(rebuilt.migrate)
        if identity is not None:
            await asyncio.to_thread(rebuilt.adopt_identity, identity)
        sink = JournalObserver(rebuilt, name="rebuild")
        first = await replay(js, sink, progress=progress)
        async with observer.paused():  # nothing reaches the old file from here on
            rest = await replay(js, sink, start_seq=first.last_seq + 1)
            events = await asyncio.to_thread(rebuilt.count)
            rebuilt.close()  # the last connection closes: SQLite folds its WAL into the file
            aside = aside_path(journal.file)
            await asyncio.to_thread(journal.replace_file, fresh, aside)
    finally:
        rebuilt.close()
    first_seq, _ = await stream_bounds(js, STREAM)
    not_restored = await asyncio.to_thread(_not_restored, aside, journal)
    log.warning("journal rebuilt from the stream: %d events; the damaged file is kept as %s", events, aside)
    return RebuildCounts(
        events=events,
        last_seq=max(first.last_seq, rest.last_seq),
        rejected=len(first.rejected) + len(rest.rejected),
        aside=str(aside),
        first_stream_seq=first_seq,
        not_restored=not_restored,
    )


START_REMEDY = "start the node with `epibus up --rebuild-journal` (the damaged file is kept aside)"


def set_aside(journal: Journal) -> tuple[Path, str | None]:
    """Before a node opens its journal: move a SQLite journal's file aside so a fresh one is made and filled from
    the stream by the node's journal observer (a new durable consumer, from the stream's first message). Returns
    the aside path and the name of the old file's durable consumer (None when the file cannot say), for the
    node to delete. Raises ConfigError for a journal that is not a SQLite file."""
    if journal.file is None:
        raise ConfigError(
            "--rebuild-journal",
            f"{journal.safe_url} is not a SQLite file: restore PostgreSQL from its backup, or create an empty "
            "database and run `epibus replay --journal URL`",
        )
    try:
        old_consumer: str | None = f"journal-{journal.identity()[:8]}"
    except Unavailable as e:
        old_consumer = None
        log.warning("the journal's identity cannot be read (%s): its old durable consumer is left in place", e)
    aside = aside_path(journal.file)
    journal.replace_file(None, aside)
    log.warning("journal %s kept aside as %s; a fresh one is filled from the stream", journal.file, aside)
    return aside, old_consumer


def rebuild_service(
    js: JetStreamContext,
    journal: Journal,
    observer: Callable[[], JournalObserver | None],
    *,
    node: str,
    after: Callable[[], Awaitable[object]],
) -> Service[JournalRebuildRequest]:
    """JOURNAL_REBUILD: every node hears it, the one named rebuilds (an admin asked); `after` runs once the new
    file is in (the node checks its stores again)."""

    async def answer(request: JournalRebuildRequest) -> JournalRebuildReply:
        live = observer()
        if request.node != node:
            return JournalRebuildReply(node=node, rebuilt=False)
        if live is None:
            raise Unavailable("journal", f"node {node} has no journal observer running yet; ask again shortly")
        counts = await rebuild_journal(js, journal, live)
        await after()
        return JournalRebuildReply(
            node=node,
            rebuilt=True,
            events=counts.events,
            last_seq=counts.last_seq,
            rejected=counts.rejected,
            aside=counts.aside,
            first_stream_seq=counts.first_stream_seq,
            not_restored=counts.not_restored,
        )

    return Service(JOURNAL_REBUILD, JournalRebuildRequest, JournalRebuildReply, answer, admin_rule)
