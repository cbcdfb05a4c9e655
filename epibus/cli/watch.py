"""`epibus watch`: standing questions by meaning. `epibus watch --about TEXT -p P` registers one and follows what
it pushes; `watch list`, `watch stop ID`, and `watch follow` to read the notices again from a cursor."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from bus.client.client import EpibusClient
from bus.client.watch import NoticeLog, PushedNotice, notice_line
from bus.errors import ConfigError
from bus.host.home import default_agent, epibus_home
from bus.intake.cursor import Cursor, FileCursor
from bus.model.watch import DEFAULT_THRESHOLD, DEFAULT_WATCH_DAYS, MAX_WATCH_DAYS, WatchView
from epibus import connect
from epibus.cli import inputs
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JsonOpt,
    NatsOpt,
    console,
    emit_json,
    err_console,
    handles_errors,
    run,
    table,
)
from epibus.cli.display import shown
from epibus.cli.mesh import until_stopped
from epibus.cli.recall import KindsOpt

T = TypeVar("T")
watch_app = typer.Typer(
    help="Standing questions by meaning: `epibus watch --about TEXT -p P` registers one, then prints each claim any "
    "agent records in P that means TEXT (once, whichever node indexes it). A claim retracted after it was pushed "
    "is followed by a 'no longer trusted' notice.",
    invoke_without_command=True,
)

ProjectsOpt = Annotated[
    list[str] | None,
    typer.Option("--project", "-p", help="A project to watch (repeatable; you must be a member).",
                 callback=lambda values: [inputs.project(v) for v in values] if values else values),
]  # fmt: skip
OutOpt = Annotated[
    Path | None,
    typer.Option("--out", help="Append notices to this JSON-lines file, which is also the cursor."),
]
CountOpt = Annotated[
    int | None, typer.Option("--count", "-n", help="Stop after N notices.", callback=inputs.at_least_one)
]


@watch_app.callback()
@handles_errors
def watch(
    ctx: typer.Context,
    about: Annotated[str | None, typer.Option("--about", help="What to be told of, in words.")] = None,
    project: ProjectsOpt = None,
    kind: KindsOpt = None,
    threshold: Annotated[
        float, typer.Option("--threshold", min=0.01, max=1.0, help="How close a claim must be (cosine).")
    ] = DEFAULT_THRESHOLD,
    days: Annotated[
        float, typer.Option("--days", min=0.001, max=MAX_WATCH_DAYS, help="How long the watch stands.")
    ] = DEFAULT_WATCH_DAYS,
    audit: Annotated[bool, typer.Option("--audit", help="Claims in every state (reviewers, admins).")] = False,
    follow: Annotated[bool, typer.Option("--follow/--no-follow", help="Then follow its notices.")] = True,
    out: OutOpt = None,
    count: CountOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Register a watch (--about TEXT -p PROJECT), then follow its notices (Ctrl-C stops)."""
    if ctx.invoked_subcommand is not None:
        return
    if about is None or not project:
        raise ConfigError("watch", "give --about TEXT and --project P (or a command: list, stop, follow)")

    async def register(client: EpibusClient) -> None:
        made = await client.watch(about, project, kinds=kind, threshold=threshold, days=days, audit=audit)
        if as_json:
            print(json.dumps({"ok": True, "watch": made.model_dump(mode="json")}), flush=True)
        else:
            console.print(table("epibus watch: registered", ["watch", "projects", "threshold", "expires", "about"],
                                [_row(made)]))  # fmt: skip
        if follow:
            await _follow(client, _cursor(home, agent, out), out, count, as_json)

    run(_with_client(nats, agent, home, register))


