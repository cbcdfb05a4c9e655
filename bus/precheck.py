"""What a client checks before it publishes claims: the flags known before publishing (unearned confidence, a
repeat of a tombstoned claim), and, with strict, refusing a repeat or an unchecked project."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from bus.errors import InvalidEvent, Unavailable
from bus.event import Envelope
from bus.state import claim_flags
from bus.tombstones import FLAG_PREVIOUSLY_RETRACTED, TombstoneRegistry

log = logging.getLogger(__name__)


async def prepublish_flags(
    registry: TombstoneRegistry | None, events: Sequence[Envelope], *, strict: bool, timeout_s: float
) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """Flags of the claims among `events` before they are published, and the projects whose tombstones
    could not be checked (registry None: not connected). Strict refuses a repeat of a retracted claim
    (InvalidEvent) and an unchecked project (Unavailable)."""
    claims = [e for e in events if not e.body.transition and not e.body.system_record]
    tombstoned: dict[str, set[str]] = {}
    unchecked: list[str] = []
    for project in sorted({e.project for e in claims}):
        try:
            if registry is None:
                raise Unavailable("nats", "not connected")
            tombstoned[project] = await registry.hashes(project, timeout_s=timeout_s)
        except Unavailable as e:
            if strict:
                raise Unavailable("nats", f"tombstones cannot be checked ({e.cause}); retry, or drop strict") from e
            # Publishing must not wait on the check: the journal's projection flags the claim anyway.
            unchecked.append(project)
            log.warning("tombstones of %s not checked before publishing: %s", project, e)
    flags: dict[str, tuple[str, ...]] = {}
    for event in claims:
        found = claim_flags(event, tombstoned.get(event.project, set()).__contains__)
        if strict and FLAG_PREVIOUSLY_RETRACTED in found:
            raise InvalidEvent(
                f"event {event.event_id}",
                "repeats a claim that was retracted or rolled back in this project; "
                "publish without strict to record it anyway (flagged previously_retracted)",
            )
        if found:
            flags[str(event.event_id)] = tuple(sorted(found))
    return flags, unchecked
