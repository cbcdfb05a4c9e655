"""`epibus tail`, `epibus events` and `epibus replay`: the event stream as it arrives, as the journal holds it, and
fed again through the journal."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from bus.enrolment.registry import AgentRegistry
from bus.errors import ConfigError
from bus.host.home import epibus_home, read_node_info, resolve_journal_url
from bus.intake.admission import Admission, Rejected
from bus.intake.follow import StreamFollower
from bus.intake.reader import replay
from bus.model.requests import JournalReadRequest, build_request
from bus.subjects import STREAM, events_filter
from epibus.cli import inputs
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JournalOpt,
    JsonOpt,
    NatsOpt,
    Target,
    WideOpt,
    console,
    emit_json,
    err_console,
    handles_errors,
    run,
    table,
)
from epibus.cli.display import shown
from epibus.cli.inputs import EventKindOpt, ProjectFilterOpt
from epibus.cli.reads import ReadJournalOpt, journal_read
from epibus.times import parse_time

# Loaded by the commands that use them, not at the top: the node (dashboard, metrics server, mirror), SQLAlchemy
# and the mesh store would otherwise cost every CLI start, `epibus --help` included.
if TYPE_CHECKING:
    from nats.aio.msg import Msg


@handles_errors
def tail(
    project: ProjectFilterOpt = None,
    kind: EventKindOpt = None,
    from_start: Annotated[bool, typer.Option("--from-start", help="Begin at the first event, not the next.")] = False,
    count: Annotated[
        int | None, typer.Option("--count", "-n", help="Stop after N events.", callback=inputs.at_least_one)
    ] = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """Follow events live as they reach the stream (messages the nodes refuse are shown, marked, with the reason)."""
    run(_tail(project, kind, from_start, count, Target(nats, home, agent), as_json))


async def _tail_line(msg: Msg, admission: Admission, as_json: bool) -> None:
    """One line per message; what the nodes' admission refuses is shown with its reason, never as an event."""
    seq = msg.metadata.sequence.stream
    try:
        event = await admission.admit(msg.subject, msg.data, msg.metadata.timestamp, msg.headers)
    except Rejected as e:
        if as_json:
            emit_json({"stream_seq": seq, "subject": msg.subject, "rejected": e.reason.value, "error": e.error})
        else:
            console.print(shown(f"{seq:>7} ", (f"REJECTED {e.reason.value}", "red"), f" {msg.subject}: {e.error}"))
        return
    if as_json:
        emit_json({"stream_seq": seq, "subject": msg.subject, **event.model_dump(mode="json")})
        return
    console.print(
        shown(
            f"{seq:>7} {event.recorded_at:%H:%M:%S} ",
            (event.project, "cyan"),
            " ",
            (event.kind, "bold"),
            f" {event.artifact_id} ",
            (event.actor.agent_id, "green"),
            f" {event.body.content_text()[:100]}",  # one line: shown() turns newlines into spaces
        ),
        soft_wrap=True,
    )


async def _tail(
    project: str | None,
    kind: str | None,
    from_start: bool,
    count: int | None,
    target: Target,
    as_json: bool,
) -> None:
    nc = await target.connect()
    try:
        subject = events_filter(project, kind)
        # Rides out a node restart: resumes after the last event shown, so none is missed or shown twice.
        follower = StreamFollower(
            nc.jetstream(), STREAM, subject, start_seq=1 if from_start else None, closed=lambda: nc.is_closed
        )
        if not as_json:
            err_console.print(shown(f"following {subject} (Ctrl-C stops)"))
        seen = 0
        admission = Admission(AgentRegistry(nc.jetstream()))
        async with contextlib.aclosing(follower.messages()) as messages:
            async for msg in messages:
                await _tail_line(msg, admission, as_json)
                seen += 1
                if count is not None and seen >= count:
                    break
    finally:
        await nc.close()


# -- events -----------------------------------------------------------------------------------------------


