"""What a reader of the mesh bucket has already verified: the newest trusted revision of each task it read, and
the roster changes its steps were judged against. A task's next revision repeats every earlier step, so only
the steps it adds need checking (mesh.trust.verify_task with `verified`); a revision read again (a sweep, a
listing) needs none while the roster it was judged by is unchanged.

Bounded: the least recently used tasks are forgotten first (a forgotten task is verified in full again)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from mesh.task import Roster, RosterChange, TaskRecord

MAX_VERIFIED_TASKS = 4096


@dataclass(frozen=True)
class Verified:
    """A task revision that passed mesh.trust.verify_task, its bytes, and the roster changes it used."""

    revision: int
    data: bytes
    record: TaskRecord
    roster_changes: tuple[RosterChange, ...]  # the roster's first max(step.roster_version) changes

    def judged_by(self, roster: Roster) -> bool:
        """Whether `roster` begins with the changes this revision was judged against."""
        used = len(self.roster_changes)
        return roster.changes[:used] == self.roster_changes


def roster_used(record: TaskRecord, roster: Roster) -> tuple[RosterChange, ...]:
    """The changes of `roster` that the record's steps were judged against."""
    return roster.changes[: max(step.roster_version for step in record.steps)]


class VerifiedTasks:
    """key -> the newest verified revision of that task seen by this reader."""

    def __init__(self, limit: int = MAX_VERIFIED_TASKS) -> None:
        self.limit = limit
        self._tasks: OrderedDict[str, Verified] = OrderedDict()

    def get(self, key: str) -> Verified | None:
        found = self._tasks.get(key)
        if found is not None:
            self._tasks.move_to_end(key)
        return found

    def add(self, key: str, verified: Verified) -> None:
        """Remember a verified revision unless a newer one of the task is known already."""
        known = self._tasks.get(key)
        if known is not None and known.revision > verified.revision:
            return
        self._tasks[key] = verified
        self._tasks.move_to_end(key)
        while len(self._tasks) > self.limit:
            self._tasks.popitem(last=False)

    def forget(self, key: str) -> None:
        self._tasks.pop(key, None)

    def __len__(self) -> int:
        return len(self._tasks)
