"""Mirror benchmarks, each against a baseline measured in the same run.

    python bench/mirror.py [--texts 2000] [--sizes 20000,100000] [--queries 200] [--latency-events 50] [--json]

1. raw fastembed throughput on N event texts vs the mirror observer's end-to-end indexing (embed, upsert with
   the deterministic point id, payload) of the same N texts, read from the stream;
2. qdrant-edge vs qdrant-client local mode (in memory): upsert throughput and filtered top-10 query p50/p99 at
   each size (random unit vectors: this measures the stores, not the model);
3. publish -> recallable latency p50/p99 on a running node at a steady rate (one event every 100 ms)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import nats
from rich.console import Console
from rich.table import Table

from bus.broker.streams import ensure_streams
from bus.client.client import connect
from bus.host.server import NatsServer
from bus.intake.reader import replay
from bus.intake.runner import ConsumerRunner
from bus.model.ids import point_id
from bus.subjects import events_filter
from epibus.node.node import Node, NodeConfig
from observers.journal import Journal, JournalObserver
from observers.mirror.backends import open_store
from observers.mirror.embed import FastEmbedder
from observers.mirror.observer import MirrorObserver
from observers.mirror.store import Filter, Point

WORDS = [
    "cache",
    "deploy",
    "latency",
    "queue",
    "shard",
    "replica",
    "index",
    "backup",
    "certificate",
    "timeout",
    "retry",
    "pool",
    "socket",
    "lock",
    "migration",
    "schema",
    "tenant",
    "quota",
    "budget",
    "alert",
    "disk",
    "memory",
    "thread",
    "kernel",
    "driver",
    "network",
    "packet",
]


def texts(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [f"finding {i}: " + " ".join(rng.choice(WORDS) for _ in range(12)) for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def embed_vs_mirror(root: Path, n: int) -> list[dict[str, Any]]:
    corpus = texts(n)
    model = FastEmbedder(root / "home").load_blocking()
    await model.embed(texts(64, seed=99))  # warm the ONNX session up, so neither side pays for it
    start = time.perf_counter()
    await model.embed(corpus)
    raw_s = time.perf_counter() - start

    server = NatsServer(root / "nats")
    server.start()
    try:
        async with connect(server.url, agent="bench", home=root / "home", outbox=False) as client:
            project = f"b-{uuid.uuid4().hex[:8]}"
            events = [
                client.event(
                    "finding", {"text": t, "impact": 0.5, "confidence": 0.6, "subject": "bench"}, project=project
                )
                for t in corpus
            ]
            await client.publish_many(events, timeout_s=300)
        store = await open_store("edge", root / "mirror", model.model_id, model.dimension)
        journal = Journal(f"sqlite:///{root / 'journal.db'}")
        journal.migrate()
        nc = await nats.connect(server.url)
        await replay(nc.jetstream(), JournalObserver(journal))  # the mirror follows its journal; not timed
        observer = MirrorObserver(store, model, name="bench-mirror", journal=journal)  # uncached: embeds every text
        runner = ConsumerRunner(nc, observer, filter_subject=events_filter(project), batch_size=64)
        start = time.perf_counter()
        while observer.indexed < n:
            await runner.step()
        mirror_s = time.perf_counter() - start
        count = (await store.describe()).count
        await nc.close()
        await store.close()
        if count != n:
            raise SystemExit(f"benchmark invalid: the store holds {count} points, expected {n}")
    finally:
        server.stop()
        model.close()
    return [
        {"what": f"raw fastembed, {n} texts", "per_s": n / raw_s, "seconds": raw_s, "ratio": None},
        {
            "what": f"mirror observer end to end, {n} events",
            "per_s": n / mirror_s,
            "seconds": mirror_s,
            "ratio": raw_s / mirror_s,
        },
    ]


def unit_vectors(n: int, dim: int, seed: int) -> list[list[float]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    v = rng.standard_normal((n, dim)).astype("float32")
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return [list(map(float, row)) for row in v]


async def stores(root: Path, size: int, queries: int) -> list[dict[str, Any]]:
    rows = []
    vectors = unit_vectors(size, 384, seed=size)
    probes = unit_vectors(queries, 384, seed=1)
    for name, kind, location in (
        ("qdrant-edge", "edge", str(root / f"edge-{size}")),
        ("qdrant-client local (memory)", "server", ":memory:"),
    ):
        store = await open_store(kind, location, "bench/random", 384)
        start = time.perf_counter()
        for offset in range(0, size, 1000):
            batch = [
                Point(
                    uuid.uuid4(),
                    vectors[i],
                    {"project": f"p{i % 4}", "trust": "verified" if i % 3 else "unverified", "impact": (i % 10) / 10},
                )
                for i in range(offset, min(size, offset + 1000))
            ]
            await store.upsert(batch)
        upsert_s = time.perf_counter() - start
        where = Filter(equals={"project": "p1"}, none_of={"trust": ["unverified"]})
        latencies = []
        for probe in probes:
            t = time.perf_counter()
            await store.search(probe, where, limit=10)
            latencies.append((time.perf_counter() - t) * 1000)
        await store.close()
        rows.append(
            {
                "store": name,
                "points": size,
                "upsert_per_s": size / upsert_s,
                "query_p50_ms": percentile(latencies, 0.5),
                "query_p99_ms": percentile(latencies, 0.99),
                "queries": len(latencies),
            }
        )
    return rows


async def latency(root: Path, events_n: int) -> dict[str, Any]:
    server = NatsServer(root / "nats-latency")
    server.start()
    try:
        async with Node(
            NodeConfig(home=root / "node", nats_url=server.url, journal_url=f"sqlite:///{root / 'j.db'}")
        ) as node:
            assert node.store is not None
            nc = await nats.connect(server.url)
            await ensure_streams(nc.jetstream())
            await nc.close()
            waits = []
            async with connect(server.url, agent="bench", home=root / "client", outbox=False) as client:
                for i in range(events_n):
                    event = client.event(
                        "finding",
                        {
                            "text": f"latency probe {i}: " + " ".join(WORDS[i % 9 : i % 9 + 6]),
                            "impact": 0.5,
                            "confidence": 0.5,
                            "subject": "bench",
                        },
                        project="latency",
                    )
                    start = time.perf_counter()
                    await client.publish(event)
                    # The store tells no one when a point lands: polling it is the measurement.
                    while True:
                        if await node.store.retrieve([point_id(event.event_id)]):
                            break
                        await asyncio.sleep(0.005)
                    waits.append((time.perf_counter() - start) * 1000)
                    await asyncio.sleep(0.1)
    finally:
        server.stop()
    return {"events": events_n, "p50_ms": percentile(waits, 0.5), "p99_ms": percentile(waits, 0.99)}


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        embed_rows = await embed_vs_mirror(root / "embed", args.texts)
        store_rows = []
        for size in [int(s) for s in args.sizes.split(",")]:
            store_rows += await stores(root / "stores", size, args.queries)
        lat = await latency(root / "latency", args.latency_events)
    if args.json:
        print(json.dumps({"embedding": embed_rows, "stores": store_rows, "publish_to_recallable": lat}, default=float))
        return
    console = Console()
    t = Table(title="embedding: raw fastembed vs the mirror observer (ratio = raw time / mirror time)")
    for c in ("what", "per second", "seconds", "ratio"):
        t.add_column(c)
    for r in embed_rows:
        t.add_row(
            r["what"],
            f"{r['per_s']:,.0f}",
            f"{r['seconds']:.2f}",
            "baseline" if r["ratio"] is None else f"{r['ratio']:.2f}",
        )
    console.print(t)
    t = Table(title="vector stores (filtered top-10 queries)")
    for c in ("store", "points", "upserts/s", "query p50 ms", "query p99 ms"):
        t.add_column(c)
    for r in store_rows:
        t.add_row(
            r["store"],
            f"{r['points']:,}",
            f"{r['upsert_per_s']:,.0f}",
            f"{r['query_p50_ms']:.2f}",
            f"{r['query_p99_ms']:.2f}",
        )
    console.print(t)
    console.print(
        f"publish -> recallable ({lat['events']} events, one per 100 ms): "
        f"p50 {lat['p50_ms']:.0f} ms, p99 {lat['p99_ms']:.0f} ms"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--sizes", default="20000,100000")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--latency-events", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    asyncio.run(main(parser.parse_args()))