@handles_errors
def events(
    project: ProjectFilterOpt = None,
    kind: EventKindOpt = None,
    actor: Annotated[str | None, typer.Option("--actor", help="Agent id.", callback=inputs.agent)] = None,
    artifact_id: Annotated[
        str | None, typer.Option("--artifact-id", help="Its id or a unique prefix of it (4+ hex characters).")
    ] = None,
    since: Annotated[str | None, typer.Option("--since", help="ISO time or age (30m, 2h, 7d).")] = None,
    until: Annotated[str | None, typer.Option("--until", help="ISO time or age (30m, 2h, 7d).")] = None,
    limit: Annotated[int, typer.Option("--limit", callback=inputs.limit(100_000))] = 50,
    oldest_first: Annotated[bool, typer.Option("--oldest-first")] = False,
    journal: ReadJournalOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """Query the journal (through a node as --agent; --journal reads it directly, as the node's operator)."""
    request = build_request(
        JournalReadRequest,
        read="events",
        project=project,
        kinds=[kind] if kind else None,
        actor=actor,
        artifact_id=artifact_id,
        since=parse_time(since, "--since"),
        until=parse_time(until, "--until"),
        limit=limit,
        oldest_first=oldest_first,
    )
    rows = journal_read(request, journal=journal, nats=nats, agent=agent, home=home, as_json=as_json)
    if as_json:
        emit_json(rows)
        return
    where = f" in {project}" if project else ""
    columns = ["seq", "stored", *([] if project else ["project"]), "kind", "artifact", "actor", "text"]
    cells = [
        [
            r["stream_seq"],
            f"{datetime.fromisoformat(r['stored_at'] or r['recorded_at']):%Y-%m-%d %H:%M:%S}",
            *([] if project else [r["project"]]),
            r["kind"],
            r["artifact_id"],
            r["actor"],
            "[forgotten]" if r["text"] is None else r["text"],
        ]
        for r in rows
    ]
    console.print(table(f"{len(rows)} event(s){where}", columns, cells))


# -- replay -----------------------------------------------------------------------------------------------


@handles_errors
def replay_command(
    from_seq: Annotated[int, typer.Option("--from-seq", min=1, help="First stream sequence to replay.")] = 1,
    rebuild_state: Annotated[
        bool, typer.Option("--rebuild-state", help="Then recompute the state projection from the journal's events.")
    ] = False,
    rebuild: Annotated[
        bool,
        typer.Option(
            "--rebuild",
            help="Have the running node rebuild its journal into a fresh file from the stream and swap it in "
            "(a damaged journal; the old file is kept aside).",
        ),
    ] = False,
    node: Annotated[
        str | None, typer.Option("--node", help="With --rebuild: the node (this home's if not given).")
    ] = None,
    nats: NatsOpt = None,
    journal: JournalOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Rebuild the journal from the stream. Safe to repeat: rows already present are left as they are.
    --rebuild starts from an empty file instead, for a journal that is damaged."""
    if rebuild:
        run(_rebuild(node, Target(nats, home, agent), as_json))
        return
    run(_replay(from_seq, rebuild_state, journal, Target(nats, home, agent), as_json))


def _running_node(home: Path) -> str:
    info = read_node_info(home)
    if info is None or not info.name:
        raise ConfigError("node", f"no node runs under {home}: start it (`epibus up`), or name one with --node NAME")
    return info.name


async def _rebuild(node: str | None, target: Target, as_json: bool) -> None:
    from bus.client.fleet import ask_rebuild_journal

    name = node or _running_node(epibus_home(target.home))
    spinner = err_console.status(f"node {name} rebuilds its journal from the stream")
    async with target.asking() as (nc, signer):
        with contextlib.nullcontext() if as_json else spinner:
            reply = await ask_rebuild_journal(nc, signer, name)
    report = reply.model_dump(mode="json")
    if as_json:
        emit_json({"ok": True, **report})
        return
    rows = [[k, v] for k, v in report.items() if k not in ("rebuilt",)]
    console.print(table(f"journal of node {name} rebuilt", ["what", "value"], rows))
    if reply.first_stream_seq > 1:
        console.print(
            shown(
                f"note: the stream starts at sequence {reply.first_stream_seq}: what came before (dropped by its "
                f"limits, or erased by a forget) is not in the rebuilt journal; "
                + (
                    f"{reply.not_restored} row(s) of the damaged file are missing from it"
                    if reply.not_restored is not None
                    else "the damaged file cannot say how many rows that was"
                )
            ),
            soft_wrap=True,
        )


async def _replay(from_seq: int, rebuild_state: bool, journal: str | None, target: Target, as_json: bool) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from observers.journal import Journal, JournalObserver

    store = Journal(resolve_journal_url(journal, epibus_home(target.home)))
    nc = await target.connect()
    try:
        await asyncio.to_thread(store.migrate)
        observer = JournalObserver(store, name="replay")
        with Progress(
            TextColumn("replaying EPI"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=err_console,
            disable=as_json,
        ) as progress:
            task = progress.add_task("replay", total=None)

            def advance(seq: int, end: int) -> None:
                progress.update(task, completed=seq, total=end)

            report = await replay(nc.jetstream(), observer, start_seq=from_seq, progress=advance)
        rebuilt = await asyncio.to_thread(store.rebuild_projection) if rebuild_state else None
    finally:
        await nc.close()
        store.close()
    summary = {
        "ok": True,
        "read": report.read,
        "inserted": observer.inserted,
        "already_present": observer.already_present,
        "rejected": len(report.rejected),
        "last_seq": report.last_seq,
        "state_rebuilt_from_events": rebuilt,
        "journal": store.safe_url,
    }
    if as_json:
        emit_json(summary | {"rejected_details": report.rejected})
        return
    console.print(table("replay", ["what", "count"], [[k, v] for k, v in summary.items() if k != "ok"]))
    for seq, reason, error in report.rejected[:20]:
        console.print(shown(f"  rejected seq {seq}: {reason}: {error}"), soft_wrap=True)
