"""`epibus mcp`: serve this agent's tools to an MCP client (stdio, or streamable HTTP on loopback), or print the
configuration block a client needs to start or reach it."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bus.errors import ConfigError
from bus.host.home import default_agent, epibus_home
from epibus.cli.common import AgentOpt, HomeOpt, JournalOpt, JsonOpt, NatsOpt, err_console, handles_errors
from epibus.cli.display import shown

if TYPE_CHECKING:
    from epibus.mcp_tools.server import EpibusMcp
    from epibus.mcp_tools.session import AgentSession

DEFAULT_HTTP_PORT = 8765
log = logging.getLogger(__name__)


@handles_errors
def mcp(
    agent: AgentOpt = None,
    http: Annotated[bool, typer.Option("--http", help="Serve streamable HTTP instead of stdio.")] = False,
    host: Annotated[str, typer.Option("--host", help="With --http: a loopback address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="With --http: the port.")] = DEFAULT_HTTP_PORT,
    print_config: Annotated[
        bool, typer.Option("--print-config", help="Print the JSON block an MCP client needs, and exit.")
    ] = False,
    nats: NatsOpt = None,
    journal: JournalOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Serve epibus to an MCP client as one agent (--agent; its key signs everything). Over stdio by default;
    with --http on http://HOST:PORT/mcp, for clients holding the bearer token (see --print-config)."""
    name = agent or default_agent()
    where = epibus_home(home)
    if http:
        _require_loopback(host)
    if print_config:
        print(
            json.dumps(client_config(name, where, home, http=http, host=host, port=port), indent=None if as_json else 2)
        )
        return
    # Loaded here: the MCP SDK (starlette, pydantic schemas) costs every other command's start a second of CPU.
    from epibus.mcp_tools.session import AgentSession, SessionConfig

    session = AgentSession(SessionConfig(agent=name, home=home, nats=nats, journal=journal))
    asyncio.run(_serve(session, http=http, host=host, port=port, as_json=as_json))


async def _serve(session: AgentSession, *, http: bool, host: str, port: int, as_json: bool) -> None:
    from epibus.mcp_tools.server import EpibusMcp  # the MCP SDK, loaded only to serve (see `mcp`)

    async with session:
        await session.refuse_a_person()
        server = EpibusMcp(session)
        try:
            await _transport(server, session, http=http, host=host, port=port, as_json=as_json)
        finally:
            stats = server.stats
            log.info(
                "epibus mcp (agent %s) stops: %d calls, %d refused %s, %d failed",
                session.agent,
                stats.calls,
                stats.refused,
                stats.by_error,
                stats.failed,
            )


async def _transport(
    server: EpibusMcp, session: AgentSession, *, http: bool, host: str, port: int, as_json: bool
) -> None:
    if not http:
        await server.serve_stdio()
        return

    def ready(url: str) -> None:
        if as_json:
            print(json.dumps({"ok": True, "agent": session.agent, "url": url}), flush=True)
        else:
            err_console.print(shown(f"epibus mcp: agent {session.agent} at {url} (Ctrl-C stops)"), soft_wrap=True)

    from epibus.mcp_tools.server import http_token  # the MCP SDK, loaded only to serve (see `mcp`)

    await server.serve_http(host=host, port=port, token=http_token(session.home, session.agent), ready=ready)


def client_config(
    agent: str,
    home: Path,
    home_option: Path | None,
    *,
    http: bool,
    host: str,
    port: int,
    nats: str | None = None,
    journal: str | None = None,
) -> dict[str, Any]:
    """The `mcpServers` entry for this agent, as MCP clients (desktop and coding assistants) read it."""
    name = f"epibus-{agent}"
    if http:
        from epibus.mcp_tools.server import http_token  # the MCP SDK, loaded only when a token is asked for

        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/mcp"
        headers = {"Authorization": f"Bearer {http_token(home, agent)}"}
        return {"mcpServers": {name: {"type": "http", "url": url, "headers": headers}}}
    command, args = _command()
    chosen = [*(["--nats", nats] if nats else []), *(["--journal", journal] if journal else [])]
    entry: dict[str, Any] = {"command": command, "args": [*args, "mcp", "--agent", agent, *chosen]}
    if home_option is not None or "EPIBUS_HOME" in os.environ:
        entry["env"] = {"EPIBUS_HOME": str(home)}
    return {"mcpServers": {name: entry}}


def _command() -> tuple[str, list[str]]:
    """The installed `epibus` beside this interpreter, else the interpreter running the module."""
    script = Path(sys.executable).with_name("epibus")
    if script.exists():
        return str(script), []
    return sys.executable, ["-m", "epibus"]


def _require_loopback(host: str) -> None:
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(
            "--host",
            f"{host!r} is not a loopback address: the HTTP server speaks plain HTTP; serve on 127.0.0.1 and put "
            "a TLS-terminating proxy in front of it to reach it from elsewhere",
        )
