"""A node's running mirror: the embedding model and vector store it opens, the observer and consumer runner that
feed it, and the reindex that rebuilds it from the stream and swaps it in while the node runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from bus.broker.loops import cancel_and_wait, run_together
from bus.broker.nats_errors import NATS_OR_API_ERROR
from bus.errors import ConfigError
from bus.identity.signing import AgentKey
from bus.intake.runner import ConsumerRunner
from bus.subjects import STREAM
from epibus.node.failpoints import UnavailableWhenArmed, observed
from epibus.node.supervise import Loops, supervised
from observers.journal import Journal
from observers.mirror.backends import open_store
from observers.mirror.embed import CachedEmbedder, FastEmbedder
from observers.mirror.fleet_vectors import FleetEmbedder
from observers.mirror.observer import MirrorObserver
from observers.mirror.reindex import Progress, ReindexCounts, rebuild
from observers.mirror.store import VectorStore
from observers.reads import review_policy
from observers.watch.pusher import WatchPusher
from observers.watch.registry import WatchRegistry

log = logging.getLogger(__name__)
MIRROR_BATCH = 64


class NodeMirror:
    """The mirror as it stands: `store`, `observer` and `runner` are replaced together when a reindex swaps a
    rebuilt collection in; the embedder and the watches (`watches` keeps them, `pusher` tells their owners of
    each claim the observer indexes) stay."""

    def __init__(
        self, nc: NatsClient, js: JetStreamContext, journal: Journal, embedder: CachedEmbedder, store: VectorStore,
        observer: MirrorObserver, runner: ConsumerRunner, *, kind: str, home: Path, node: str,
        watches: WatchRegistry, pusher: WatchPusher,
    ) -> None:  # fmt: skip
        self.nc = nc
        self.js = js
        self.journal = journal
        self.embedder = embedder
        self.store = store
        self.observer = observer
        self.runner = runner
        self.kind = kind
        self.home = home
        self.node = node
        self.watches = watches
        self.pusher = pusher
        self._loops: Loops | None = None
        self._task: asyncio.Task[None] | None = None
        self._reindexing = asyncio.Lock()

    def start(self, loops: Loops) -> None:
        """Run the observer and its progress watch in the node's loops (again after each reindex)."""
        if self._loops is None:
            loops.supervise("watches", self.watches.follow)
        self._loops = loops
        self._task = loops.start("mirror", self._run(self.runner))

    @staticmethod
    async def _run(runner: ConsumerRunner) -> None:
        """The mirror's runner and its progress watch, replaced together when a reindex swaps the mirror."""
        await run_together(
            {
                "mirror observer": supervised("mirror observer", runner.run),
                "mirror progress": supervised("mirror progress", runner.watch_progress),
            }
        )

    async def acked_through(self) -> int:
        """The stream sequence the live mirror's consumer has acked every message through."""
        return await self.runner.acked_through()

    async def reindex(self, progress: Progress | None = None) -> ReindexCounts:
        """Rebuild the mirror from the stream into a new collection while the old one keeps answering, swap
        it in, and continue with a new durable consumer right after the rebuilt part."""
        if self._loops is None:
            raise ConfigError("reindex", "the node's mirror is not running yet")
        async with self._reindexing:
            rebuilt = await rebuild(
                self.kind, self.store, self.js, self.embedder, journal=self.journal, home=self.home, node=self.node,
                progress=progress, listener=self.pusher,
            )  # fmt: skip
            old_name = self.observer.name
            if self._task is not None:
                await cancel_and_wait([self._task])
            self.store = await rebuilt.swap()
            self.observer = MirrorObserver(
                self.store, self.embedder, name=rebuilt.consumer_name, journal=self.journal, node=self.node,
                listener=self.pusher,
            )  # fmt: skip
            counted, handled = self.runner.tally, self.runner.stats.handled  # metrics and status keep counting on
            self.runner = ConsumerRunner(
                self.nc, self.observer, batch_size=MIRROR_BATCH, start_seq=rebuilt.last_seq + 1, tally=counted
            )
            self.runner.stats.handled = handled
            self.start(self._loops)
            if old_name and old_name != rebuilt.consumer_name:
                try:
                    await self.js.delete_consumer(STREAM, old_name)
                except NATS_OR_API_ERROR as e:  # the old consumer only wastes server memory; say so
                    log.warning("old mirror consumer %s not deleted: %s", old_name, e)
            return ReindexCounts(rebuilt.points, rebuilt.last_seq, rebuilt.rejected)


async def open_mirror(
    nc: NatsClient, js: JetStreamContext, journal: Journal, stack: contextlib.AsyncExitStack, *, kind: str,
    qdrant_url: str | None, home: Path, node: str, failpoints: bool, key: AgentKey,
    is_node_key: Callable[[str], Awaitable[bool]], replicas: int, closed: Callable[[], bool],
) -> NodeMirror:  # fmt: skip
    """The embedding model loads now: a model that cannot load is a start-up error, not a silent outage. Texts go
    to the local cache first, then to the fleet's shared vectors (signed by `key`; other nodes' vectors taken
    when `is_node_key` vouches for their signer), then to the model."""
    if kind == "edge":
        location: str | Path = home / "mirror"
    elif qdrant_url:
        location = qdrant_url
    else:
        raise ConfigError("mirror", "'server' needs QDRANT_URL (or --qdrant-url)")
    model = await FastEmbedder(home).load()
    stack.callback(model.close)
    embedder = CachedEmbedder(FleetEmbedder(model, lambda: js, key, is_node_key), home / "embed-cache.db")
    stack.callback(embedder.close)
    opened = await open_store(kind, location, embedder.model_id, embedder.dimension)
    store = UnavailableWhenArmed(opened, home) if failpoints else opened
    live: NodeMirror | None = None

    async def close_store() -> None:  # the store live when the node stops: a reindex swaps it in
        await (live.store if live is not None else store).close()

    stack.push_async_callback(close_store)
    info = await store.describe()
    watches = WatchRegistry(lambda: js, embedder, node=node, replicas=replicas, closed=closed)
    pusher = WatchPusher(lambda: js, watches.book, node=node, policy=lambda project: review_policy(journal, project))
    name = f"mirror-{info.store_id[:8]}"
    observer = MirrorObserver(store, embedder, name=name, journal=journal, node=node, listener=pusher)
    runner = ConsumerRunner(nc, observed(observer, home, honour=failpoints), batch_size=MIRROR_BATCH)
    live = NodeMirror(
        nc, js, journal, embedder, store, observer, runner, kind=kind, home=home, node=node, watches=watches,
        pusher=pusher,
    )  # fmt: skip
    return live
