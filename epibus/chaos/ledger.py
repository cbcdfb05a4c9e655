"""What the workload tried and what each store holds, and the one rule that compares them: per store, every
acknowledged event must be present exactly once with the content that was published."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Receipt levels that promise the event: a PubAck, or durable in the publisher's outbox.
ACKNOWLEDGED = frozenset({"published", "outboxed"})
SAMPLE = 5


@dataclass(frozen=True)
class Attempt:
    """One publish attempt: the event, its digest (sha256 of the signed event) and the level reached, or the
    error when publish raised."""

    event_id: str
    digest: str
    publisher: str
    project: str
    level: str  # published | outboxed | error
    error: str | None = None
    seq: int | None = None

    @property
    def acknowledged(self) -> bool:
        return self.level in ACKNOWLEDGED


def write_attempts(path: Path, attempts: Iterable[Attempt]) -> None:
    with path.open("w") as out:
        for attempt in attempts:
            out.write(json.dumps(asdict(attempt)) + "\n")


def read_attempts(path: Path) -> list[Attempt]:
    return [Attempt(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class StoreAudit:
    """One store compared with the ledger. `found` maps each event id the store holds to the digest of each
    copy (None: a copy whose content could not be read back as an event)."""

    store: str
    acknowledged: int = 0
    present: int = 0  # acknowledged and present once with the published content
    lost: list[str] = field(default_factory=list)  # acknowledged, absent
    duplicated: list[str] = field(default_factory=list)  # held more than once
    unknown: list[str] = field(default_factory=list)  # not acknowledged, present (allowed)
    wrong: list[str] = field(default_factory=list)  # present with other content, or never published at all
    error: str | None = None  # the store could not be read: nothing about it is known
    note: str | None = None  # how it was read, when that limits what the audit can see

    @property
    def failed(self) -> bool:
        return bool(self.lost or self.duplicated or self.wrong or self.error)

    def as_dict(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "acked": self.acknowledged,
            "present": self.present,
            "lost": len(self.lost),
            "duplicated": len(self.duplicated),
            "unknown": len(self.unknown),
            "wrong": len(self.wrong),
            "error": self.error,
            "note": self.note,
            "ok": not self.failed,
            "sample_lost": self.lost[:SAMPLE],
            "sample_duplicated": self.duplicated[:SAMPLE],
            "sample_wrong": self.wrong[:SAMPLE],
        }


def audit_store(store: str, attempts: Sequence[Attempt], found: Mapping[str, Sequence[str | None]]) -> StoreAudit:
    """Compare what a store holds with what was attempted. The same rule for every store."""
    published = {a.event_id: a for a in attempts}
    audit = StoreAudit(store, acknowledged=sum(1 for a in published.values() if a.acknowledged))
    for event_id, copies in found.items():
        attempt = published.get(event_id)
        if len(copies) > 1:
            audit.duplicated.append(event_id)
        if attempt is None or any(digest != attempt.digest for digest in copies):
            audit.wrong.append(event_id)
        elif not attempt.acknowledged:
            audit.unknown.append(event_id)
        elif len(copies) == 1:
            audit.present += 1
    audit.lost = [a.event_id for a in published.values() if a.acknowledged and a.event_id not in found]
    return audit


def unreadable(store: str, attempts: Sequence[Attempt], error: str) -> StoreAudit:
    """A store that could not be read: counted as failed, with the reason."""
    return StoreAudit(store, acknowledged=sum(1 for a in attempts if a.acknowledged), error=error)
