"""Which events a node's mirror has indexed: what a publisher waiting for the `indexed` receipt asks.

An event is indexed once the mirror has applied it: a claim's point is in the store (recall finds it from
then on), or the mirror's consumer has acknowledged the event (a transition carried into its artifact's
points, or an event the rules refused, which the `journaled` receipt reports with the reason)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence

from bus.model.ids import point_id
from observers.mirror.observer import KeptEvents
from observers.mirror.store import VectorStore


async def indexed_events(
    store: VectorStore,
    journal: KeptEvents,
    acked_through: Callable[[], Awaitable[int]],
    event_ids: Sequence[str],
) -> list[str]:
    """The ids among `event_ids` the mirror has indexed, sorted. Raises Unavailable when the store, the journal
    or the server does not answer."""
    wanted = {str(uuid.UUID(e)): e for e in event_ids}  # the request model admits UUIDs only
    by_point = {point_id(uuid.UUID(e)): e for e in wanted}
    found = {by_point[p.id] for p in await store.retrieve(list(by_point))}
    rest = [e for e in wanted if e not in found]
    if rest:
        kept = await asyncio.to_thread(journal.kept_events, rest)
        if kept:
            floor = await acked_through()
            found |= {e for e, k in kept.items() if k.stream_seq <= floor}
    return sorted(wanted[e] for e in found)
