"""Safe recall on the edge mirror as it grows: points written in batches while full hot shards are sealed by
worker processes, then the safe door's filtered top-10 timed on the store, against exact search (numpy over the
same vectors and the same filter) measured in the same run.

    python bench/sealed.py [--points 100000] [--queries 300] [--seal-points 20000] [--json]

The store is the one a node runs: qdrant-edge in its engine process (observers.mirror.edge_process). Reports
p50/p99 of both, recall@10 (the share of exact search's top 10 the store returns), the longest event-loop gap
in this process while writing and sealing, the engine's RSS per point and what the seals took."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import psutil

# Run as `python bench/sealed.py`: this folder must not shadow the packages.
sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

from bench.harness import percentile  # noqa: E402
from observers.mirror.edge import SEAL_POINTS  # noqa: E402
from observers.mirror.edge_process import EdgeProcessVectorStore  # noqa: E402
from observers.mirror.store import Point  # noqa: E402
from observers.recall import safe_filter  # noqa: E402

DIM = 384
BATCH = 200  # what the mirror observer writes at once
TRUST = ("verified", "unverified", "contradicted")


def unit_vectors(n: int, seed: int) -> np.ndarray:
    """Clustered unit vectors (real embeddings are not uniform): 64 centres, noise around each."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((64, DIM), dtype=np.float32)
    v = rng.standard_normal((n, DIM), dtype=np.float32)  # float32 throughout: 1.5 GB at a million points, not 6
    v *= 0.6
    v += centres[rng.integers(0, 64, n)]
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return v


def payload(i: int) -> dict[str, Any]:
    return {
        "project": f"p{i % 4}",
        "kind": "finding",
        "lifecycle": "active" if i % 7 else "resolved",
        "trust": TRUST[i % 3],
        "resolution": None,
        "text": f"claim {i} " + "x" * 60,
    }


def safe_mask(n: int) -> np.ndarray:
    """Which points the safe door may return for project p1: active, and not contradicted."""
    i = np.arange(n)
    mask: np.ndarray = (i % 4 == 1) & (i % 7 != 0) & (i % 3 != 2)
    return mask


def anonymous_bytes(pid: int) -> int:
    """A process's anonymous memory (heap, not pages of mapped files, which the kernel can drop)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/smaps_rollup has no Anonymous line")


async def loop_gaps(stop: asyncio.Event, tick_s: float = 0.01) -> float:
    """The longest time the event loop was late until `stop` is set, in ms."""
    worst = 0.0
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(tick_s)
        worst = max(worst, time.perf_counter() - start - tick_s)
    return worst * 1000


async def run(root: Path, points: int, queries: int, seal_points: int) -> dict[str, Any]:
    drawn = unit_vectors(points + queries, seed=points)  # queries near the points, as real questions are
    vectors, probes = drawn[:points], drawn[points:]
    me = psutil.Process()
    rss_before = me.memory_info().rss
    store = await EdgeProcessVectorStore.open(root / "mirror", "bench/random", DIM, seal_points=seal_points)
    engine = psutil.Process(store._process.pid if store._process else 0)
    try:
        writing = asyncio.Event()
        gaps = asyncio.create_task(loop_gaps(writing))
        started = time.perf_counter()
        for offset in range(0, points, BATCH):
            end = min(points, offset + BATCH)
            await store.upsert(
                [Point(uuid.UUID(int=i + 1), vectors[i].tolist(), payload(i)) for i in range(offset, end)]
            )
        written_s = time.perf_counter() - started
        await store.settle()  # the seals still under way, while the loop goes on as a node's would
        settled_s = time.perf_counter() - started
        writing.set()
        worst_gap_ms = await gaps
        where = safe_filter("p1", kinds=None, include_resolved=False)
        mask = safe_mask(points)
        allowed = np.flatnonzero(mask)
        first_waits = []  # the first queries after the seals: pages of new shards not read yet
        for probe in probes[: len(probes) // 3]:
            t = time.perf_counter()
            await store.search(probe.tolist(), where, limit=10)
            first_waits.append((time.perf_counter() - t) * 1000)
        # The store's queries first, then exact search: numpy's threads would otherwise still spin on the cores
        # while the engine answers the next query, which no node's engine has to share them with.
        waits, found = [], []
        for probe in probes:
            t = time.perf_counter()
            hits = await store.search(probe.tolist(), where, limit=10)
            waits.append((time.perf_counter() - t) * 1000)
            found.append({h.id.int - 1 for h in hits})
        exact_waits, overlap = [], []
        for probe, got in zip(probes, found, strict=True):
            t = time.perf_counter()
            scores = vectors[allowed] @ probe
            exact = allowed[np.argpartition(-scores, 10)[:10]]
            exact_waits.append((time.perf_counter() - t) * 1000)
            overlap.append(len(got & set(exact.tolist())) / 10)
        rss_after = me.memory_info().rss
        engine_rss = engine.memory_info().rss
        engine_anonymous = anonymous_bytes(engine.pid)
        layout = store.shard_states()
        seals = store.seals
    finally:
        await store.close()
    return {
        "points": points,
        "seal_points": seal_points,
        "first_p99_ms": round(percentile(first_waits, 0.99), 2),
        "p50_ms": round(percentile(waits, 0.5), 2),
        "p99_ms": round(percentile(waits, 0.99), 2),
        "exact_p50_ms": round(percentile(exact_waits, 0.5), 2),
        "exact_p99_ms": round(percentile(exact_waits, 0.99), 2),
        "recall_at_10": round(float(np.mean(overlap)), 4),
        "worst_loop_gap_ms": round(worst_gap_ms, 1),
        "rss_bytes_per_point": round((rss_after - rss_before) / points),
        "engine_rss_bytes_per_point": round(engine_rss / points),
        "engine_anonymous_bytes_per_point": round(engine_anonymous / points),
        "written_s": round(written_s, 1),
        "settled_s": round(settled_s, 1),
        "shards": layout,
        "seals": seals.sealed,
        "seal_failures": seals.failures,
        "last_seal_build_s": seals.last_build_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--seal-points", type=int, default=SEAL_POINTS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(run(Path(tmp), args.points, args.queries, args.seal_points))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    r = result
    print(f"{r['points']:,} points, sealed at {r['seal_points']:,}: shards {r['shards']}")
    print(f"  safe recall        p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms")
    print(f"  first after seals  p99 {r['first_p99_ms']} ms")
    print(f"  exact (numpy)      p50 {r['exact_p50_ms']} ms, p99 {r['exact_p99_ms']} ms")
    print(f"  recall@10          {r['recall_at_10']} of exact search's top 10")
    print(f"  longest loop gap   {r['worst_loop_gap_ms']} ms")
    unique = r["engine_anonymous_bytes_per_point"]
    print(f"  engine RSS         {r['engine_rss_bytes_per_point']:,} B/point ({unique:,} B/point anonymous)")
    print(f"  written, sealed    {r['written_s']} s, {r['settled_s']} s")
    print(f"  seals              {r['seals']} made, {r['seal_failures']} failed")


if __name__ == "__main__":
    main()
