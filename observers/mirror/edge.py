"""The `edge` vector store: qdrant-edge-py, Qdrant's in-process engine, in a directory under EPIBUS_HOME.

The shard holds no metadata of its own, so `collection.json` beside it records the embedding model id and
dimension; a store opened for another model raises ModelMismatch. All engine calls run on one owned thread."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import qdrant_edge as qe

from bus.errors import ComponentFailed, ModelMismatch, StoreDamaged, Unavailable, error_summary
from bus.host.disk import require_room
from bus.host.home import private_dir, private_tree, write_private
from observers.mirror.store import (
    INDEXED_FLOATS,
    INDEXED_KEYWORDS,
    MIRROR_REMEDY,
    CollectionInfo,
    Filter,
    Hit,
    Point,
    Vector,
    match_value,
    match_values,
    require_dimension,
)

T = TypeVar("T")
# Engine messages that mean its files failed (disk full, too many files, I/O), which may pass.
ENGINE_IO_FAILURE = re.compile(
    r"i/?o error|no space left|too many open files|resource temporarily unavailable|read-only file system", re.I
)
# The engine's words for files that are not what it wrote (cut short, overwritten): rebuild, do not retry.
ENGINE_DAMAGE = re.compile(
    r"out of bounds|not readable|corrupt|checksum|unexpected end of file|failed to (?:deserialize|decode)", re.I
)
META_FILE = "collection.json"
SHARD_DIR = "shard"
NEW_SHARD_DIR = "shard.compacting"  # a compaction writes the live points here, then swaps it in
OLD_SHARD_DIR = "shard.retired"  # the shard being replaced, deleted once the new one is in place
COPY_BATCH = 200  # points per write while compacting: each write stays short


def edge_filter(where: Filter) -> qe.Filter | None:
    must: list[Any] = [
        qe.FieldCondition(key, match=qe.MatchValue(match_value(value))) for key, value in where.equals.items()
    ]
    must += [qe.FieldCondition(key, match=qe.MatchAny(match_values(values))) for key, values in where.any_of.items()]
    must += [qe.FieldCondition(key, range=qe.RangeFloat(lte=float(value))) for key, value in where.at_most.items()]
    must_not: list[Any] = [
        qe.FieldCondition(key, match=qe.MatchAny(match_values(values))) for key, values in where.none_of.items()
    ]
    if not must and not must_not:
        return None
    return qe.Filter(must=must or None, must_not=must_not or None)


class EdgeVectorStore:
    """A VectorStore on qdrant-edge. Use `await EdgeVectorStore.open(path, model_id, dimension)`."""

    def __init__(self, path: Path, model_id: str, dimension: int) -> None:
        self.path = path
        self.model_id = model_id
        self.dimension = dimension
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epibus-edge")
        self._shard: Any = None
        self.store_id = ""

    @classmethod
    async def open(cls, path: Path, model_id: str, dimension: int) -> EdgeVectorStore:
        """Open or create. Raises ModelMismatch if the collection was built for another model or dimension."""
        store = cls(path, model_id, dimension)
        try:
            await store._call(store._open)
        except BaseException:
            await store.close()  # a refused open leaves nothing locked
            raise
        return store

    @property
    def shard(self) -> Any:
        if self._shard is None:
            raise Unavailable("qdrant-edge", f"{self.path}: store is closed")
        return self._shard

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _open(self) -> None:
        private_dir(self.path)
        try:
            self._open_shard()
        finally:
            private_tree(self.path)  # the engine creates its files through the umask (0644 under the usual 022)

    def _open_shard(self) -> None:
        meta_path = self.path / META_FILE
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            if (meta["model_id"], meta["dimension"]) != (self.model_id, self.dimension):
                raise ModelMismatch(
                    f"{meta['model_id']} ({meta['dimension']}-d)", f"{self.model_id} ({self.dimension}-d)"
                )
            self.store_id = str(meta["store_id"])
            self._finish_compaction()
            self._shard = self._engine(qe.EdgeShard.load, str(self.path / SHARD_DIR))
            return
        self._shard = self._create_shard(self.path / SHARD_DIR)
        self.store_id = str(uuid.uuid4())
        write_private(
            meta_path, json.dumps({"model_id": self.model_id, "dimension": self.dimension, "store_id": self.store_id})
        )

    def _create_shard(self, path: Path) -> Any:
        config = qe.EdgeConfig(
            vectors=qe.EdgeVectorParams(size=self.dimension, distance=qe.Distance.Cosine),
            # indexing_threshold is in KB of vectors: HNSW is built by optimize() once a segment outgrows it.
            optimizers=qe.EdgeOptimizersConfig(indexing_threshold=20_000),
            hnsw_config=qe.HnswIndexConfig(m=16, ef_construct=100, full_scan_threshold=10_000),
        )
        shard = self._engine(qe.EdgeShard.create, str(path), config)
        for key in INDEXED_KEYWORDS:
            self._engine(shard.update, qe.UpdateOperation.create_field_index(key, qe.PayloadSchemaType.Keyword))
        for key in INDEXED_FLOATS:
            self._engine(shard.update, qe.UpdateOperation.create_field_index(key, qe.PayloadSchemaType.Float))
        return shard

    def _engine(self, fn: Any, *args: Any) -> Any:
        """The one choke point: the engine raises bare Exception subclasses for every failure. Only the
        files failing is an outage; any other failure would recur with the same request."""
        try:
            return fn(*args)
        except OSError as e:
            raise Unavailable("qdrant-edge", f"{self.path}: {e}") from e
        except Exception as e:
            message = str(e)
            if "dimension error" in message.lower():
                raise ModelMismatch(f"{self.model_id} ({self.dimension}-d)", message) from e
            if ENGINE_IO_FAILURE.search(message):
                raise Unavailable("qdrant-edge", f"{self.path}: {message}") from e
            if ENGINE_DAMAGE.search(message):
                raise StoreDamaged("mirror", str(self.path), " ".join(message.split())[:300], MIRROR_REMEDY) from e
            raise ComponentFailed("qdrant-edge", f"{self.path}: {error_summary(e)}") from e

    def _write(self, fn: Any, *args: Any) -> Any:
        """An engine call that may create files (segments, index pages, WAL), which are then made owner-only.
        Never below the disk reserve: the engine writes through mmap, and a page the disk cannot back is SIGBUS."""
        require_room(self.path, "mirror")
        try:
            return self._engine(fn, *args)
        finally:
            private_tree(self.path)

    async def upsert(self, points: Sequence[Point]) -> None:
        if not points:
            return
        require_dimension(self.model_id, self.dimension, [p.vector for p in points])
        batch = [
            qe.Point(str(p.id), list(p.vector), {**p.payload, "model_id": self.model_id, "dimension": self.dimension})
            for p in points
        ]
        await self._call(self._write, self.shard.update, qe.UpdateOperation.upsert_points(batch))

    async def delete(self, ids: Sequence[uuid.UUID]) -> None:
        if ids:
            await self._call(self._write, self.shard.update, qe.UpdateOperation.delete_points([str(i) for i in ids]))

    async def retrieve(self, ids: Sequence[uuid.UUID]) -> list[Point]:
        if not ids:
            return []
        records = await self._call(self._engine, self.shard.retrieve, [str(i) for i in ids], True, True)
        return [Point(uuid.UUID(str(r.id)), list(r.vector), dict(r.payload)) for r in records]

    async def search(self, vector: Vector, where: Filter, *, limit: int) -> list[Hit]:
        require_dimension(self.model_id, self.dimension, [vector])
        request = qe.QueryRequest(
            query=qe.Query.Nearest(list(vector)), filter=edge_filter(where), limit=limit, with_payload=True
        )
        found = await self._call(self._engine, self.shard.query, request)
        return [Hit(uuid.UUID(str(r.id)), float(r.score), dict(r.payload)) for r in found]

    async def set_payload(self, where: Filter, payload: Mapping[str, Any]) -> None:
        flt = edge_filter(where)
        if flt is None:
            raise ValueError("set_payload needs a filter; refusing to rewrite every point")
        await self._call(self._write, self.shard.update, qe.UpdateOperation.set_payload_by_filter(flt, dict(payload)))

    async def describe(self) -> CollectionInfo:
        count = await self._call(self._engine, self.shard.count, qe.CountRequest(exact=True))
        return CollectionInfo(self.model_id, self.dimension, int(count), self.store_id)

    async def point_ids(self, where: Filter | None = None) -> list[uuid.UUID]:
        """Every point id (matching `where`), for reconciliation."""
        return list(await self._call(self._scroll_ids, where))

    def _scroll_ids(self, where: Filter | None) -> list[uuid.UUID]:
        found: list[uuid.UUID] = []
        offset = None
        flt = edge_filter(where) if where is not None else None
        while True:
            request = qe.ScrollRequest(offset=offset, limit=1024, filter=flt, with_payload=False, with_vector=False)
            records, offset = self._engine(self.shard.scroll, request)
            found += [uuid.UUID(str(r.id)) for r in records]
            if offset is None:
                return found

    async def optimize(self) -> bool:
        """Build HNSW over grown segments. Holds the GIL for seconds on large collections: call it off the
        hot path (reindex, a quiet moment), not per batch."""
        return bool(await self._call(self._write, self.shard.optimize))

    async def compact(self) -> int:
        """Rewrite the shard with only its live points and delete the old files, so a deleted point leaves
        no bytes behind: qdrant-edge keeps a deleted point's payload and vector in its segment pages and its
        write-ahead log (a preallocated file that is not rewritten), and neither flush() nor optimize()
        removes them. Costs a copy of every point; meant for forget, not for every delete. Returns the
        number of points kept. Raises Unavailable; an interrupted compaction is finished or undone on open."""
        return int(await self._call(self._compact))

    def _compact(self) -> int:
        fresh = self.path / NEW_SHARD_DIR
        if fresh.exists():
            shutil.rmtree(fresh)  # a compaction that never swapped in: its copy is incomplete
        target = self._create_shard(fresh)
        kept = 0
        offset = None
        while True:
            request = qe.ScrollRequest(offset=offset, limit=COPY_BATCH, with_payload=True, with_vector=True)
            records, offset = self._engine(self.shard.scroll, request)
            batch = [qe.Point(r.id, list(r.vector), dict(r.payload)) for r in records]
            if batch:
                self._engine(target.update, qe.UpdateOperation.upsert_points(batch))
                kept += len(batch)
            if offset is None:
                break
        self._engine(target.flush)
        self._engine(target.close)
        self._engine(self.shard.close)
        self._shard = None
        (self.path / SHARD_DIR).rename(self.path / OLD_SHARD_DIR)
        fresh.rename(self.path / SHARD_DIR)
        self._finish_compaction()
        self._shard = self._write(qe.EdgeShard.load, str(self.path / SHARD_DIR))
        return kept

    def _finish_compaction(self) -> None:
        """After a crash mid-compaction: a retired shard with no live one goes back in place; a retired
        shard beside a live one is deleted."""
        live, old = self.path / SHARD_DIR, self.path / OLD_SHARD_DIR
        if old.exists() and not live.exists():
            old.rename(live)
        elif old.exists():
            shutil.rmtree(old)

    async def close(self) -> None:
        if self._shard is not None:
            await self._call(self._engine, self._shard.flush)
            await self._call(self._write, self._shard.close)  # closing rewrites segment files
            self._shard = None
        self._executor.shutdown(wait=True)
