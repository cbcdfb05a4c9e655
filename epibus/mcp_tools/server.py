"""`epibus mcp`: the MCP server of one agent, over stdio (one client, the process that started it) or streamable
HTTP on loopback (any local client holding the server's bearer token). Tool errors come back as MCP tool errors
carrying the CLI's one-line message; a tool that does not exist is a protocol error naming the tools there are."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import INVALID_PARAMS

from bus.broker.loops import cancel_and_wait
from bus.errors import EpibusError
from bus.host.home import secret_token
from epibus.mcp_tools.guard import parse_arguments
from epibus.mcp_tools.mesh_tools import mesh_tools
from epibus.mcp_tools.session import AgentSession
from epibus.mcp_tools.tools import ToolSpec, knowledge_tools
from epibus.mcp_tools.watch_tools import watch_tools
from epibus.monitoring.http_serving import listen, netloc

log = logging.getLogger(__name__)
INSTRUCTIONS = (
    "epibus is the shared memory of a fleet of agents. Publish what you find, do not know, got wrong, decided, "
    "assumed or abandoned (publish_* tools); recall before you start (briefing, recall); vouch for or refute "
    "others' claims (verify, contradict); coordinate work (propose, inbox, start, complete, acknowledge); be "
    "told of what others record that concerns you (watch, then notices). Every call acts as this server's agent "
    "and is signed with its key."
)


@dataclass
class CallStats:
    calls: int = 0
    refused: int = 0  # tool errors: bad arguments, forbidden, illegal, unavailable (each returned to the caller)
    by_error: dict[str, int] = field(default_factory=dict)
    failed: int = 0  # defects: an exception no rule raised, logged with its traceback


class EpibusMcp:
    """The tool table and the two handlers the MCP server dispatches to."""

    def __init__(self, session: AgentSession, tools: list[ToolSpec] | None = None) -> None:
        self.session = session
        specs = tools if tools is not None else [*knowledge_tools(), *mesh_tools(), *watch_tools()]
        self.tools = {spec.name: spec for spec in specs}
        self._listed = [spec.tool() for spec in specs]
        self.stats = CallStats()
        self.server: Server[Any] = Server(
            "epibus",
            version=_version(),
            instructions=INSTRUCTIONS,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self._listed)

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        spec = self.tools.get(params.name)
        if spec is None:
            names = ", ".join(sorted(self.tools))
            raise MCPError(INVALID_PARAMS, f"unknown tool {params.name!r}; epibus tools: {names}")
        self.stats.calls += 1
        try:
            arguments = parse_arguments(spec.name, spec.input, params.arguments)
            result = await spec.handler(self.session, arguments)
        except EpibusError as e:
            name = type(e).__name__
            self.stats.refused += 1
            self.stats.by_error[name] = self.stats.by_error.get(name, 0) + 1
            log.info("%s refused for %s: %s: %s", spec.name, self.session.agent, name, e)
            return types.CallToolResult(content=[types.TextContent(text=f"{name}: {e}")], is_error=True)
        except Exception as e:  # a defect, not a refusal: logged with its traceback and counted; the server goes on
            self.stats.failed += 1
            log.exception("%s failed for %s", spec.name, self.session.agent)
            cause = " ".join(str(e).split())[:300]
            text = (
                f"{type(e).__name__}: {spec.name} failed inside the epibus MCP server ({cause}); see its log (stderr)"
            )
            return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)
        text = json.dumps(result, separators=(",", ":"), sort_keys=True, default=str, ensure_ascii=False)
        return types.CallToolResult(content=[types.TextContent(text=text)], structured_content=json.loads(text))

    async def serve_stdio(self) -> None:
        async with stdio_server() as (read, write):
            await self.server.run(read, write, self.server.create_initialization_options())

    async def serve_http(self, *, host: str, port: int, token: str, ready: Callable[[str], None]) -> None:
        """Serve streamable HTTP at http://host:port/mcp to clients sending `Authorization: Bearer <token>`."""
        import uvicorn

        app = BearerToken(self.server.streamable_http_app(host=host), token)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
        server = uvicorn.Server(config)
        listening = listen(host, port, option="--port")  # bound here, so a taken port is one line, not uvicorn's exit
        serving = asyncio.ensure_future(server.serve(sockets=[listening]))
        try:
            ready(f"http://{netloc(host, port)}/mcp")  # it listens: connections wait in the backlog till served
            await serving
        finally:
            await cancel_and_wait([serving])
            listening.close()


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class BearerToken:
    """ASGI middleware: an HTTP request without the server's token is answered 401 and reaches nothing. Loopback
    alone is not a boundary: any local process could otherwise act as this agent."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and not self._holds_token(scope):
            await send({"type": "websocket.close", "code": 1008})  # policy violation: no token, no socket
            return
        if scope["type"] == "http" and not self._holds_token(scope):
            body = b'{"error":"missing or wrong bearer token: see `epibus mcp --http --print-config`"}'
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    def _holds_token(self, scope: Scope) -> bool:
        given = [value for name, value in scope.get("headers") or [] if name.lower() == b"authorization"]
        return len(given) == 1 and hmac.compare_digest(given[0], self.expected)


def http_token(home: Path, agent: str) -> str:
    """The bearer token of this agent's HTTP server: made once, kept 0600 under the home, so a client's
    configuration stays valid across restarts. Delete the file to rotate it."""
    return secret_token(home / "mcp" / f"{agent}.token")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("epibus")
    except PackageNotFoundError:
        return "0"
