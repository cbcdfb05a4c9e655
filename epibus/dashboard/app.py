"""The dashboard's routes: the page and its script and style (files beside this module, nothing fetched from
elsewhere), a JSON snapshot, the server-sent event stream, and recall through the safe door. Every route sits
behind the TokenGate (security.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bus.client.recall import recall_request
from bus.errors import ConfigError, EpibusError
from bus.model.requests import MAX_TEXT_CHARS, RecallRequest
from epibus.dashboard.feed import CLOSE, Feed, Subscriber

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
FILES = {
    "/app.js": ("app.js", "text/javascript"),
    "/style.css": ("style.css", "text/css"),
    "/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
INITIAL_MARK = b"<!--initial-->"  # where the page carries where things stand, so its first paint shows figures
MAX_BODY_BYTES = 6 * MAX_TEXT_CHARS + 1024  # the longest query, every character escaped as \uXXXX
RECALL_HITS = 10
SEND_TIMEOUT_S = 10.0  # a page that takes no bytes for this long is dropped
PING_S = 15

Recall = Callable[[RecallRequest], Awaitable[list[dict[str, Any]]]]


def build_app(feed: Feed, recall: Recall) -> Starlette:
    files = {path: ((STATIC / name).read_bytes(), media) for path, (name, media) in FILES.items()}

    page = (STATIC / "index.html").read_bytes()

    async def static(request: Request) -> Response:
        body, media = files[request.url.path]
        return Response(body, media_type=media)

    async def index(_: Request) -> Response:
        """The page with the figures of now inside it, rendered by the script before the stream opens: a page
        (or a screenshot) never shows placeholders waiting for the first update."""
        health = await feed.current_health()
        initial = {
            "events": {"events": feed.events, "rate": feed.rate},
            "health": health | {"pages": health["pages"] | {"dropped_here": 0}},
        }
        data = json.dumps(initial, default=str).replace("<", "\\u003c").encode()  # no `</script>` can end it
        return Response(page.replace(INITIAL_MARK, data), media_type="text/html")

    async def snapshot(_: Request) -> JSONResponse:
        return JSONResponse({"events": feed.events, "health": await feed.current_health()})

    async def stream(_: Request) -> Response:
        subscriber = feed.subscribe()
        if subscriber is None:
            return JSONResponse({"error": "too many dashboard pages are open; close one and reload"}, status_code=503)
        return EventSourceResponse(
            _messages(feed, subscriber),
            ping=PING_S,
            send_timeout=SEND_TIMEOUT_S,
        )

    async def recall_route(request: Request) -> JSONResponse:
        return await _recall(request, recall)

    routes = [Route("/", index), *(Route(path, static) for path in files)]
    routes += [
        Route("/api/snapshot", snapshot),
        Route("/api/stream", stream),
        Route("/api/recall", recall_route, methods=["POST"]),
    ]
    return Starlette(routes=routes)


async def _messages(feed: Feed, subscriber: Subscriber) -> AsyncIterator[dict[str, str]]:
    """What one page is sent: where things stand now, then every message queued for it."""
    try:
        yield {"event": "events", "data": json.dumps({"events": feed.events, "rate": feed.rate}, default=str)}
        await feed.current_health()
        yield {"event": "health", "data": _health(feed, subscriber)}
        while True:
            kind, data = await subscriber.queue.get()
            if (kind, data) == CLOSE:
                return
            if kind == "health":
                data = _health(feed, subscriber)  # with this page's own drops
            yield {"event": kind, "data": data}
    finally:
        feed.unsubscribe(subscriber)


def _health(feed: Feed, subscriber: Subscriber) -> str:
    health = feed.snapshot_health()
    health["pages"] = health["pages"] | {"dropped_here": subscriber.dropped}
    return json.dumps(health, default=str)


async def _recall(request: Request, recall: Recall) -> JSONResponse:
    """POST {"query": ..., "project": ...}: the safe door's hits, or a one-line error naming the field."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        return _error(415, "send the recall as JSON (Content-Type: application/json)")
    body = b""
    async for chunk in request.stream():  # read no further than the limit, whatever Content-Length says
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            return _error(413, f"the request is over {MAX_BODY_BYTES} bytes; shorten the query")
    try:
        given = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, 'the body is not JSON; send {"query": "...", "project": "..."}')
    if not isinstance(given, dict) or not all(isinstance(given.get(f), str) for f in ("query", "project")):
        return _error(400, 'query and project must be strings; send {"query": "...", "project": "..."}')
    if extra := sorted(set(given) - {"query", "project"}):
        return _error(400, f"{extra[0][:40]!r} is not a recall field (allowed: query, project)")
    try:
        asked = recall_request(
            given["query"],
            given["project"],
            k=RECALL_HITS,
            kinds=None,
            include_resolved=False,
            as_of=None,
            audit=False,
        )
    except ConfigError as e:
        return _error(400, str(e))
    try:
        hits = await recall(asked)
    except EpibusError as e:
        log.warning("dashboard recall failed: %s", e)
        return _error(503, str(e))
    return JSONResponse({"query": asked.query, "project": asked.project, "hits": hits})


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)
