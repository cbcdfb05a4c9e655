"""One sealed shard in each layout the mirror knows (observers.mirror.seal.LAYOUTS), built by the seal worker's
own `build` from the same points, then loaded alone in a fresh process:

    python bench/layouts.py [--points 100000] [--queries 200] [--json]

Per layout: the anonymous memory the loaded shard holds per point (RssAnon before and after the load), the load
time with the shard's files dropped from the page cache (posix_fadvise DONTNEED; the engine's own reads) and
after `observers.mirror.shards.warm` read them, bytes on disk per point, and the safe door's filtered top-10:
p50/p99 and recall@10 against exact search over the same float32 vectors (numpy, same filter). Points carry a
payload shaped like the mirror's (state, content, digest); vectors are clustered unit vectors (bench.sealed)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

# Run as `python bench/layouts.py`: this folder must not shadow the packages.
sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

from bench.harness import percentile  # noqa: E402
from bench.sealed import DIM, anonymous_bytes, safe_mask, unit_vectors  # noqa: E402
from observers.mirror.edge import edge_filter  # noqa: E402
from observers.mirror.seal import LAYOUTS, PointsFile, build  # noqa: E402
from observers.mirror.shards import SEALED_SEARCH, warm  # noqa: E402
from observers.recall import safe_filter  # noqa: E402

TRUST = ("verified", "unverified", "contradicted")


def payload(i: int) -> dict[str, Any]:
    """What a claim's point carries (observers.mirror.observer.claim_payload), with the bench's filter fields."""
    return {
        "project": f"p{i % 4}", "kind": "finding", "artifact_id": str(uuid.UUID(int=i + 1)),
        "actor": f"agent-{i % 10}", "event_id": str(uuid.uuid4()), "trust": TRUST[i % 3],
        "lifecycle": "active" if i % 7 else "resolved", "resolution": "none", "impact": 0.5, "confidence": 0.7,
        "content": f"finding {i}: the cache path stalls when node {i % 97} restarts under load",
        "created_ts": 1.7e9 + i, "created_at": "2026-12-01T00:00:00.000000+00:00", "superseded_by": None,
        "supersedes": None, "contradicted_by": None, "forgotten": False, "last_seq": i,
        "updated_at": "2026-12-01T00:00:00+00:00", "verified_by": [], "reviewed_by": [], "reviewed_at": None,
        "node": "n1", "stream_seq": i, "stream_ts": 1.7e9 + i, "event_digest": "ab" * 32, "evidence": [],
    }  # fmt: skip


def build_shards(root: Path, points: int) -> dict[int, Path]:
    vectors = unit_vectors(points, seed=1)
    folder = root / "points"
    out = PointsFile(folder, DIM)
    for start in range(0, points, 1000):
        stop = min(points, start + 1000)
        ids = [str(uuid.UUID(int=i + 1)) for i in range(start, stop)]
        out.add(ids, vectors[start:stop], [payload(i) for i in range(start, stop)])
    out.finish()
    return {layout: _built(folder, root / f"layout-{layout}", layout) for layout in LAYOUTS}


def _built(folder: Path, target: Path, layout: int) -> Path:
    build(folder, target, layout)
    return target


def drop_cache(path: Path) -> None:
    """Ask the kernel to forget the shard's file pages (what a restart long after the last write finds)."""
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def measure(path: Path, points: int, queries: int, warmed: bool) -> dict[str, Any]:
    """In this (fresh) process: load the shard and query it."""
    import qdrant_edge as qe

    drop_cache(path)
    before = anonymous_bytes(os.getpid())
    started = time.perf_counter()
    if warmed:
        warm(path)
    shard = qe.EdgeShard.load(str(path))
    load_ms = (time.perf_counter() - started) * 1000
    held = anonymous_bytes(os.getpid()) - before
    vectors = unit_vectors(points, seed=1)
    allowed = np.nonzero(safe_mask(points))[0]
    where = edge_filter(safe_filter("p1", kinds=None, include_resolved=False))
    rng = np.random.default_rng(9)
    asked = vectors[rng.integers(0, points, queries)] + rng.normal(size=(queries, DIM)) * (0.5 / np.sqrt(DIM))
    asked /= np.linalg.norm(asked, axis=1, keepdims=True)
    times, found = [], []
    for query in asked.astype(np.float32):
        request = qe.QueryRequest(
            query=qe.Query.Nearest(query.tolist()), filter=where, limit=10, with_payload=False, params=SEALED_SEARCH
        )
        began = time.perf_counter()
        hits = shard.query(request)
        times.append((time.perf_counter() - began) * 1000)
        exact = allowed[np.argsort(-(vectors[allowed] @ query))[:10]]
        found.append(len({uuid.UUID(str(h.id)).int - 1 for h in hits} & set(exact.tolist())) / 10)
    shard.close()
    disk = sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())
    return {
        "load_ms": round(load_ms), "anon_b_per_point": round(held / points), "disk_b_per_point": round(disk / points),
        "p50_ms": round(percentile(times, 0.5), 2), "p99_ms": round(percentile(times, 0.99), 2),
        "recall_at_10": round(float(np.mean(found)), 3),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description="One sealed shard per mirror layout, from the same points, each loaded alone and measured."
    )
    parser.add_argument("--points", type=int, default=100_000, help="points in each shard (100,000)")
    parser.add_argument("--queries", type=int, default=200, help="filtered top-10 queries per shard (200)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--measure", nargs=2, metavar=("SHARD", "WARMED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure[0]), args.points, args.queries, args.measure[1] == "1")))
        return
    report: dict[str, Any] = {"points": args.points}
    with tempfile.TemporaryDirectory(prefix="epibus-layouts-") as scratch:
        for layout, path in build_shards(Path(scratch), args.points).items():
            for warmed in (False, True):
                said = subprocess.run(
                    [sys.executable, __file__, "--points", str(args.points), "--queries", str(args.queries),
                     "--measure", str(path), "1" if warmed else "0"],
                    check=True, capture_output=True, text=True,
                )  # fmt: skip
                report[f"layout {layout}{', files read first' if warmed else ''}"] = json.loads(said.stdout)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for name, row in report.items():
        if isinstance(row, dict):
            print(f"{name:<28} " + ", ".join(f"{k} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
