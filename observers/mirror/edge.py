"""The `edge` vector store: qdrant-edge-py, Qdrant's in-process engine, in a directory under EPIBUS_HOME.

The shards hold no metadata of their own, so `collection.json` beside them records the embedding model id and
dimension; a store opened for another model raises ModelMismatch. Points go to a small hot shard; a full one is
sealed in a worker process (observers.mirror.shards, .seal), so the node never builds an index itself and its
RAM does not grow with the mirror. All engine calls run on one owned thread."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import qdrant_edge as qe

from bus.errors import ComponentFailed, ModelMismatch, StoreDamaged, Unavailable, error_summary
from bus.host.disk import require_room
from bus.host.home import private_dir, private_tree, write_private
from bus.host.server_guard import SPAWNER, die_with_parent
from observers.mirror.seal import LAYOUT
from observers.mirror.shards import Export, ShardSet
from observers.mirror.store import (
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
log = logging.getLogger(__name__)
# Points a hot shard takes before it is sealed: searched exactly, ~2 KB of RAM each while hot.
SEAL_POINTS = int(os.environ.get("EPIBUS_MIRROR_SEAL_POINTS", "20000"))
SEAL_RETRY_S = 30.0  # after a worker failed, the next seal waits this long (the hot shards keep serving)
# Frozen shards (full, waiting for their seal, their vectors in RAM) at which a writer waits for the seals: a
# writer faster than sealing (a node catching up on shared vectors) would otherwise fill the RAM with them.
MAX_FROZEN = 2
# Engine messages that mean its files failed (disk full, too many files, I/O), which may pass.
ENGINE_IO_FAILURE = re.compile(
    r"i/?o error|no space left|too many open files|resource temporarily unavailable|read-only file system", re.I
)
# The engine's words for files that are not what it wrote (cut short, overwritten): rebuild, do not retry.
ENGINE_DAMAGE = re.compile(
    r"out of bounds|not readable|corrupt|checksum|unexpected end of file|failed to (?:deserialize|decode)", re.I
)
META_FILE = "collection.json"


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


@dataclass
class SealStats:
    """How the sealing of full hot shards goes: for health, metrics and the benchmark."""

    sealed: int = 0
    failures: int = 0
    last_error: str | None = None
    last_build_s: float | None = None
    replayed_writes: int = 0
    writes_held_s: float = 0.0  # time writers waited for the seals to catch up (MAX_FROZEN)


class EdgeVectorStore:
    """A VectorStore on qdrant-edge. Use `await EdgeVectorStore.open(path, model_id, dimension)`."""

    def __init__(
        self, path: Path, model_id: str, dimension: int, *, seal_points: int = SEAL_POINTS, layout: int = LAYOUT
    ) -> None:
        self.path = path
        self.model_id = model_id
        self.dimension = dimension
        self.seal_points = seal_points
        self.layout = layout  # what seals build (observers.mirror.seal.LAYOUT; another only in tests)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epibus-edge")
        self._shards: ShardSet | None = None
        self.store_id = ""
        self.seals = SealStats()
        self._sealing: asyncio.Task[None] | None = None
        self._rebuilding = asyncio.Lock()  # one export at a time: a seal, or a compaction's rebuild
        self._next_seal_at = 0.0

    @classmethod
    async def open(
        cls, path: Path, model_id: str, dimension: int, *, seal_points: int = SEAL_POINTS, layout: int = LAYOUT
    ) -> EdgeVectorStore:
        """Open or create. Raises ModelMismatch if the collection was built for another model or dimension.
        Shards frozen when the store last closed are sealed again, in the background, and sealed shards of an
        older layout are rebuilt in the layout of now (said in the log and in `shard_states`)."""
        store = cls(path, model_id, dimension, seal_points=seal_points, layout=layout)
        try:
            await store._call(store._open)
        except BaseException:
            await store.close()  # a refused open leaves nothing locked
            raise
        unsealed = await store._call(store.shards.hot_count)
        if unsealed > store.seal_points:  # a mirror from before sealing: its one shard is moved now, not left in RAM
            log.warning("%s: sealing the %d points of a shard from before sealed shards", path, unsealed)
            await store._call(store._write, store.shards.freeze)
        if outdated := store.shards.outdated():
            log.warning(
                "%s: %d sealed shards of an older layout are rebuilt in the background (`epibus mirror migrate` "
                "does it now); until then they are searched as they are",
                path,
                len(outdated),
            )
        store._start_sealing()
        return store

    @property
    def shards(self) -> ShardSet:
        if self._shards is None:
            raise Unavailable("qdrant-edge", f"{self.path}: store is closed")
        return self._shards

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _open(self) -> None:
        private_dir(self.path)
        try:
            self._open_shards()
        finally:
            # qdrant-edge creates its files through the umask: a node's engine process runs with 077, and a store
            # opened elsewhere (a tool, a test) is tightened here and when it closes, never walked on every write:
            # at a million points the tree holds thousands of files.
            private_tree(self.path)

    def _open_shards(self) -> None:
        meta_path = self.path / META_FILE
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            if (meta["model_id"], meta["dimension"]) != (self.model_id, self.dimension):
                raise ModelMismatch(
                    f"{meta['model_id']} ({meta['dimension']}-d)", f"{self.model_id} ({self.dimension}-d)"
                )
            self.store_id = str(meta["store_id"])
        else:
            self.store_id = str(uuid.uuid4())
        shards = ShardSet(self.path, self.dimension, self._engine, layout=self.layout)
        require_room(self.path, "mirror")
        shards.open()
        self._shards = shards
        if not meta_path.exists():
            write_private(
                meta_path,
                json.dumps({"model_id": self.model_id, "dimension": self.dimension, "store_id": self.store_id}),
            )

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
        """An engine call that may create files. Never below the disk reserve: the engine writes through mmap,
        and a page the disk cannot back is SIGBUS."""
        require_room(self.path, "mirror")
        return self._engine(fn, *args)

    async def upsert(self, points: Sequence[Point]) -> None:
        if not points:
            return
        require_dimension(self.model_id, self.dimension, [p.vector for p in points])
        batch = [
            qe.Point(str(p.id), list(p.vector), {**p.payload, "model_id": self.model_id, "dimension": self.dimension})
            for p in points
        ]
        await self._call(self._write, self.shards.upsert, batch)
        if await self._call(self.shards.hot_count) >= self.seal_points:
            await self._call(self._write, self.shards.freeze)
            self._start_sealing()
            await self._keep_up()

    async def _keep_up(self) -> None:
        """Hold the writer while MAX_FROZEN shards wait for their seals, or while one does and a merge is due
        (merges run when no shard waits for its seal: without the hold a fast writer would starve them and the
        shards a query asks would grow without bound). A seal that failed holds nothing (it is retried in 30 s
        and reported): the frozen shards keep serving, from RAM."""
        started = time.perf_counter()
        while self._shards is not None and self._sealing is not None and not self._sealing.done():
            frozen = len(self._shards.frozen())
            if frozen < MAX_FROZEN and not (frozen and await self._call(self._shards.to_merge, self.seal_points)):
                break
            await asyncio.wait([self._sealing], timeout=0.2)
        self.seals.writes_held_s += time.perf_counter() - started

    async def upsert_packed(
        self, ids: Sequence[uuid.UUID], vectors: Any, payloads: Sequence[Mapping[str, Any]]
    ) -> None:
        """`upsert` of points sent as one float32 array (rows in the order of `ids`): how the engine takes them."""
        await self.upsert(
            [Point(i, row.tolist(), payload) for i, row, payload in zip(ids, vectors, payloads, strict=True)]
        )

    async def delete(self, ids: Sequence[uuid.UUID]) -> None:
        if ids:
            await self._call(self._write, self.shards.delete, [str(i) for i in ids])

    async def retrieve(self, ids: Sequence[uuid.UUID]) -> list[Point]:
        if not ids:
            return []
        records = await self._call(self.shards.retrieve, [str(i) for i in ids])
        return [Point(uuid.UUID(str(r.id)), list(r.vector), dict(r.payload)) for r in records]

    async def search(self, vector: Vector, where: Filter, *, limit: int) -> list[Hit]:
        require_dimension(self.model_id, self.dimension, [vector])
        found = await self._call(self.shards.query, list(vector), edge_filter(where), limit)
        return [Hit(uuid.UUID(point), score, dict(payload)) for point, score, payload in found]

    async def set_payload(self, where: Filter, payload: Mapping[str, Any]) -> None:
        flt = edge_filter(where)
        if flt is None:
            raise ValueError("set_payload needs a filter; refusing to rewrite every point")
        await self._call(self._write, self.shards.set_payload, flt, payload)

    async def describe(self) -> CollectionInfo:
        return CollectionInfo(self.model_id, self.dimension, await self._call(self.shards.count), self.store_id)

    async def point_ids(self, where: Filter | None = None) -> list[uuid.UUID]:
        """Every point id (matching `where`), for reconciliation."""
        flt = edge_filter(where) if where is not None else None
        return [uuid.UUID(i) for i in await self._call(lambda: list(self.shards.scroll_ids(flt)))]

    def shard_states(self) -> dict[str, int]:
        """How many shards are hot, frozen (waiting for their seal) and sealed, from memory (no engine call)."""
        listed = list(self._shards.shards) if self._shards is not None else []
        frozen = sum(1 for s in listed[:-1] if not s.sealed)
        return {
            "hot": 1 if listed else 0,
            "frozen": frozen,
            "sealed": sum(1 for s in listed if s.sealed),
            "outdated": len(self._shards.outdated()) if self._shards is not None else 0,
        }

    async def shard_layout(self) -> list[dict[str, Any]]:
        """Each shard: its name, whether it is sealed, its points."""
        return list(await self._call(self.shards.describe_shards))

    # -- sealing: the index is built in a worker process, never in the node's ------------------------------------

    def _start_sealing(self) -> None:
        """Seal the frozen shards in the background (one task, owned by the store and ended by close)."""
        if self._shards is None or not (self._shards.frozen() or self._shards.outdated()):
            return
        if self._sealing is not None and not self._sealing.done():
            return
        self._sealing = asyncio.get_running_loop().create_task(self._seal_frozen(), name=f"seal {self.path}")

    async def _seal_frozen(self) -> None:
        """Seal frozen shards, oldest first, then rebuild sealed shards of an older layout, then merge sealed
        shards of one size tier."""
        while self._shards is not None:
            waiting = (
                self._shards.frozen()[:1]
                or self._shards.outdated()[:1]
                or await self._call(self._shards.to_merge, self.seal_points)
            )
            if not waiting:
                return
            await asyncio.sleep(max(0.0, self._next_seal_at - time.monotonic()))
            try:
                async with self._rebuilding:
                    await self._rebuild(waiting)
            except (Unavailable, ComponentFailed, StoreDamaged, OSError) as e:
                # The frozen shard keeps serving (searched exactly): nothing is lost, the seal is tried again.
                self.seals.failures += 1
                self.seals.last_error = error_summary(e)
                self._next_seal_at = time.monotonic() + SEAL_RETRY_S
                log.error("sealing a shard of %s failed: %s; trying again in %.0f s", self.path, e, SEAL_RETRY_S)
                return

    async def _rebuild(self, names: list[str]) -> None:
        """Export the shards, build their sealed copy in a worker, swap it in. Hold `_rebuilding`."""
        export: Export = await self._call(self.shards.start_export, names)
        try:
            while not await self._call(self._write, self.shards.export_step, export):
                pass
            self.seals.last_build_s = await self._run_worker(export)
            self.seals.replayed_writes += await self._call(self._write, self.shards.swap_in, export)
            self.seals.sealed += 1
        finally:
            # A swap takes the shards out of `exports`; still there, the export failed or was cancelled.
            if self._shards is not None and names[0] in self._shards.exports:
                await self._call(self._shards.abandon, export)

    async def _run_worker(self, export: Export) -> float:
        """Run `observers.mirror.seal` on the exported points; it dies with this process. Returns seconds."""
        started = time.perf_counter()
        command = [
            sys.executable, "-m", "observers.mirror.seal", str(export.folder), str(export.target), str(export.layout)
        ]  # fmt: skip
        process = SPAWNER.run(
            lambda: subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent(),
            )
        )
        try:
            _, stderr = await asyncio.to_thread(process.communicate)
        finally:
            if process.poll() is None:
                process.kill()
                await asyncio.to_thread(process.wait)
        if process.returncode != 0:
            said = stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {process.returncode}"]
            raise ComponentFailed("mirror seal", f"building {export.target.name} failed: {said[0][:300]}")
        return round(time.perf_counter() - started, 2)

    async def settle(self) -> None:
        """Wait for the seals under way (a failed one is counted in `seals`, not raised)."""
        if self._sealing is not None:
            await asyncio.wait([self._sealing])

    async def optimize(self) -> bool:
        """Seal what is waiting now (a reindex calls it before swapping its store in). True if anything was."""
        await self.settle()
        sealed_before = self.seals.sealed
        async with self._rebuilding:
            if await self._call(self.shards.hot_count):
                await self._call(self._write, self.shards.freeze)
            for name in list(self.shards.frozen()):
                await self._rebuild([name])
        return self.seals.sealed > sealed_before

    async def migrate(self) -> int:
        """Move every point searched from RAM (a mirror from before sealed shards held them all in one shard)
        into sealed shards, and rebuild every sealed shard of an older layout, now rather than as the seals get
        to it. Returns how many points moved."""
        moved = int(await self._call(self.shards.unsealed_count)) + int(await self._call(self.shards.outdated_count))
        await self.optimize()
        async with self._rebuilding:
            for name in list(self.shards.outdated()):
                await self._rebuild([name])
        return moved

    async def compact(self) -> int:
        """Rewrite every shard a delete may have left bytes in, so a deleted point leaves none behind:
        qdrant-edge keeps a deleted point's payload and vector in its segment pages and its write-ahead log, and
        neither flush() nor optimize() removes them. Unsealed shards are copied in this process; a sealed shard
        a delete touched is built again by a worker. Meant for forget, not for every delete. Returns the number
        of points in the store. An interrupted compaction leaves the old shards listed, and whole."""
        async with self._rebuilding:
            await self._call(self._write, self.shards.compact_unsealed)
            for name in self.shards.scrubbed():
                await self._rebuild([name])
        return int(await self._call(self.shards.count))

    async def close(self) -> None:
        if self._sealing is not None:
            self._sealing.cancel()  # the frozen shard stays listed and is sealed after the next open
            await asyncio.wait([self._sealing])
            if not self._sealing.cancelled() and (error := self._sealing.exception()) is not None:
                log.error("sealing a shard of %s had failed: %s", self.path, error_summary(error))
            self._sealing = None
        if self._shards is not None:
            await self._call(self._engine, self._shards.flush)
            await self._call(self._write, self._shards.close)  # closing rewrites segment files
            self._shards = None
            await self._call(private_tree, self.path)
        self._executor.shutdown(wait=True)
