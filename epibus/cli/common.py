"""What every CLI command shares: options, one-line errors, JSON or rich output, time parsing."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from nats.aio.client import Client as NatsClient
from rich.console import Console

from bus.client.connection import open_nats
from bus.errors import EpibusError
from bus.host.home import NodeFollower, default_agent, epibus_home, explicit_nats_url, resolve_nats_url, split_servers
from bus.identity.signing import NODE_KEY_FILE, AgentKey, node_key
from epibus.cli.display import shown
from epibus.cli.tables import make_console, set_wide
from epibus.cli.tables import table as table  # what every command prints with

T = TypeVar("T")

console = make_console()
err_console = Console(stderr=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of tables.")]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="Print only the new id, for a shell variable: A=$(epibus … -q).")
]
WideOpt = Annotated[
    bool,
    typer.Option("--wide", "-w", help="Show text and ids whole, folded over lines.", callback=set_wide),
]
HomeOpt = Annotated[
    Path | None, typer.Option("--home", envvar="EPIBUS_HOME", help="epibus state directory [default: ~/.epibus]")
]
NatsOpt = Annotated[
    str | None,
    typer.Option(
        "--nats",
        envvar=["EPIBUS_NATS_URL", "NATS_URL"],
        help="NATS URL(s), comma-separated [default: the local node]",
    ),
]
NodeNatsOpt = Annotated[
    str | None,
    typer.Option(
        "--nats", envvar="EPIBUS_NATS_URL", help="An external NATS for this node [default: its own nats-server]"
    ),
]
JournalOpt = Annotated[
    str | None,
    typer.Option("--journal", envvar="EPIBUS_JOURNAL_URL", help="SQLAlchemy URL of the journal [default: the node's]"),
]
AgentOpt = Annotated[
    str | None, typer.Option("--agent", envvar="EPIBUS_AGENT", help="Agent name; its key is made on first use.")
]


def run(coro: Coroutine[Any, Any, T]) -> T:
    """The sync facade: one asyncio.run per command."""
    return asyncio.run(coro)


def fail(message: str, *, as_json: bool, code: int = 1, error_type: str = "Error") -> typer.Exit:
    """Report an error as one line on stderr (with --json, one JSON object there:
    {"ok": false, "error": …, "type": …}); the caller raises the returned Exit. stdout stays for results."""
    line = " ".join(message.split())
    if as_json:
        print(json.dumps({"ok": False, "error": line, "type": error_type}), file=sys.stderr, flush=True)
    else:
        shown_type = "" if error_type == "Error" else f"{error_type}: "
        err_console.print(shown(("error:", "bold red"), " ", shown_type + line), soft_wrap=True)
    return typer.Exit(code)


def handles_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """EpibusError → one line on stderr (one JSON object there with --json) and exit code 1; nothing else is
    caught. (The app's group does the same for a command without this decorator and for usage errors.)"""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except EpibusError as e:
            raise fail(str(e), as_json=bool(kwargs.get("as_json")), error_type=type(e).__name__) from None

    return wrapper


def emit_json(data: Any) -> None:
    # flushed: a watcher's lines (tail, inbox --watch) reach a pipe as they happen, not a buffer at a time
    print(json.dumps(data, default=str, sort_keys=True), flush=True)


@dataclass(frozen=True)
class Target:
    """Where a command connects and as whom (the agent names the NATS connection)."""

    nats: str | None
    home: Path | None
    agent: str | None

    async def connect(self) -> NatsClient:
        """A connection to --nats, or to the local node, followed to wherever it runs after a restart."""
        home = epibus_home(self.home)
        servers = split_servers(resolve_nats_url(self.nats, home))
        follow = NodeFollower(home, servers) if explicit_nats_url(self.nats) is None else None
        name = f"epibus-cli:{self.agent or default_agent()}"
        return await open_nats(servers, name=name, timeout_s=5, follow=follow, key=self.key(home))

    @contextlib.asynccontextmanager
    async def asking(self) -> AsyncIterator[tuple[NatsClient, AgentKey]]:
        """A connection and the key that signs node requests on it (see `key`): under a node's home the
        operator's, which may ask for what only admins and reviewers may."""
        nc = await self.connect()
        try:
            yield nc, self.key(epibus_home(self.home))
        finally:
            await nc.close()

    def key(self, home: Path) -> AgentKey:
        """Who the command acts as: the node's key where the home holds one (whoever can read the home runs the
        node), else the agent's, which must be enrolled on a server that authenticates."""
        if (home / NODE_KEY_FILE).exists():
            return node_key(home)
        return AgentKey.load_or_create(home, self.agent or default_agent())
