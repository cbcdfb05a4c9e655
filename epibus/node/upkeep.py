"""A node's watch over its disk and its stores. Every few seconds it measures the free space under the home, the
stream store and the journal; below the reserve the node holds every agent's publishes (the publish budget's
suspension, epibus/node/budget.py) until space returns. Now and then it checks each store can still be read
(observers.store_checks). Both feed the node's health report, `status`, `/metrics` and the dashboard.

The writers themselves refuse to write below the reserve (bus.host.disk.require_room); this watch is what the
operator sees, and what stops agents filling the stream's disk. (JetStream's `max_file_store` cannot do it: the
streams' byte limits are reserved against it, so it would have to exceed them whatever the disk holds.)"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from bus.errors import Unavailable
from bus.host.disk import MIB, DiskSpace, disk_space, reserve_bytes
from bus.host.server import NatsServer
from observers.journal import Journal
from observers.mirror.store import VectorStore
from observers.store_checks import StoreCheck, check_journal, check_mirror

log = logging.getLogger(__name__)
DISK_EVERY_S = 5.0
CHECK_ENV = "EPIBUS_STORE_CHECK_S"
DEFAULT_CHECK_EVERY_S = 600.0


def check_every_s() -> float:
    raw = os.environ.get(CHECK_ENV, "")
    return float(raw) if raw else DEFAULT_CHECK_EVERY_S


class Upkeep:
    """The disk and store watch of one node. `disk` and `checks` hold the last measurements."""

    def __init__(
        self,
        home: Path,
        journal: Journal,
        *,
        server: NatsServer | None,
        mirror: Callable[[], tuple[VectorStore, int] | None],
        hold_events: Callable[[bool], Awaitable[object]] | None = None,
    ) -> None:
        self.home = home
        self.journal = journal
        self.server = server
        self.mirror = mirror  # the live mirror's store and dimension; None when off (or swapped out right now)
        self.disk: dict[str, DiskSpace] = {}
        self.checks: dict[str, StoreCheck] = {}
        self.hold_events = hold_events  # the broker's hold on agents' events (None: this node runs no broker)
        self.holding = False

    def paths(self) -> dict[str, Path]:
        found = {"home": self.home}
        if self.server is not None:
            found["stream store"] = self.server.store_dir
        if self.journal.file is not None:
            found["journal"] = self.journal.file
        return found

    def measure(self) -> dict[str, DiskSpace]:
        """Free space under each path, one entry per filesystem (the first role that lives on it)."""
        reserve = reserve_bytes()
        seen: dict[str, DiskSpace] = {}
        devices: set[int] = set()
        for role, path in self.paths().items():
            space = disk_space(path, reserve=reserve)
            device = os.stat(space.path).st_dev
            if device not in devices:
                devices.add(device)
                seen[role] = space
        self.disk = seen
        return seen

    def full(self) -> list[DiskSpace]:
        return [space for space in self.disk.values() if space.full]

    async def watch_disk(self) -> None:
        """Measure every DISK_EVERY_S. Until cancelled."""
        while True:
            spaces = await asyncio.to_thread(self.measure)
            for space in spaces.values():
                if space.full:
                    log.warning("disk full: %s has %d MiB free, below the reserve", space.path, space.free_bytes // MIB)
            await self._hold(any(space.full for space in spaces.values()))
            await asyncio.sleep(DISK_EVERY_S)

    async def _hold(self, full: bool) -> None:
        if self.hold_events is None or full == self.holding:
            return
        try:
            await self.hold_events(full)
        except Unavailable as e:  # the broker did not take it: tried again at the next measurement
            log.warning("could not %s agents' events at the broker: %s", "hold" if full else "release", e)
            return
        self.holding = full
        log.warning("agents' events %s: the disk is %s", "held" if full else "taken again", "full" if full else "free")

    async def check_stores(self) -> dict[str, StoreCheck]:
        """Check the journal and (when on) the mirror once; logs what is damaged."""
        checks = {"journal": await check_journal(self.journal)}
        mirror = self.mirror()
        if mirror is not None:
            store, dimension = mirror
            checks["mirror"] = await check_mirror(store, self.journal, dimension=dimension)
        for check in checks.values():
            if check.damaged:
                log.error("%s", check.line())
        self.checks = checks
        return checks

    async def watch_stores(self) -> None:
        """Check the stores at once, then every EPIBUS_STORE_CHECK_S (600 s by default). Until cancelled."""
        while True:
            await self.check_stores()
            await asyncio.sleep(check_every_s())

    def report(self) -> dict[str, object]:
        return {
            "disk": {role: space.as_dict() for role, space in self.disk.items()},
            "stores": {name: vars(check) for name, check in self.checks.items()},
            "holding_events": self.holding,
        }
