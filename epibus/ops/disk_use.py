"""What each store of a node's home costs on disk: the bytes its files take (allocated blocks, as `du` counts
them: a preallocated or sparse file costs what it holds), and those bytes per event in the stream."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bus.host.home import SQLITE_SIDE_FILES, outbox_path

EMBED_CACHE_FILE = "embed-cache.db"
OTHER = "other"


@dataclass(frozen=True)
class StoreSize:
    store: str
    path: str
    bytes: int
    files: int

    def per_event(self, events: int) -> float | None:
        """Bytes per event in the stream; None before the first event."""
        return self.bytes / events if events > 0 else None


def store_paths(home: Path, journal_url: str) -> dict[str, list[Path]]:
    """Each store's files and folders under home. A journal on a server (PostgreSQL) has none here."""
    journal = [Path(journal_url.removeprefix("sqlite:///"))] if journal_url.startswith("sqlite:///") else []
    return {
        "journal": [*journal, *_sqlite_side_files(journal)],
        "mirror": [home / "mirror"],
        "nats": [home / "nats"],
        "outbox": [outbox_path(home), *_sqlite_side_files([outbox_path(home)])],
        "embedding cache": [home / EMBED_CACHE_FILE, *_sqlite_side_files([home / EMBED_CACHE_FILE])],
        "models": [home / "models"],
    }


def _sqlite_side_files(paths: list[Path]) -> list[Path]:
    return [path.with_name(path.name + side) for path in paths for side in SQLITE_SIDE_FILES]


def store_sizes(home: Path, journal_url: str) -> list[StoreSize]:
    """Every store's bytes on disk, then what else the home holds (keys, logs, cursors) as `other`. A file
    counts once, for the first store that names it; a symbolic link costs its own bytes, not its target's."""
    counted: set[tuple[int, int]] = set()
    sizes = []
    for store, paths in store_paths(home, journal_url).items():
        total, files = 0, 0
        for path in paths:
            for size in _allocated(path, counted):
                total, files = total + size, files + 1
        where = ", ".join(str(p) for p in paths if p.exists()) or "-"
        sizes.append(StoreSize(store, where, total, files))
    rest = list(_allocated(home, counted))
    sizes.append(StoreSize(OTHER, str(home), sum(rest), len(rest)))
    return sizes


def _allocated(path: Path, counted: set[tuple[int, int]]) -> list[int]:
    """Allocated bytes of path and everything under it (folders too, as `du` counts them), each inode once; a
    file vanishing meanwhile (a store renamed or removed it) counts nothing."""
    found = []
    for entry in _entries(path):
        try:
            stat = os.lstat(entry)
        except FileNotFoundError:
            continue
        if (stat.st_dev, stat.st_ino) not in counted:
            counted.add((stat.st_dev, stat.st_ino))
            found.append(stat.st_blocks * 512)
    return found


def _entries(path: Path) -> Iterator[str]:
    if not os.path.lexists(path):
        return
    yield str(path)
    if path.is_dir() and not path.is_symlink():
        for root, dirs, names in os.walk(path):
            for name in [*dirs, *names]:
                yield os.path.join(root, name)
