"""Sealing a shard: the points of a full hot shard written once into a new shard built for reading (HNSW over
int8-quantized vectors held in RAM, original vectors, payload and graph on disk), in a worker process.

qdrant-edge's `optimize()` holds the GIL for its whole run (seconds for 20k points, tens of seconds for 100k):
in the node's process it would stop the event loop, so it runs here, in a process of its own started with

    python -m observers.mirror.seal POINTS_DIR TARGET_DIR [LAYOUT]

POINTS_DIR holds `vectors.f32` (float32, one row a point), `points.jsonl` (id and payload, same order) and
`points.json` (how many, their dimension), written a batch at a time by `PointsFile` so neither side holds a
shard's points in memory at once. The worker creates TARGET_DIR, upserts, optimizes, flushes and closes, then
writes `TARGET_DIR/sealed.json`; a target without that file is unfinished and is deleted by whoever finds it."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import numpy as np
import qdrant_edge as qe

from observers.mirror.store import INDEXED_FLOATS, INDEXED_KEYWORDS

SEALED_MARK = "sealed.json"
WRITE_BATCH = 1_000


# How a sealed shard is laid out; the manifest records each shard's, and a shard of an older one is rebuilt.
# 1: float32 originals, a write-ahead log (which held every point a second time, in RAM after each load),
#    indexes on every field. 2: float16 originals, no write-ahead log (the store flushes each write to a sealed
#    shard before answering), memory tiers set per structure, indexes only on the fields filters name.
LAYOUT = 2
LAYOUTS = (1, 2)


def shard_config(dimension: int, *, sealed: bool, layout: int = LAYOUT) -> qe.EdgeConfig:
    """The one place shard settings are chosen. A hot shard takes writes and is searched exactly (an
    appendable segment keeps its vectors in RAM whatever it is told). A sealed shard is read: original vectors
    and payload on disk, read when a query needs them; int8 copies of the vectors pinned in RAM, searched
    through the HNSW graph (mapped and warmed at load) and rescored on the originals."""
    if not sealed:
        return qe.EdgeConfig(
            vectors=qe.EdgeVectorParams(size=dimension, distance=qe.Distance.Cosine),
            # in KB of vectors: far above a hot shard's size, so nothing ever builds HNSW in the node's process
            optimizers=qe.EdgeOptimizersConfig(indexing_threshold=1_000_000),
            hnsw_config=qe.HnswIndexConfig(m=16, ef_construct=100, full_scan_threshold=10_000),
        )
    # one segment, indexed whatever its size: a sealed shard is searched through its graph
    optimizers = qe.EdgeOptimizersConfig(indexing_threshold=1, default_segment_number=1, max_segment_size=10**9)
    if layout == 1:
        return qe.EdgeConfig(
            vectors=qe.EdgeVectorParams(
                size=dimension,
                distance=qe.Distance.Cosine,
                on_disk=True,
                quantization_config=qe.ScalarQuantizationConfig(
                    type=qe.ScalarType.Int8, quantile=0.99, always_ram=True
                ),
            ),
            on_disk_payload=True,
            hnsw_config=qe.HnswIndexConfig(m=16, ef_construct=100, full_scan_threshold=1_000, on_disk=True),
            optimizers=optimizers,
        )
    return qe.EdgeConfig(
        vectors=qe.EdgeVectorParams(
            size=dimension,
            distance=qe.Distance.Cosine,
            datatype=qe.VectorStorageDatatype.Float16,  # rescoring on float16 ranks as on float32 (bench: quality)
            memory=qe.Memory.Cold,
            quantization_config=qe.ScalarQuantizationConfig(
                type=qe.ScalarType.Int8, quantile=0.99, memory=qe.Memory.Pinned
            ),
        ),
        payload_memory=qe.Memory.Cold,  # read for a query's winners only
        hnsw_config=qe.HnswIndexConfig(m=16, ef_construct=100, full_scan_threshold=1_000, memory=qe.Memory.Cached),
        optimizers=optimizers,
        wal_enabled=False,
    )


def has_wal(layout: int) -> bool:
    """Whether a sealed shard of this layout logs its writes; one that does not is flushed after each."""
    return layout < 2


def create_shard(path: Path, dimension: int, sealed: bool, layout: int = LAYOUT) -> Any:
    """A new shard with the payload indexes every filter of the mirror uses."""
    shard = qe.EdgeShard.create(str(path), shard_config(dimension, sealed=sealed, layout=layout))
    keyword: Any = qe.PayloadSchemaType.Keyword
    if sealed and layout >= 2:
        keyword = qe.KeywordIndexParams(memory=qe.Memory.Cached)  # mapped, warmed at load: not on the heap
    for key in INDEXED_KEYWORDS:
        shard.update(qe.UpdateOperation.create_field_index(key, keyword))
    for key in INDEXED_FLOATS:
        shard.update(qe.UpdateOperation.create_field_index(key, qe.PayloadSchemaType.Float))
    return shard


class PointsFile:
    """The points of a shard being sealed, written a batch at a time: what the worker reads."""

    def __init__(self, folder: Path, dimension: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.dimension = dimension
        self.count = 0
        self._vectors: BinaryIO = (folder / "vectors.f32").open("wb")
        self._rows: TextIO = (folder / "points.jsonl").open("w")

    def add(self, ids: list[str], vectors: np.ndarray, payloads: list[dict[str, Any]]) -> None:
        if len(ids) != len(vectors) or len(ids) != len(payloads):
            raise ValueError(f"{len(ids)} ids, {len(vectors)} vectors and {len(payloads)} payloads")
        self._vectors.write(np.ascontiguousarray(vectors, dtype=np.float32).tobytes())
        for point_id, payload in zip(ids, payloads, strict=True):
            self._rows.write(json.dumps({"id": point_id, "payload": payload}) + "\n")
        self.count += len(ids)

    def finish(self) -> None:
        self.close()
        (self.folder / "points.json").write_text(json.dumps({"points": self.count, "dimension": self.dimension}))

    def close(self) -> None:
        self._vectors.close()
        self._rows.close()


def read_points(folder: Path) -> tuple[int, int, Iterator[list[qe.Point]]]:
    """What `PointsFile` wrote: (points, dimension, batches of WRITE_BATCH points), read as they are used."""
    meta = json.loads((folder / "points.json").read_text())
    count, dimension = int(meta["points"]), int(meta["dimension"])
    if (folder / "vectors.f32").stat().st_size != count * dimension * 4:
        raise SystemExit(f"{folder}: vectors.f32 does not hold {count} vectors of {dimension}")
    vectors = np.memmap(folder / "vectors.f32", dtype=np.float32, mode="r", shape=(count, dimension)) if count else None

    def batches() -> Iterator[list[qe.Point]]:
        batch: list[qe.Point] = []
        with (folder / "points.jsonl").open() as rows:
            for index, line in enumerate(rows):
                if vectors is None or index >= count:
                    raise SystemExit(f"{folder}: more points than {count} vectors")
                row = json.loads(line)
                batch.append(qe.Point(row["id"], vectors[index].tolist(), row["payload"]))
                if len(batch) == WRITE_BATCH:
                    yield batch
                    batch = []
        if batch:
            yield batch

    return count, dimension, batches()


def build(points: Path, target: Path, layout: int = LAYOUT) -> dict[str, Any]:
    """Build the sealed shard; returns what `sealed.json` records."""
    started = time.perf_counter()
    count, dimension, batches = read_points(points)
    shard = create_shard(target, dimension, sealed=True, layout=layout)
    written = 0
    for batch in batches:
        shard.update(qe.UpdateOperation.upsert_points(batch))
        written += len(batch)
    if written != count:
        raise SystemExit(f"{points}: {written} points but {count} vectors")
    shard.optimize()
    shard.flush()
    shard.close()
    mark = {"points": count, "build_s": round(time.perf_counter() - started, 2), "layout": layout}
    (target / SEALED_MARK).write_text(json.dumps(mark))
    return mark


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        raise SystemExit("usage: python -m observers.mirror.seal POINTS_DIR TARGET_DIR [LAYOUT]")
    os.umask(0o077)  # the shard's files are owner-only from the start, like the rest of the home
    print(json.dumps(build(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) == 4 else LAYOUT)))
