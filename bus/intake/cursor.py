"""Where a reader keeps the last stream sequence (or KV revision) it handled, so a restart resumes right after it:
in memory, or in a small file replaced atomically. Shared by the mesh watchers and `EpibusClient.consume`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

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


class LineLog:
    """Lines appended to a JSON-lines file, one write per line, fsynced: the file is both what a reader was told
    and its cursor (the `field` of its last complete line), so a reader killed at any moment and restarted neither
    misses nor repeats a line. A torn last line (a crash mid-write) does not count as told and is written again."""

    def __init__(self, path: Path, field: str, *, what: str) -> None:
        self.path = path
        self.field = field
        self.what = what
        self._position = self._last_position()

    def _last_position(self) -> int:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return 0
        lines = data.split(b"\n")
        complete, torn = lines[:-1], lines[-1]
        if torn:
            with open(self.path, "r+b") as f:  # drop the torn tail so the next line starts clean
                f.truncate(len(data) - len(torn))
        for line in reversed(complete):
            if line.strip():
                try:
                    position = json.loads(line)[self.field]
                except (ValueError, KeyError, TypeError, RecursionError) as e:
                    problem = f"last line is not a {self.what}: {type(e).__name__}: {e}"
                    raise InvalidEvent(f"{self.what} log {self.path}", problem) from e
                if type(position) is not int or position < 0:  # the server refuses a negative start for good
                    shown, field = str(position)[:40], self.field
                    problem = f"last line's {field} is {shown!r}, expected a {field} number (0 or more)"
                    raise InvalidEvent(f"{self.what} log {self.path}", problem)
                return position
        return 0

    def load(self) -> int:
        return self._position

    def save(self, revision: int) -> None:
        # The line written by append_line() already records the position; positions that concern nobody advance
        # only the in-memory cursor, so a restart reads them again and they concern nobody again.
        self._position = max(self._position, revision)

    def append_line(self, line: dict[str, Any], position: int) -> None:
        data = (json.dumps(line, sort_keys=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._position = position
