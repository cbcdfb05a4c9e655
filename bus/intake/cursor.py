"""Where a reader keeps the last stream sequence (or KV revision) it handled, so a restart resumes right after it:
in memory, or in a small file replaced atomically. Shared by the mesh watchers and `EpibusClient.consume`."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from bus.errors import InvalidEvent
from bus.host.home import write_private

MAX_REVISION_DIGITS = 20  # a KV revision or stream sequence is a uint64


class Cursor(Protocol):
    """Where a reader keeps the last sequence (a KV revision is one) it handled."""

    def load(self) -> int:
        """The last handled revision; 0 when nothing was handled yet."""

    def save(self, revision: int) -> None:
        """Durably record a handled revision (called after the handler returned)."""


class MemoryCursor:
    def __init__(self, revision: int = 0) -> None:
        self.revision = revision

    def load(self) -> int:
        return self.revision

    def save(self, revision: int) -> None:
        self.revision = revision


class FileCursor:
    """A cursor in a small file, replaced atomically (write, fsync, rename) so a crash leaves the old or the
    new value, never a torn one."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> int:
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return 0
        # ASCII digits only: str.isdigit() also takes '²', which int() refuses; and no more than int() reads
        if not (text.isascii() and text.isdigit() and len(text) <= MAX_REVISION_DIGITS):
            raise InvalidEvent(f"cursor file {self.path}", f"holds {text[:40]!r}, expected a revision number")
        return int(text)

    def save(self, revision: int) -> None:
        write_private(self.path, f"{revision}\n", durable=True)