@watch_app.command("list")
@handles_errors
def list_command(nats: NatsOpt = None, agent: AgentOpt = None, home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Your watches (expired ones too, until they are dropped) and how many you may hold."""

    async def listed(client: EpibusClient) -> tuple[list[WatchView], int]:
        return await client.watches.list_own()

    watches, limit = run(_with_client(nats, agent, home, listed))
    if as_json:
        emit_json({"ok": True, "limit": limit, "watches": [w.model_dump(mode="json") for w in watches]})
        return
    title = f"epibus watch list: {len(watches)} of {limit}"
    console.print(table(title, ["watch", "projects", "threshold", "expires", "about"], [_row(w) for w in watches]))


@watch_app.command("stop")
@handles_errors
def stop_command(
    watch_id: Annotated[str, typer.Argument(help="The watch id, as `epibus watch list` shows it.")],
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Stop one of your watches: nothing more is pushed for it."""

    async def stopped(client: EpibusClient) -> tuple[str, bool]:
        # A table cuts ids at 80 columns: a unique prefix of one of your watches names it, as ids do elsewhere.
        owned, _ = await client.watches.list_own()
        matching = [w.watch_id for w in owned if w.watch_id.startswith(watch_id.lower())]
        if len(matching) > 1:
            raise ConfigError("watch_id", f"{watch_id!r} is the start of {len(matching)} of your watches; give more")
        named = matching[0] if matching else watch_id
        return named, await client.watches.stop(named)

    named, done = run(_with_client(nats, agent, home, stopped))
    if as_json:
        emit_json({"ok": True, "watch_id": named, "stopped": done})
        return
    said = f"watch {named} stopped" if done else f"no watch {watch_id} of yours (stopped already?)"
    console.print(shown(said))


@watch_app.command("follow")
@handles_errors
def follow_command(
    out: OutOpt = None,
    reset: Annotated[bool, typer.Option("--reset", help="Forget the saved cursor: read every kept notice.")] = False,
    count: CountOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Follow the notices of all your watches from your cursor.

    Resumes after the last notice shown (a saved cursor, or --out's last line): a watcher that was away gets
    what it missed, once. Notices are kept 7 days."""
    if reset and out is not None:
        raise ConfigError("--reset", "with --out the file is the cursor: start a new file (or remove it) instead")
    cursor = _cursor(home, agent, out)
    if reset:
        cursor.save(0)

    async def follow(client: EpibusClient) -> None:
        await _follow(client, cursor, out, count, as_json)

    run(_with_client(nats, agent, home, follow))


def _cursor(home: Path | None, agent: str | None, out: Path | None) -> Cursor:
    if out is not None:
        return NoticeLog(out)
    return FileCursor(epibus_home(home) / "watch" / f"notices-{agent or default_agent()}.cursor")


async def _with_client(
    nats: str | None, agent: str | None, home: Path | None, work: Callable[[EpibusClient], Awaitable[T]]
) -> T:
    async with connect(nats, agent=agent, home=home, outbox=False) as client:
        return await work(client)


async def _follow(client: EpibusClient, cursor: Cursor, out: Path | None, count: int | None, as_json: bool) -> None:
    done = asyncio.Event()
    told = 0
    log = cursor if isinstance(cursor, NoticeLog) else None

    async def read() -> None:
        nonlocal told
        async with contextlib.aclosing(client.watches.notices(after_seq=cursor.load())) as notices:
            async for pushed in notices:
                _show(pushed, as_json)
                if log is not None:
                    log.append(pushed)
                else:
                    cursor.save(pushed.seq)
                told += 1
                if count is not None and told >= count:
                    done.set()
                    return

    if not as_json:
        err_console.print(shown(f"following notices after #{cursor.load()} (Ctrl-C stops)"))
    await until_stopped(read(), done)


def _show(pushed: PushedNotice, as_json: bool) -> None:
    if as_json:
        print(json.dumps(notice_line(pushed), sort_keys=True), flush=True)
        return
    n = pushed.notice
    said = "no longer trusted" if n.notice == "no_longer_trusted" else f"{n.score:.2f}"
    console.print(
        shown(f"#{pushed.seq} [{n.project}] {said} {n.kind} {n.artifact_id} by {n.author}: {n.text}"), soft_wrap=True
    )


def _row(watch: WatchView) -> list[str]:
    return [watch.watch_id, ", ".join(watch.projects), f"{watch.threshold:.2f}", watch.expires_at.isoformat()[:16],
            watch.about]  # fmt: skip
