"""Opening a NATS connection: reconnecting forever, following a local node that moved, authenticating with an
agent's nkey, and failing fast (Forbidden) when the server refuses the key."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from nats.aio.client import Client as NatsClient

from bus.errors import Forbidden, Unavailable
from bus.home import NodeFollower
from bus.loops import cancel_and_wait
from bus.nats_errors import (
    CONNECT_ERRORS,
    CONNECT_OR_REFUSED,
    is_authorization_error,
    remember_violation,
)
from bus.signing import AgentKey
from bus.tls import nats_tls_context

log = logging.getLogger(__name__)


async def open_nats(
    servers: Sequence[str],
    *,
    name: str,
    timeout_s: float,
    follow: NodeFollower | None = None,
    key: AgentKey | None = None,
    **callbacks: Any,
) -> NatsClient:
    """A reconnecting NATS connection, or Unavailable (naming the last connection error) if none is made
    within timeout_s. Connection errors go to `error_cb` if given, never to nats-py's traceback logging.
    With `follow`, every failed attempt asks where the local node runs now and reconnects there if it moved.
    With `key`, the connection authenticates with that nkey and receives on its own inboxes only; a server that
    does not know the key raises Forbidden. TLS (CA, client certificate) comes from the environment: see
    `bus.tls.nats_tls_context`."""
    tls = nats_tls_context()
    nc = NatsClient()
    errors: list[BaseException] = []  # only the last: an outage of hours fails an attempt every second
    user_error_cb = callbacks.pop("error_cb", None)

    async def remember(error: Exception) -> None:
        errors[:] = [error]
        remember_violation(nc, error)
        moved = follow.moved() if follow is not None and not nc.is_closed else None
        if moved:
            log.warning("the local node now runs at %s; reconnecting there", ", ".join(moved))
            nc.set_server_pool(moved)  # the next reconnect attempt uses it
        if user_error_cb is not None:
            await user_error_cb(error)

    credentials = key.nats_credentials if key is not None else {}
    connecting = asyncio.ensure_future(
        nc.connect(
            servers=list(servers),
            name=name,
            connect_timeout=max(1, int(timeout_s)),
            reconnect_time_wait=1,
            max_reconnect_attempts=-1,  # keep trying; the outbox holds events meanwhile
            error_cb=remember,
            tls=tls,
            **credentials,
            **callbacks,
        )
    )
    try:
        async with asyncio.timeout(timeout_s):
            while not connecting.done():
                # A refused key is not an outage: stop at once instead of retrying until the timeout.
                await asyncio.wait({connecting}, timeout=0.05)
                if not nc.is_connected and errors and is_authorization_error(errors[-1]):
                    await cancel_and_wait([connecting])
                    raise errors[-1]
            await connecting
    except CONNECT_OR_REFUSED as e:
        with contextlib.suppress(*CONNECT_OR_REFUSED):  # closing a half-open client; nothing to lose
            await nc.close()
        last = errors[-1] if errors else e
        if is_authorization_error(last) or is_authorization_error(e):
            who = key.agent_id if key is not None else "(no key)"
            raise Forbidden(
                who,
                "connect to",
                ", ".join(servers),
                "the server requires an enrolled key; an admin enrols it: "
                f"epibus agent add {who} --key {key.public_key if key else 'PUBLIC_KEY'} --project P",
            ) from e
        if not isinstance(e, CONNECT_ERRORS):
            raise
        raise Unavailable(
            "nats", f"cannot connect to {', '.join(servers)}: {type(last).__name__} {last}; is the server running?"
        ) from e
    return nc


def requires_authentication(nc: NatsClient) -> bool:
    """Whether the server this connection reached authenticates its clients (a node manages its streams then)."""
    return bool(nc._server_info.get("auth_required"))
