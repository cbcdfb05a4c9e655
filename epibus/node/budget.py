"""Each agent's publish budget on this node's server: messages and bytes per minute, counted by the broker.

NATS has no per-user rate limit, but it counts what every connection sends (`in_msgs`, `in_bytes`) under the
key it authenticated with, which no agent can forge. The node reads those counts from the server's system
account once a second, sums each key's last minute, and an agent over either limit is suspended at the
broker: its permissions lose publishing events and asking nodes (reads go on) until its last minute is
within the budget again. What it sent meanwhile is refused by the broker (its client keeps the events in its
outbox and reports a Forbidden naming the budget), and every suspension is counted and reported."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NatsClient

from bus.broker.nats_errors import JS_TIMEOUT_S, nats_call
from bus.broker.streams import MIB
from bus.errors import ConfigError, Unavailable

log = logging.getLogger(__name__)
POLL_EVERY_S = 0.25  # how soon a flood is seen; the reload that suspends takes ~0.1-0.3 s more
CONNZ_PAGE = 1024
CONNZ_CLOSED = 1  # nats-server's ConnState for closed connections
NAMES_EVERY_POLLS = 8  # the enrolled keys are read again every 2 s (a new agent is judged within 2 s)


@dataclass(frozen=True)
class PublishBudget:
    """What one agent may send to one node's server per window (`epibus up --budget-msgs/--budget-mib`): every
    message counts (events, requests, pulls), as the broker counts them."""

    msgs_per_window: int = 30_000
    bytes_per_window: int = 64 * MIB
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.msgs_per_window < 1 or self.bytes_per_window < 1 or self.window_s <= 0:
            raise ConfigError("publish budget", f"{self}: every limit must be positive")


@dataclass
class AgentUse:
    """One key's use of its budget over the window, as last computed."""

    msgs: int = 0
    bytes: int = 0
    suspended: bool = False
    suspensions: int = 0  # times it went over
    samples: deque[tuple[float, int, int]] = field(default_factory=deque)  # (when, msgs, bytes) per poll


