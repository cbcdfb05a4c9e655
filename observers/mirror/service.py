"""The mirror's request services: recall, the indexed lookup and reindex, each answered from the node's mirror
as it stands when the request arrives (a reindex swaps its store and its consumer)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from bus.enrolment.service_rules import enrolled_rule, recall_rule, reindex_rule
from bus.errors import ConfigError
from bus.model.requests import (
    IndexedReply,
    LookupRequest,
    RecallHitReply,
    RecallReply,
    RecallRequest,
    ReindexProgress,
    ReindexReply,
    ReindexRequest,
)
from bus.services.responder import Service
from bus.subjects import MIRROR_LOOKUP, RECALL, REINDEX
from observers.journal import Journal
from observers.mirror.embed import Embedder
from observers.mirror.lookup import indexed_events
from observers.mirror.reindex import Progress, ReindexCounts
from observers.mirror.store import VectorStore
from observers.reads import review_policy
from observers.recall import audit_recall, recall

Publish = Callable[[str, bytes], Awaitable[None]]


class LiveMirror(Protocol):
    """A node's running mirror: its current store, embedder and consumer's ack floor, and its rebuild."""

    @property
    def store(self) -> VectorStore: ...

    @property
    def embedder(self) -> Embedder: ...

    async def acked_through(self) -> int: ...

    async def reindex(self, progress: Progress | None = None) -> ReindexCounts: ...


class MirrorServices:
    """What a node answers about its mirror. `mirror` None: the node runs none (started with --mirror off); it
    then answers the indexed lookup with `mirror: false`, refuses reindex and serves no recall."""

    def __init__(
        self,
        mirror: LiveMirror | None,
        journal: Journal,
        *,
        node: str,
        publish: Publish,
        after_reindex: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.mirror = mirror
        self.after_reindex = after_reindex  # the node checks its stores again
        self.journal = journal
        self.node = node
        self.publish = publish  # sends a reindex's progress to the asker's inbox
        self.recalls = 0
        self.recall_seconds: dict[str, float] = {}  # embed, search, total: where recalls spend their time

    def services(self) -> list[Service[Any]]:
        served: list[Service[Any]] = [
            Service(REINDEX, ReindexRequest, ReindexReply, self.reindex, reindex_rule),
            Service(MIRROR_LOOKUP, LookupRequest, IndexedReply, self.indexed, enrolled_rule),
        ]
        if self.mirror is not None:
            served.append(Service(RECALL, RecallRequest, RecallReply, self.recall, recall_rule))
        return served

    async def recall(self, request: RecallRequest) -> RecallReply:
        """Answer a recall request from this node's mirror."""
        mirror = self._require_mirror("recall")
        started = time.perf_counter()
        if request.audit:
            result = await audit_recall(
                mirror.store, mirror.embedder, request.query, request.project, k=request.k, kinds=request.kinds,
                timings=self.recall_seconds,
            )  # fmt: skip
        else:
            result = await recall(
                mirror.store,
                mirror.embedder,
                request.query,
                request.project,
                k=request.k,
                kinds=request.kinds,
                include_resolved=request.include_resolved,
                as_of=request.as_of,
                journal=self.journal,
                timings=self.recall_seconds,
                policy=await asyncio.to_thread(review_policy, self.journal, request.project),
            )
        hits = [RecallHitReply.model_validate(h.as_dict(), strict=False) for h in result.hits]
        self.recalls += 1
        self.recall_seconds["total"] = self.recall_seconds.get("total", 0.0) + time.perf_counter() - started
        return RecallReply(node=self.node, hits=hits)

    async def indexed(self, request: LookupRequest) -> IndexedReply:
        """Which of these events this node's mirror has indexed; a node without a mirror says so."""
        if self.mirror is None:
            return IndexedReply(node=self.node, mirror=False, indexed=[])
        found = await indexed_events(self.mirror.store, self.journal, self.mirror.acked_through, request.root)
        return IndexedReply(node=self.node, mirror=True, indexed=found)

    async def reindex(self, request: ReindexRequest) -> ReindexReply:
        """Rebuild the mirror, telling the asker's progress inbox (when it gave one) how far it got."""
        mirror = self._require_mirror("reindex")

        async def progress(done: int, total: int) -> None:
            if request.progress:
                update = ReindexProgress(node=self.node, done=done, total=total)
                await self.publish(request.progress, update.model_dump_json().encode())

        counts = await mirror.reindex(progress)
        if self.after_reindex is not None:
            await self.after_reindex()
        return ReindexReply(node=self.node, points=counts.points, last_seq=counts.last_seq, rejected=counts.rejected)

    def _require_mirror(self, field: str) -> LiveMirror:
        if self.mirror is None:
            raise ConfigError(field, "this node runs no mirror (started with --mirror off)")
        return self.mirror
