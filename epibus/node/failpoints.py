"""Failpoints: faults `epibus chaos` arms inside a running node, for the failures no signal can make (an
observer killed half-way through a batch, a mirror store that stops answering). A node honours them only when
started with `epibus up --failpoints`; a failpoint is armed by a file in `<home>/failpoints/`, which only the
home's owner can write (the home is 0700)."""

from __future__ import annotations

import logging
import os
import signal
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bus.errors import ConfigError, Unavailable
from bus.host.home import private_dir
from bus.intake.admission import Delivery, Refusal
from bus.intake.runner import Observer
from observers.mirror.store import CollectionInfo, Filter, Hit, Point, Vector, VectorStore

log = logging.getLogger(__name__)
FAILPOINTS_DIR = "failpoints"
# name -> what arming it does (`epibus chaos` arms them; the help is shown in its docs)
FAILPOINTS: dict[str, str] = {
    "observer-kill": "the next observer batch writes its first half, then the node is killed (SIGKILL), unacked",
    "mirror-unavailable": "the mirror's vector store answers every call with Unavailable until disarmed",
}


def _path(home: Path, name: str) -> Path:
    if name not in FAILPOINTS:
        raise ConfigError("failpoint", f"{name!r} is unknown", allowed=sorted(FAILPOINTS))
    return home / FAILPOINTS_DIR / name


def arm(home: Path, name: str) -> None:
    """Arm a failpoint of the node under home (it must run with --failpoints). Idempotent."""
    private_dir(home / FAILPOINTS_DIR)
    _hit_path(home, name).unlink(missing_ok=True)
    _path(home, name).touch(mode=0o600)


def _hit_path(home: Path, name: str) -> Path:
    return _path(home, name).with_suffix(".hit")


def was_hit(home: Path, name: str) -> bool:
    """Whether an armed failpoint has fired since it was armed (a node refused a call because of it)."""
    return _hit_path(home, name).exists()


def _fire(home: Path, name: str, what: str) -> None:
    """Record (and log, once per arming) that an armed failpoint made a call fail."""
    marker = _hit_path(home, name)
    if not marker.exists():
        marker.touch(mode=0o600)
        log.error("failpoint %s is armed: %s", name, what)


def disarm(home: Path, name: str) -> None:
    """Disarm it; disarming one that is not armed is not an error."""
    _path(home, name).unlink(missing_ok=True)


def armed(home: Path, name: str) -> bool:
    return _path(home, name).exists()


def take(home: Path, name: str) -> bool:
    """Disarm and say whether it was armed: a one-shot failpoint fires once per arming."""
    try:
        _path(home, name).unlink()
    except FileNotFoundError:
        return False
    return True


def observed(observer: Observer, home: Path, *, honour: bool) -> Observer:
    """What a runner feeds: the observer, wrapped by the observer-kill failpoint when the node honours them."""
    return KilledMidBatch(observer, home) if honour else observer


class KilledMidBatch:
    """An observer whose next batch after `observer-kill` is armed is half written, then the node dies: the
    runner never acks it, so JetStream redelivers the whole batch to the restarted node."""

    def __init__(self, inner: Observer, home: Path) -> None:
        self.inner = inner
        self.home = home
        self.name = inner.name

    async def handle(self, batch: Sequence[Delivery]) -> Sequence[Refusal] | None:
        if len(batch) >= 2 and take(self.home, "observer-kill"):
            await self.inner.handle(batch[: len(batch) // 2])
            log.error("failpoint observer-kill: %s wrote %d of %d events; killing the node", self.name,
                      len(batch) // 2, len(batch))  # fmt: skip
            os.kill(os.getpid(), signal.SIGKILL)
        return await self.inner.handle(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class UnavailableWhenArmed:
    """A vector store that raises Unavailable on every call while `mirror-unavailable` is armed, as a store
    that stopped answering does."""

    def __init__(self, inner: VectorStore, home: Path) -> None:
        self.inner = inner
        self.home = home

    def _check(self) -> None:
        if armed(self.home, "mirror-unavailable"):
            _fire(self.home, "mirror-unavailable", "the mirror's store refuses every call until it is disarmed")
            raise Unavailable("mirror", "failpoint mirror-unavailable is armed; `epibus chaos` disarms it")

    async def upsert(self, points: Sequence[Point]) -> None:
        self._check()
        await self.inner.upsert(points)

    async def delete(self, ids: Sequence[uuid.UUID]) -> None:
        self._check()
        await self.inner.delete(ids)

    async def retrieve(self, ids: Sequence[uuid.UUID]) -> list[Point]:
        self._check()
        return await self.inner.retrieve(ids)

    async def search(self, vector: Vector, where: Filter, *, limit: int) -> list[Hit]:
        self._check()
        return await self.inner.search(vector, where, limit=limit)

    async def set_payload(self, where: Filter, payload: Mapping[str, Any]) -> None:
        self._check()
        await self.inner.set_payload(where, payload)

    async def describe(self) -> CollectionInfo:
        self._check()
        return await self.inner.describe()

    async def point_ids(self, where: Filter | None = None) -> list[uuid.UUID]:
        self._check()
        return await self.inner.point_ids(where)

    async def close(self) -> None:
        await self.inner.close()  # closing is never refused: the node must be able to stop

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