class BudgetWatch:
    """Polls the server's connections (as the system account's user), keeps every agent key's window and
    calls `apply(suspended keys)` whenever the set changes. `agents` are the keys it judges (enrolled agents,
    never the node's own)."""

    def __init__(
        self,
        system: NatsClient,
        budget: PublishBudget,
        *,
        agents: Callable[[], Awaitable[dict[str, str]]],
        apply: Callable[[frozenset[str]], Awaitable[object]],
    ) -> None:
        self.system = system
        self.budget = budget
        self.agents = agents  # public key -> agent id, read each poll (enrolments change)
        self.apply = apply
        self.use: dict[str, AgentUse] = {}
        self.names: dict[str, str] = {}
        self.polls = 0
        self.errors = 0
        self._seen: dict[int, tuple[int, int]] = {}  # connection id -> (in_msgs, in_bytes) at the last poll
        self._closed_counted: set[int] = set()  # closed connections already counted (still in the server's ring)
        self._recent_closed: set[int] = set()
        self._suspended: frozenset[str] = frozenset()

    async def run(self) -> None:
        while True:
            try:
                await self.poll()
            except Unavailable as e:
                self.errors += 1
                log.warning("publish budget: cannot read the server's connections (%s); counting resumes", e)
            await asyncio.sleep(POLL_EVERY_S)

    async def poll(self, now: float | None = None) -> None:
        """One reading: add each connection's growth since the last one to its key's window, then suspend or
        lift. Raises Unavailable."""
        now = time.monotonic() if now is None else now
        connections = await self._connections()
        # Connections that closed since: their last counts too, once each (a connection that opens, floods and
        # closes between two polls is counted all the same).
        closed = [c for c in await self._closed() if int(c.get("cid", 0)) not in self._closed_counted]
        self._closed_counted = {int(c.get("cid", 0)) for c in closed} | self._closed_counted & self._recent_closed
        if self.polls % NAMES_EVERY_POLLS == 0 or not self.names:
            self.names = await self.agents()
        grown: dict[str, tuple[int, int]] = {}
        alive: dict[int, tuple[int, int]] = {}
        for conn in [*connections, *closed]:
            key = conn.get("authorized_user") or conn.get("nkey")
            cid = int(conn.get("cid", 0))
            counts = (int(conn.get("in_msgs", 0)), int(conn.get("in_bytes", 0)))
            alive[cid] = counts
            if key not in self.names:
                continue
            before = self._seen.get(cid, (0, 0))
            msgs, sent = grown.get(key, (0, 0))
            grown[key] = (msgs + max(0, counts[0] - before[0]), sent + max(0, counts[1] - before[1]))
        self._seen = alive
        self.polls += 1
        await self._judge(grown, now)

    async def _judge(self, grown: dict[str, tuple[int, int]], now: float) -> None:
        over: set[str] = set()
        for key in set(self.names) | set(self.use):
            use = self.use.setdefault(key, AgentUse())
            msgs, sent = grown.get(key, (0, 0))
            if msgs or sent:
                use.samples.append((now, msgs, sent))
            while use.samples and use.samples[0][0] <= now - self.budget.window_s:
                use.samples.popleft()
            use.msgs = sum(m for _, m, _ in use.samples)
            use.bytes = sum(b for _, _, b in use.samples)
            if use.msgs > self.budget.msgs_per_window or use.bytes > self.budget.bytes_per_window:
                over.add(key)
        for key in over - self._suspended:
            self.use[key].suspensions += 1
            use = self.use[key]
            log.warning(
                "agent %s is over its publish budget (%d msgs, %d bytes in %.0f s; the budget is %d msgs, %d "
                "bytes): suspended until its last window is within it",
                self.names.get(key, key),
                use.msgs,
                use.bytes,
                self.budget.window_s,
                self.budget.msgs_per_window,
                self.budget.bytes_per_window,
            )
        for key, use in self.use.items():
            use.suspended = key in over
        if frozenset(over) != self._suspended:
            await self.apply(frozenset(over))
            self._suspended = frozenset(over)

    async def _connections(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        offset = 0
        while True:
            data = await self._connz({"auth": True, "offset": offset, "limit": CONNZ_PAGE})
            page = data.get("connections") or []
            found += page
            offset += len(page)
            if not page or offset >= int(data.get("total", 0)):
                return found

    async def _closed(self) -> list[dict[str, Any]]:
        """The newest CONNZ_PAGE closed connections (the server keeps a ring of them), newest first."""
        data = await self._connz({"auth": True, "state": CONNZ_CLOSED, "sort": "stop", "limit": CONNZ_PAGE})
        page: list[dict[str, Any]] = data.get("connections") or []
        self._recent_closed = {int(c.get("cid", 0)) for c in page}
        return page

    async def _connz(self, options: dict[str, Any]) -> dict[str, Any]:
        # This node's own server (the one the system connection reached): each node judges its own clients.
        subject = f"$SYS.REQ.SERVER.{self.system._server_info.get('server_id', 'PING')}.CONNZ"
        async with nats_call("the server's connections ($SYS CONNZ)"):
            reply = await self.system.request(subject, json.dumps(options).encode(), timeout=JS_TIMEOUT_S)
        data: dict[str, Any] = json.loads(reply.data).get("data") or {}
        return data

    def report(self) -> dict[str, Any]:
        """The budget and each agent's use, for health, stats, metrics and the dashboard."""
        return {
            "msgs_per_window": self.budget.msgs_per_window,
            "bytes_per_window": self.budget.bytes_per_window,
            "window_s": self.budget.window_s,
            "agents": {
                self.names.get(key, key): {
                    "msgs": use.msgs,
                    "bytes": use.bytes,
                    "suspended": use.suspended,
                    "suspensions": use.suspensions,
                }
                for key, use in sorted(self.use.items(), key=lambda item: self.names.get(item[0], item[0]))
            },
        }
