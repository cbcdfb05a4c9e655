"""Sealing a shard: the points of a full hot shard written once into a new shard built for reading (HNSW over
int8-quantized vectors held in RAM, original vectors, payload and graph on disk), in a worker process.

qdrant-edge's `optimize()` holds the GIL for its whole run (seconds for 20k points, tens of seconds for 100k):
in the node's process it would stop the event loop, so it runs here, in a process of its own started with

    python -m observers.mirror.seal POINTS_DIR TARGET_DIR

POINTS_DIR holds `vectors.npy` (float32, one row a point) and `points.jsonl` (id and payload, same order). The
worker creates TARGET_DIR, upserts, optimizes, flushes and closes, then writes `TARGET_DIR/sealed.json`; a
target without that file is unfinished and is deleted by whoever finds it."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import qdrant_edge as qe

from observers.mirror.store import INDEXED_FLOATS, INDEXED_KEYWORDS

SEALED_MARK = "sealed.json"
WRITE_BATCH = 1_000


def shard_config(dimension: int, *, sealed: bool) -> qe.EdgeConfig:
    """The one place shard settings are chosen. A hot shard takes writes and is searched exactly (an
    appendable segment keeps its vectors in RAM whatever it is told). A sealed shard is read: original vectors,
    payload and the HNSW graph on disk (mmap), int8 copies of the vectors in RAM, searched with rescoring."""
    if not sealed:
        return qe.EdgeConfig(
            vectors=qe.EdgeVectorParams(size=dimension, distance=qe.Distance.Cosine),
            # in KB of vectors: far above a hot shard's size, so nothing ever builds HNSW in the node's process
            optimizers=qe.EdgeOptimizersConfig(indexing_threshold=1_000_000),
            hnsw_config=qe.HnswIndexConfig(m=16, ef_construct=100, full_scan_threshold=10_000),
        )
    return qe.EdgeConfig(
        vectors=qe.EdgeVectorParams(
            size=dimension,
            distance=qe.Distance.Cosine,
            on_disk=True,
            quantization_config=qe.ScalarQuantizationConfig(type=qe.ScalarType.Int8, quantile=0.99, always_ram=True),
        ),
        on_disk_payload=True,
        hnsw_config=qe.HnswIndexConfig(m=16, ef_construct=100, full_scan_threshold=1_000, on_disk=True),
        # one segment, indexed whatever its size: a sealed shard is searched through its graph
        optimizers=qe.EdgeOptimizersConfig(indexing_threshold=1, default_segment_number=1, max_segment_size=10**9),
    )


def create_shard(path: Path, dimension: int, sealed: bool) -> Any:
    """A new shard with the payload indexes every filter of the mirror uses."""
    shard = qe.EdgeShard.create(str(path), shard_config(dimension, sealed=sealed))
    for key in INDEXED_KEYWORDS:
        shard.update(qe.UpdateOperation.create_field_index(key, qe.PayloadSchemaType.Keyword))
    for key in INDEXED_FLOATS:
        shard.update(qe.UpdateOperation.create_field_index(key, qe.PayloadSchemaType.Float))
    return shard


def write_points(folder: Path, ids: list[str], vectors: np.ndarray, payloads: list[dict[str, Any]]) -> None:
    """What the worker reads: the points of a shard being sealed (vectors: float32, one row a point)."""
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "vectors.npy", vectors)
    with (folder / "points.jsonl").open("w") as out:
        for point_id, payload in zip(ids, payloads, strict=True):
            out.write(json.dumps({"id": point_id, "payload": payload}) + "\n")


def build(points: Path, target: Path) -> dict[str, Any]:
    """Build the sealed shard; returns what `sealed.json` records."""
    started = time.perf_counter()
    vectors = np.load(points / "vectors.npy")
    rows = [json.loads(line) for line in (points / "points.jsonl").read_text().splitlines()]
    if len(rows) != len(vectors):
        raise SystemExit(f"{points}: {len(rows)} points but {len(vectors)} vectors")
    shard = create_shard(target, int(vectors.shape[1]) if len(vectors) else 0, sealed=True)
    for start in range(0, len(rows), WRITE_BATCH):
        batch = [
            qe.Point(row["id"], vectors[start + i].tolist(), row["payload"])
            for i, row in enumerate(rows[start : start + WRITE_BATCH])
        ]
        shard.update(qe.UpdateOperation.upsert_points(batch))
    shard.optimize()
    shard.flush()
    shard.close()
    mark = {"points": len(rows), "build_s": round(time.perf_counter() - started, 2)}
    (target / SEALED_MARK).write_text(json.dumps(mark))
    return mark


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m observers.mirror.seal POINTS_DIR TARGET_DIR")
    os.umask(0o077)  # the shard's files are owner-only from the start, like the rest of the home
    print(json.dumps(build(Path(sys.argv[1]), Path(sys.argv[2]))))
