"""Rebuilding a mirror from the stream into a new collection while the live one keeps answering, then swapping
it in: a directory swap for qdrant-edge, an alias swap for a Qdrant server (after a model change,
or to start clean). The caller pauses its mirror consumer around `swap()` and continues after `last_seq`."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext

from bus.errors import ConfigError
from bus.intake.reader import replay
from observers.mirror.embed import Embedder
from observers.mirror.listener import MirrorListener
from observers.mirror.observer import KeptEvents, MirrorObserver
from observers.mirror.store import VectorStore

HNSW_AT_POINTS = 10_000  # below this, exact search on qdrant-edge answers in about a millisecond
Progress = Callable[[int, int], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class ReindexCounts:
    """What a reindex did: points in the rebuilt collection, the stream sequence it reached, events refused."""

    points: int
    last_seq: int
    rejected: int


@dataclass
class Rebuilt:
    consumer_name: str  # the durable consumer the rebuilt collection continues with
    last_seq: int
    points: int
    rejected: int
    swap: Callable[[], Awaitable[VectorStore]]  # makes the rebuilt collection live; returns the store to use


async def _replay_into(
    js: JetStreamContext,
    store: VectorStore,
    embedder: Embedder,
    journal: KeptEvents,
    node: str,
    progress: Progress | None,
    listener: MirrorListener | None,
) -> tuple[str, int, int, int]:
    name = f"mirror-{(await store.describe()).store_id[:8]}"
    # The listener too: claims the rebuild takes that the live observer had not reached are matched here (the
    # others' notices are duplicates the notices' stream drops, or older than the notice window: none).
    rebuilder = MirrorObserver(store, embedder, name=name, journal=journal, node=node, listener=listener)
    async with asyncio.TaskGroup() as updates:  # progress goes out while the replay runs, and is all sent by the end

        def report(done: int, total: int) -> None:
            if progress is not None:
                updates.create_task(progress(done, total))

        replayed = await replay(js, rebuilder, progress=report)
    return name, replayed.last_seq, (await store.describe()).count, len(replayed.rejected)


async def rebuild(
    kind: str,
    live: VectorStore,
    js: JetStreamContext,
    embedder: Embedder,
    *,
    journal: KeptEvents,
    home: Path,
    node: str,
    progress: Progress | None = None,
    listener: MirrorListener | None = None,
) -> Rebuilt:
    """Replay the whole stream into a fresh collection, through the same admission, observer and listener as
    live."""
    if kind == "edge":
        return await _rebuild_edge(live, js, embedder, journal, home, node, progress, listener)
    if kind == "server":
        return await _rebuild_server(live, js, embedder, journal, node, progress, listener)
    raise ConfigError("reindex", f"mirror {kind!r} cannot be rebuilt", allowed=["edge", "server"])


async def _rebuild_edge(
    live: VectorStore,
    js: JetStreamContext,
    embedder: Embedder,
    journal: KeptEvents,
    home: Path,
    node: str,
    progress: Progress | None,
    listener: MirrorListener | None,
) -> Rebuilt:
    from observers.mirror.edge_process import EdgeProcessVectorStore

    fresh_path, live_path = home / "mirror.new", home / "mirror"
    if fresh_path.exists():
        shutil.rmtree(fresh_path)  # a rebuild that was interrupted: start it again
    fresh = await EdgeProcessVectorStore.open(fresh_path, embedder.model_id, embedder.dimension)
    name, last_seq, points, rejected = await _replay_into(js, fresh, embedder, journal, node, progress, listener)
    if points >= HNSW_AT_POINTS:
        await fresh.optimize()  # the engine process seals what is waiting, so the swapped-in store starts sealed
    await fresh.close()

    async def swap() -> VectorStore:
        await live.close()
        backup = home / f"mirror.old-{datetime.now(UTC):%Y%m%dT%H%M%S}"
        live_path.rename(backup)
        fresh_path.rename(live_path)
        store = await EdgeProcessVectorStore.open(live_path, embedder.model_id, embedder.dimension)
        await asyncio.to_thread(shutil.rmtree, backup)
        return store

    return Rebuilt(name, last_seq, points, rejected, swap)


async def _rebuild_server(
    live: VectorStore,
    js: JetStreamContext,
    embedder: Embedder,
    journal: KeptEvents,
    node: str,
    progress: Progress | None,
    listener: MirrorListener | None,
) -> Rebuilt:
    from observers.mirror.server import ServerVectorStore

    if not isinstance(live, ServerVectorStore):
        raise ConfigError("reindex", "the live mirror is not a Qdrant server collection")
    fresh = await live.sibling()
    name, last_seq, points, rejected = await _replay_into(js, fresh, embedder, journal, node, progress, listener)

    async def swap() -> VectorStore:
        await live.swap_in(fresh)  # one alias operation: readers see the old or the new, never neither
        await fresh.close()
        return live

    return Rebuilt(name, last_seq, points, rejected, swap)
