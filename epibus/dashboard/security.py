"""Who may use the dashboard: the node's operator, holding the token kept in `<home>/ui.token`. The token comes
once in the URL `epibus up` prints (`/?token=...`), which trades it for an HttpOnly SameSite=Strict cookie and
redirects to the bare page; every other request needs the cookie (or `Authorization: Bearer <token>`). Requests
naming another Host than the addresses the dashboard is bound to are refused first (DNS rebinding)."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import CookieError, SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from bus.errors import ConfigError
from bus.host.home import secret_token

TOKEN_FILE = "ui.token"
COOKIE = "epibus_ui"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
# The page's own script and style only: event text that slipped past escaping still could not run.
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
        b"base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),
]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def ui_token(home: Path) -> str:
    """The dashboard's token: made once, 0600 under the home. Delete the file (and restart) to rotate it."""
    return secret_token(home / TOKEN_FILE)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind_host(host: str, *, allow_remote: bool) -> None:
    """Loopback unless the operator asked for more; never a wildcard (no Host could then be checked).
    Raises ConfigError naming --ui-host."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        if host != "localhost":
            raise ConfigError("--ui-host", f"{host!r} is not an IP address; give one (127.0.0.1 by default)") from None
        return
    if address.is_unspecified:
        raise ConfigError("--ui-host", f"{host} listens on every address; give the one address to serve on")
    if not address.is_loopback and not allow_remote:
        raise ConfigError(
            "--ui-host",
            f"{host} is not a loopback address: anyone who can reach it could try the token over plain HTTP; "
            "pass --ui-remote to serve it anyway",
        )


def allowed_hosts(host: str, port: int) -> frozenset[str]:
    """The Host header values a browser sends for this dashboard's own URLs."""
    literal = f"[{host}]" if ":" in host else host
    names = {*LOOPBACK_NAMES, literal} if is_loopback(host) else {literal}
    return frozenset(f"{name}:{port}" for name in names)


class TokenGate:
    """ASGI middleware in front of the whole app: a wrong Host gets 421, a missing or wrong token 401; neither
    reaches the app. Every answer carries the security headers."""

    def __init__(self, app: App, token: str, hosts: frozenset[str]) -> None:
        self.app = app
        self.token = token.encode()
        self.hosts = hosts
        self.refused = 0  # requests answered 401 or 421, shown on the page

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)  # lifespan
            return
        headers = _headers(scope)
        if headers.get(b"host", b"").decode("latin-1").lower() not in self.hosts:
            await self._refuse(send, 421, "this dashboard answers only to its own address (Host header refused)")
            return
        if scope["path"] == "/" and (given := _query_token(scope)) is not None:
            await self._exchange(send, given)
            return
        if not self._holds_token(headers):
            await self._refuse(
                send, 401, "missing or wrong dashboard token: open the URL `epibus up` printed, or <home>/ui.token"
            )
            return
        await self.app(scope, receive, _with_headers(send))

    def _holds_token(self, headers: dict[bytes, bytes]) -> bool:
        bearer = headers.get(b"authorization", b"")
        if bearer.startswith(b"Bearer ") and hmac.compare_digest(bearer[7:], self.token):
            return True
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get(b"cookie", b"").decode("latin-1"))
        except CookieError:  # a hostile Cookie header holds no token
            return False
        held = cookie.get(COOKIE)
        return held is not None and hmac.compare_digest(held.value.encode(), self.token)

    async def _exchange(self, send: Send, given: bytes) -> None:
        """`/?token=...`: the token becomes a cookie and the browser is sent to the bare page, so the token
        leaves the address bar and the history."""
        if not hmac.compare_digest(given, self.token):
            await self._refuse(send, 401, "wrong dashboard token: see <home>/ui.token")
            return
        cookie = f"{COOKIE}={self.token.decode()}; HttpOnly; SameSite=Strict; Path=/"
        await send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [(b"location", b"/"), (b"set-cookie", cookie.encode()), *SECURITY_HEADERS],
            }
        )
        await send({"type": "http.response.body", "body": b""})

    async def _refuse(self, send: Send, status: int, message: str) -> None:
        self.refused += 1
        body = message.encode() + b"\n"
        headers = [(b"content-type", b"text/plain; charset=utf-8"), *SECURITY_HEADERS]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _headers(scope: Scope) -> dict[bytes, bytes]:
    """The request's headers by lower-case name; a repeated Host or Cookie counts as none (refused)."""
    found: dict[bytes, bytes] = {}
    repeated: set[bytes] = set()
    for name, value in scope.get("headers") or []:
        key = name.lower()
        if key in found:
            repeated.add(key)
        found[key] = value
    for key in repeated & {b"host", b"cookie", b"authorization"}:
        found[key] = b""
    return found


def _query_token(scope: Scope) -> bytes | None:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
    return values[0].encode() if values and len(values) == 1 else None


def _with_headers(send: Send) -> Send:
    async def sending(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = dict(message)
            headers = list(message.get("headers", []))
            present = {name.lower() for name, _ in headers}
            message["headers"] = headers + [(name, value) for name, value in SECURITY_HEADERS if name not in present]
        await send(message)

    return sending
