"""The shards of an edge mirror, listed in `shards.json`: one hot shard that takes new points (searched exactly,
at most `seal_points` of them), frozen shards waiting for their sealed copy, and sealed shards built in a worker
process for reading (`observers.mirror.seal`). A point lives in exactly one shard; every write and read goes to
each shard that may hold it. Nothing here is thread-safe: the store calls it on its one engine thread.

Sealing, step by step, so that a process killed at any line loses nothing: freeze (a new hot shard takes new
points; the manifest lists both), export the frozen shard's points to files while recording every later write
to it, build the sealed copy in a worker, load it, replay the recorded writes, then one manifest write swaps it
in and the frozen shard's files go. A directory the manifest does not list is unfinished and is deleted on open."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import qdrant_edge as qe

from bus.host.home import write_private
from observers.mirror.seal import LAYOUT, SEALED_MARK, PointsFile, create_shard, has_wal

MANIFEST = "shards.json"
EXPORTS = "exports"  # points on their way to a worker; nothing here survives a restart
LEGACY_SHARD = "shard"  # a mirror written before sealing had one shard: it becomes the first hot shard
# Where that layout's compaction wrote its copy, and kept the shard it replaced until the swap was done.
LEGACY_COPY, LEGACY_RETIRED = "shard.compacting", "shard.retired"
MERGE_FAN = 4  # sealed shards of one tier merged into one
MERGE_TIERS = 2  # at most two merges deep: a sealed shard holds up to 16 hot shards' points (320k by default)
EXPORT_BATCH = 500  # points per engine call while exporting: the engine thread stays free for queries
# Sealed shards are searched through int8 copies, then the best candidates are rescored on the originals.
# ACORN: with the safe door's filter (a project, active, not contradicted: ~15% of points) a plain HNSW walk
# found 0.4 of exact search's top 10 on clustered vectors; ACORN found all of them (bench/sealed.py).
SEALED_SEARCH = qe.SearchParams(
    acorn=qe.AcornSearchParams(enable=True),
    quantization=qe.QuantizationSearchParams(rescore=True, oversampling=3.0),
)

Engine = Callable[..., Any]  # the store's error-translating call: engine(fn, *args)


@dataclass
class Shard:
    name: str
    sealed: bool
    engine: Any
    scrub: bool = False  # a delete removed a point here since it was last rebuilt: compaction rebuilds it
    layout: int = LAYOUT  # a sealed shard's (observers.mirror.seal.LAYOUT); a hot one's is its engine's default

    @property
    def flush_each_write(self) -> bool:
        """A sealed shard without a write-ahead log keeps a write only once flushed."""
        return self.sealed and not has_wal(self.layout)


@dataclass
class Export:
    """Shards' points being copied out for one sealed shard (one frozen shard, or sealed ones to merge), and
    the writes those shards took since the copy began."""

    names: list[str]
    folder: Path
    target: Path
    layout: int = LAYOUT
    writes: list[tuple[str, Any]] = field(default_factory=list)
    position: int = 0  # which of `names` is being copied
    offset: Any = None
    points: PointsFile | None = None  # written a batch at a time: a merge's points never sit in this process


class ShardSet:
    def __init__(self, path: Path, dimension: int, engine: Engine, *, layout: int = LAYOUT) -> None:
        self.path = path
        self.dimension = dimension
        self.engine = engine
        self.layout = layout  # what seals build; a sealed shard of another is outdated and rebuilt
        self.shards: list[Shard] = []
        self.next_number = 1
        self.exports: dict[str, Export] = {}  # by the name of each shard being copied

    # -- the manifest ------------------------------------------------------------------------------------------

    def open(self) -> None:
        manifest = self.path / MANIFEST
        if manifest.exists():
            recorded = json.loads(manifest.read_text())
            # a sealed shard listed without a layout was built before layouts were recorded: layout 1
            listed = [
                (s["name"], bool(s["sealed"]), bool(s.get("scrub", False)), int(s.get("layout", 1)))
                for s in recorded["shards"]
            ]
            self.next_number = int(recorded["next"])
        elif (self.path / LEGACY_SHARD).exists() or (self.path / LEGACY_RETIRED).exists():
            self._finish_legacy_compaction()
            listed = [(LEGACY_SHARD, False, False, LAYOUT)]
        else:
            listed = []
        self._delete_unlisted({name for name, _, _, _ in listed})
        if (self.path / EXPORTS).exists():
            shutil.rmtree(self.path / EXPORTS)
        for name, sealed, scrub, layout in listed:
            warm(self.path / name)
            engine = self.engine(qe.EdgeShard.load, str(self.path / name))
            self.shards.append(Shard(name, sealed, engine, scrub, layout))
        if not self.shards or self.shards[-1].sealed:
            self._add_hot()
        self._save()

    def _finish_legacy_compaction(self) -> None:
        """A compaction of the one-shard layout cut short: its unfinished copy goes; a retired shard with no live
        one goes back in place, and beside a live one it is deleted."""
        live, old, copy = (self.path / name for name in (LEGACY_SHARD, LEGACY_RETIRED, LEGACY_COPY))
        if copy.exists():
            shutil.rmtree(copy)
        if old.exists() and not live.exists():
            old.rename(live)
        elif old.exists():
            shutil.rmtree(old)

    def _delete_unlisted(self, listed: set[str]) -> None:
        for child in self.path.iterdir():
            if child.is_dir() and child.name not in listed and child.name.startswith(("hot-", "sealed-", "build-")):
                shutil.rmtree(child)

    def _save(self) -> None:
        shards = [
            {"name": s.name, "sealed": s.sealed, "scrub": s.scrub} | ({"layout": s.layout} if s.sealed else {})
            for s in self.shards
        ]
        write_private(self.path / MANIFEST, json.dumps({"shards": shards, "next": self.next_number}))

    def _new_name(self, prefix: str) -> str:
        name = f"{prefix}-{self.next_number}"
        self.next_number += 1
        return name

    def _add_hot(self) -> None:
        name = self._new_name("hot")
        self.shards.append(Shard(name, False, self.engine(create_shard, self.path / name, self.dimension, False)))

    @property
    def hot(self) -> Shard:
        return self.shards[-1]

    def frozen(self) -> list[str]:
        """Shards that take no new points and wait for their sealed copy, oldest first."""
        return [s.name for s in self.shards[:-1] if not s.sealed]

    def _shard(self, name: str) -> Shard:
        return next(s for s in self.shards if s.name == name)

    # -- writes: each reaches the shard that holds the point, and is recorded for a shard being exported ----------

    def _record(self, shard: Shard, write: tuple[str, Any]) -> None:
        if shard.name in self.exports:
            self.exports[shard.name].writes.append(write)

    def _holders(self, ids: Sequence[str]) -> dict[str, Shard]:
        """Which shard (other than the hot one) holds each of these point ids."""
        found: dict[str, Shard] = {}
        for shard in self.shards[:-1]:
            wanted = [i for i in ids if i not in found]
            if not wanted:
                break
            for record in self.engine(shard.engine.retrieve, wanted, False, False):
                found[str(record.id)] = shard
        return found

    def upsert(self, points: Sequence[qe.Point]) -> None:
        """A point already in an older shard is overwritten there (re-embedding never duplicates it)."""
        holders = self._holders([str(p.id) for p in points])
        by_shard: dict[str, list[qe.Point]] = {}
        for point in points:
            by_shard.setdefault(holders[str(point.id)].name if str(point.id) in holders else self.hot.name, []).append(
                point
            )
        for name, batch in by_shard.items():
            shard = self._shard(name)
            self._apply(shard, qe.UpdateOperation.upsert_points(batch), ("upsert", batch))

    def delete(self, ids: Sequence[str]) -> None:
        holders = self._holders(ids)
        held = {h.name for h in holders.values()}
        scrubbed = False
        for shard in self.shards:
            if shard.flush_each_write and shard.name not in held:
                continue  # holds none of them: no flush to pay for nothing
            self._apply(shard, qe.UpdateOperation.delete_points(list(ids)), ("delete", list(ids)))
            if shard.sealed and not shard.scrub and shard.name in held:
                shard.scrub = scrubbed = True
        if scrubbed:
            self._save()

    def set_payload(self, where: qe.Filter, payload: Mapping[str, Any]) -> None:
        matching = qe.CountRequest(filter=where, exact=True)
        operation = qe.UpdateOperation.set_payload_by_filter(where, dict(payload))
        write = ("set_payload", (where, dict(payload)))
        for shard in self.shards:
            if shard.flush_each_write and not self.engine(shard.engine.count, matching):
                continue  # none of its points match: no flush to pay for nothing
            self._apply(shard, operation, write)

    def _apply(self, shard: Shard, operation: Any, write: tuple[str, Any]) -> None:
        """One write to one shard, recorded for its export, and flushed where there is no log to replay it."""
        self.engine(shard.engine.update, operation)
        self._record(shard, write)
        if shard.flush_each_write:
            self.engine(shard.engine.flush)

    # -- reads -------------------------------------------------------------------------------------------------

    def retrieve(self, ids: Sequence[str]) -> list[Any]:
        found: dict[str, Any] = {}
        for shard in self.shards:
            wanted = [i for i in ids if i not in found]
            if not wanted:
                break
            for record in self.engine(shard.engine.retrieve, wanted, True, True):
                found[str(record.id)] = record
        return [found[i] for i in ids if i in found]

    def query(self, vector: list[float], where: qe.Filter | None, limit: int) -> list[tuple[str, float, Any]]:
        """Every shard's best `limit`, merged by score: (id, score, payload). Payloads are read for the winners
        only: a sealed shard keeps them on disk, and reading every shard's `limit` of them cost a third of a
        query (bench/sealed.py)."""
        scored: list[tuple[float, str, Shard]] = []
        for shard in self.shards:
            request = qe.QueryRequest(
                query=qe.Query.Nearest(vector),
                filter=where,
                limit=limit,
                with_payload=False,
                params=SEALED_SEARCH if shard.sealed else None,
            )
            scored += [(float(hit.score), str(hit.id), shard) for hit in self.engine(shard.engine.query, request)]
        scored.sort(key=lambda found: -found[0])
        winners = scored[:limit]
        payloads: dict[str, Any] = {}
        for shard in {id(s): s for _, _, s in winners}.values():
            ids = [point for _, point, s in winners if s is shard]
            payloads |= {str(r.id): r.payload for r in self.engine(shard.engine.retrieve, ids, True, False)}
        return [(point, score, payloads[point]) for score, point, _ in winners if point in payloads]

    def count(self) -> int:
        return sum(self._count(s) for s in self.shards)

    def hot_count(self) -> int:
        return self._count(self.hot)

    def unsealed_count(self) -> int:
        """Points searched exactly, from RAM: the hot shard's and the frozen ones'."""
        return sum(self._count(s) for s in self.shards if not s.sealed)

    def scroll_ids(self, where: qe.Filter | None) -> Iterator[str]:
        for shard in self.shards:
            offset = None
            while True:
                request = qe.ScrollRequest(offset=offset, limit=1024, filter=where, with_payload=False)
                records, offset = self.engine(shard.engine.scroll, request)
                yield from (str(r.id) for r in records)
                if offset is None:
                    break

    def describe_shards(self) -> list[dict[str, Any]]:
        return [{"name": s.name, "sealed": s.sealed, "points": self._count(s)} for s in self.shards]

    def _count(self, shard: Shard) -> int:
        return int(self.engine(shard.engine.count, qe.CountRequest(exact=True)))

    # -- sealing and rebuilding --------------------------------------------------------------------------------

    def freeze(self) -> str:
        """The hot shard stops taking points; a new one takes them. Returns the frozen shard's name."""
        frozen = self.hot.name
        self._add_hot()
        self._save()
        return frozen

    def start_export(self, names: Sequence[str]) -> Export:
        """Begin copying these shards' points out; from now on their writes are recorded for the sealed copy."""
        target = self._new_name("build")
        folder = self.path / EXPORTS / f"points-{target}"
        export = Export(list(names), folder, self.path / target, self.layout)
        for name in names:
            self.exports[name] = export
        return export

    def export_step(self, export: Export) -> bool:
        """Copy the next batch; True once every point is out (and the files are written)."""
        request = qe.ScrollRequest(offset=export.offset, limit=EXPORT_BATCH, with_payload=True, with_vector=True)
        records, export.offset = self.engine(self._shard(export.names[export.position]).engine.scroll, request)
        if export.points is None:
            export.points = PointsFile(export.folder, self.dimension)
        if records:
            export.points.add(
                [str(record.id) for record in records],
                np.asarray([record.vector for record in records], dtype=np.float32),
                [dict(record.payload) for record in records],
            )
        if export.offset is None:
            export.position += 1
        if export.position < len(export.names):
            return False
        export.points.finish()
        return True

    def swap_in(self, export: Export) -> int:
        """Load the built copy, replay the writes its shards took meanwhile, and list it in the first one's place
        (the others leave the list). Returns the number of writes replayed."""
        if not (export.target / SEALED_MARK).exists():
            raise RuntimeError(f"{export.target} was not finished by its worker")
        sealed_name = self._new_name("sealed")
        final = self.path / sealed_name
        export.target.rename(final)
        engine = self.engine(qe.EdgeShard.load, str(final))
        for kind, args in export.writes:
            if kind == "upsert":
                self.engine(engine.update, qe.UpdateOperation.upsert_points(args))
            elif kind == "delete":
                self.engine(engine.update, qe.UpdateOperation.delete_points(args))
            else:
                self.engine(engine.update, qe.UpdateOperation.set_payload_by_filter(args[0], args[1]))
        self.engine(engine.flush)
        old = [s for s in self.shards if s.name in export.names]
        first = self.shards.index(old[0])
        self.shards = [*self.shards[:first], Shard(sealed_name, True, engine, layout=export.layout)] + [
            s for s in self.shards[first + 1 :] if s.name not in export.names
        ]
        self._save()  # the swap: from here the sealed copy is the shard, on every open
        for shard in old:
            del self.exports[shard.name]
            self.engine(shard.engine.close)
            shutil.rmtree(self.path / shard.name)
        shutil.rmtree(export.folder)
        return len(export.writes)

    def abandon(self, export: Export) -> None:
        """An export whose worker failed: its shards stay as they are (and are searched), its files go."""
        for name in export.names:
            self.exports.pop(name, None)
        if export.points is not None:
            export.points.close()
        for made in (export.target, export.folder):
            if made.exists():
                shutil.rmtree(made)

    def to_merge(self, seal_points: int) -> list[str]:
        """Sealed shards of one size tier, MERGE_FAN of them, to build into one: shard sizes grow by MERGE_FAN
        a tier (20k, 80k, 320k points at the default, and no further: a worker builds a shard in memory), so a
        million points are a dozen shards, and each shard costs the node a fixed set of mapped files and one
        search a query."""
        tiers: dict[int, list[str]] = {}
        for shard in self.shards:
            if shard.sealed and shard.name not in self.exports and shard.layout == self.layout:
                tier = max(0, int(math.log(max(self._count(shard), 1) / seal_points, MERGE_FAN) + 1e-9))
                tiers.setdefault(tier, []).append(shard.name)
        for tier in sorted(t for t in tiers if t < MERGE_TIERS):
            if len(tiers[tier]) >= MERGE_FAN:
                return tiers[tier][:MERGE_FAN]
        return []

    def outdated(self) -> list[str]:
        """Sealed shards of another layout than the one seals build now, oldest first: each is rebuilt."""
        return [s.name for s in self.shards if s.sealed and s.layout != self.layout]

    def outdated_count(self) -> int:
        return sum(self._count(self._shard(name)) for name in self.outdated())

    def scrubbed(self) -> list[str]:
        """For compaction: the sealed shards a delete touched since they were built."""
        return [s.name for s in self.shards if s.sealed and s.scrub]

    def compact_unsealed(self) -> int:
        """Rewrite each unsealed shard with only its live points, in this process (at most `seal_points` each):
        a deleted point's bytes stay in a shard's pages and WAL until it is rewritten. Returns points kept."""
        kept = 0
        for index, shard in enumerate(self.shards):
            if shard.sealed:
                continue
            name = self._new_name("hot")
            fresh = self.engine(create_shard, self.path / name, self.dimension, False)
            offset = None
            while True:
                request = qe.ScrollRequest(offset=offset, limit=EXPORT_BATCH, with_payload=True, with_vector=True)
                records, offset = self.engine(shard.engine.scroll, request)
                batch = [qe.Point(r.id, list(r.vector), dict(r.payload)) for r in records]
                if batch:
                    self.engine(fresh.update, qe.UpdateOperation.upsert_points(batch))
                    kept += len(batch)
                if offset is None:
                    break
            self.engine(fresh.flush)
            self.shards[index] = Shard(name, False, fresh)
            self._save()  # the swap; the old files go after it
            self.engine(shard.engine.close)
            shutil.rmtree(self.path / shard.name)
        return kept

    def flush(self) -> None:
        for shard in self.shards:
            self.engine(shard.engine.flush)

    def close(self) -> None:
        for shard in self.shards:
            self.engine(shard.engine.close)
        self.shards = []


# Files a shard's load reads whole into memory, or warms: read first with plain reads, because the engine reads
# them through a fresh mapping a page fault at a time (~36 MB/s on a cold cache here: 1.1 s to load a 100k-point
# sealed shard, 0.2 s once its files were read). Original vectors and payload are read only when asked for.
NOT_WARMED = ("matrix.dat",)
NOT_WARMED_FOLDERS = ("payload_storage",)
WARM_CHUNK = 1 << 20


def warm(shard_path: Path) -> int:
    """Read the files a shard's load will read (into the page cache). Returns the bytes read."""
    if not shard_path.is_dir():
        return 0
    read = 0
    buffer = bytearray(WARM_CHUNK)
    for path in shard_path.rglob("*"):
        inside = path.relative_to(shard_path).parts
        if path.name in NOT_WARMED or any(part in NOT_WARMED_FOLDERS for part in inside) or not path.is_file():
            continue
        with path.open("rb", buffering=0) as handle:
            while got := handle.readinto(buffer):
                read += got
    return read
