"""Free disk space, checked before a store writes. qdrant-edge writes its files through mmap, and a page the
filesystem cannot back kills the process with SIGBUS (no exception reaches Python); SQLite and nats-server fail
with ENOSPC part-way through. So every writer asks first: below the reserve it does not write, and its caller
treats that as an outage (an observer holds its events, degraded, and resumes by itself once space returns;
a publish is refused in one line naming the path, the free bytes and what to do).

One function decides, `require_room`; one setting sizes the reserve, `EPIBUS_DISK_RESERVE_MB`."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from bus.errors import ConfigError, DiskFull

RESERVE_ENV = "EPIBUS_DISK_RESERVE_MB"
# Above what one write batch of any store takes at once: qdrant-edge grows its payload pages 32 MiB at a time.
DEFAULT_RESERVE_MB = 256
MIB = 1024 * 1024


def reserve_bytes() -> int:
    """The free space every store keeps unwritten, from EPIBUS_DISK_RESERVE_MB (0 turns the check off)."""
    raw = os.environ.get(RESERVE_ENV)
    if raw is None or raw == "":
        return DEFAULT_RESERVE_MB * MIB
    try:
        megabytes = int(raw)
    except ValueError:
        raise ConfigError(RESERVE_ENV, f"{raw!r} is not a whole number of megabytes (e.g. 256)") from None
    if megabytes < 0:
        raise ConfigError(RESERVE_ENV, f"{megabytes} must be 0 (no check) or more megabytes")
    return megabytes * MIB


@dataclass(frozen=True)
class DiskSpace:
    path: str  # the directory measured (the nearest existing one)
    free_bytes: int  # available to this user (statvfs f_bavail)
    total_bytes: int
    reserve_bytes: int

    @property
    def full(self) -> bool:
        return self.free_bytes < self.reserve_bytes

    def as_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "free_bytes": self.free_bytes,
            "total_bytes": self.total_bytes,
            "reserve_bytes": self.reserve_bytes,
            "full": self.full,
        }


def disk_space(path: Path, *, reserve: int | None = None) -> DiskSpace:
    """The space left on the filesystem holding `path` (or its nearest existing parent)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    stats = os.statvfs(existing)
    return DiskSpace(
        path=str(existing),
        free_bytes=stats.f_bavail * stats.f_frsize,
        total_bytes=stats.f_blocks * stats.f_frsize,
        reserve_bytes=reserve_bytes() if reserve is None else reserve,
    )


def require_room(path: Path, writer: str, *, reserve: int | None = None) -> None:
    """Raise DiskFull (an Unavailable) when the filesystem holding `path` has less free space than the reserve.
    Called before each write batch: a statvfs, a few microseconds."""
    space = disk_space(path, reserve=reserve)
    if space.full:
        raise DiskFull(writer, space.path, space.free_bytes, space.reserve_bytes)


def is_disk_full(error: BaseException) -> bool:
    """An OSError (or a driver error wrapping one) that says the disk or a quota is full."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error).lower()
    return "no space left on device" in text or "database or disk is full" in text
