"""The rows of `python -m bench`, each against a fresh nats-server, each epibus figure next to a baseline measured
in the same run on the same server. Only public entry points of bus, observers, mesh and epibus are used."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NatsClient
from nats.js.api import StorageType, StreamConfig

from bench import mesh_handshake, mirror, publish, sealed
from bench.harness import Line, Sizes, fresh_server, latency, percentile, throughput, wait_for_count
from bench.watch import row_watch
from bus.broker.streams import ensure_streams
from bus.client.client import EpibusClient, connect
from bus.subjects import STREAM, events_filter
from epibus.node.node import Node, NodeConfig
from observers.mirror.edge import SEAL_POINTS
from observers.recall import recall

BATCH = 256
# FastStream's default PubAck timeout (0.5 s) fails a gather of thousands of publishes on a busy 2-core machine
# (nats: timeout); a user raises it, as epibus's publish_many waits for its PubAcks up to its own timeout.
PUBLISH_TIMEOUT_S = 60.0


def finding(i: int) -> dict[str, Any]:
    return {
        "text": f"finding {i}: " + " ".join(mirror.WORDS[(i + j) % len(mirror.WORDS)] for j in range(8)),
        "impact": 0.5,
        "confidence": 0.7,
        "subject": "bench",
    }


def project_name() -> str:
    return f"b-{uuid.uuid4().hex[:10]}"


async def publish_findings(client: EpibusClient, project: str, n: int) -> list[uuid.UUID]:
    events = [client.event("finding", finding(i), project=project) for i in range(n)]
    receipts = []
    for offset in range(0, n, 5_000):  # bounded batches: a receipt list per batch, not one of 100k futures
        receipts += await client.publish_many(events[offset : offset + 5_000], timeout_s=600)
    levels = {r.level.value for r in receipts}
    if levels != {"published"}:
        raise RuntimeError(f"benchmark invalid: receipts reached {levels}, expected only 'published'")
    return [e.event_id for e in events]


# (1) live publish -> journaled ---------------------------------------------------------------------------------


async def faststream_pipeline(url: str, root: Path, n: int) -> tuple[float, dict[str, Any]]:
    """What a user builds from FastStream's documentation: gather publish, a batch pull subscriber,
    SQLAlchemy executemany into SQLite."""
    from faststream.nats import JStream, NatsBroker, PullSub
    from sqlalchemy import Column, MetaData, String, Table, Text, create_engine, func, insert, select

    engine = create_engine(f"sqlite:///{root / 'faststream.db'}")
    meta = MetaData()
    events = Table(
        "events",
        meta,
        Column("event_id", String, primary_key=True),
        Column("project", String),
        Column("kind", String),
        Column("body", Text),
    )
    meta.create_all(engine)
    broker = NatsBroker(url, logger=None)  # its per-message log lines would be in the timed section
    stream = JStream("FSBENCH", subjects=["fsbench.>"])

    @broker.subscriber(
        "fsbench.events", stream=stream, durable="fs-journal", pull_sub=PullSub(batch_size=BATCH, batch=True)
    )
    async def journal(batch: list[dict[str, Any]]) -> None:
        with engine.begin() as conn:
            conn.execute(
                insert(events),
                [
                    {
                        "event_id": e["event_id"],
                        "project": e["project"],
                        "kind": e["kind"],
                        "body": json.dumps(e["body"]),
                    }
                    for e in batch
                ],
            )

    async def count() -> int:
        with engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(events)).scalar_one())

    await broker.start()
    try:
        start = time.perf_counter()
        messages = [
            {"event_id": str(uuid.uuid4()), "project": "fs", "kind": "finding", "body": finding(i)} for i in range(n)
        ]
        await asyncio.gather(
            *(broker.publish(m, "fsbench.events", stream="FSBENCH", timeout=PUBLISH_TIMEOUT_S) for m in messages)
        )
        waited = await wait_for_count(count, n, start=start, deadline_s=60 + n / 100)
    finally:
        await broker.stop()
        engine.dispose()
    return waited.seconds, {"stalls": waited.stalls, "reached": waited.reached, "finished": waited.finished}


async def epibus_live(url: str, root: Path, n: int) -> tuple[float, dict[str, Any]]:
    config = NodeConfig(home=root / "node", nats_url=url, journal_url=f"sqlite:///{root / 'journal.db'}", mirror="off")
    async with Node(config) as node, connect(url, agent="bench", home=root / "home", outbox=False) as client:
        journal = node.journal
        if journal is None:
            raise RuntimeError("the node runs no journal")
        project = project_name()

        async def count() -> int:
            return journal.count(project)

        start = time.perf_counter()
        await publish_findings(client, project, n)
        waited = await wait_for_count(count, n, start=start, deadline_s=60 + n / 100)
    return waited.seconds, {"stalls": waited.stalls, "reached": waited.reached, "finished": waited.finished}


async def row_live(root: Path, sizes: Sizes) -> list[Line]:
    n = sizes.events
    with fresh_server(root) as server:
        fs_s, fs_details = await faststream_pipeline(server.url, root, n)
        epi_s, epi_details = await epibus_live(server.url, root, n)
    details = {"n": n, "epibus": epi_details, "faststream": fs_details}
    line = throughput(
        "live",
        f"publish → journaled (node in-process), {n} events",
        epi_details["reached"] / epi_s,
        "FastStream: gather publish, batch pull, SQLAlchemy executemany",
        fs_details["reached"] / fs_s,
        target=1.0,
        details=details,
    )
    sides = {"epibus": epi_details["stalls"], "FastStream": fs_details["stalls"]}
    line.details["stalls"] = {side: gaps for side, gaps in sides.items() if gaps} or None
    # Shown beside the measured ratio, never instead of it: what FastStream would do without its stalls.
    fs_busy = fs_s - sum(fs_details["stalls"])
    busy_rate = fs_details["reached"] / fs_busy if fs_busy > 0 else None
    line.details["faststream_per_s_without_stalls"] = busy_rate
    # The target holds only against FastStream less its stalls too, and only if epibus itself never stalled.
    net = None if busy_rate is None or line.epibus is None else line.epibus / busy_rate
    line.details["ratio_vs_faststream_without_stalls"] = net
    if (
        not (epi_details["finished"] and fs_details["finished"])
        or epi_details["stalls"]
        or (net is not None and net < 1)
    ):
        line.met = False
    return [line]


# (2) journal observer drain ------------------------------------------------------------------------------------


async def fetch_loop(
    nc: NatsClient, subject: str, durable: str, n: int, handle: Callable[[list[Any]], Awaitable[None]]
) -> float:
    sub = await nc.jetstream().pull_subscribe(subject, durable=durable, stream=STREAM)
    seen, start = 0, time.perf_counter()
    while seen < n:
        if time.perf_counter() - start > 60 + n / 100:
            raise RuntimeError(f"{durable}: {seen} of {n} messages after the deadline")
        try:
            messages = await sub.fetch(BATCH, timeout=1)
        except TimeoutError:
            continue
        await handle(messages)
        seen += len(messages)
    return time.perf_counter() - start


async def row_drain(root: Path, sizes: Sizes) -> list[Line]:
    n = sizes.events
    with fresh_server(root) as server:
        async with connect(server.url, agent="bench", home=root / "home", outbox=False) as client:
            project = project_name()
            await publish_findings(client, project, n)
        nc = await nats.connect(server.url)
        try:
            subject = events_filter(project)

            async def ack_only(messages: list[Any]) -> None:
                for msg in messages:
                    await msg.ack()

            db = sqlite3.connect(root / "bare.db")
            db.execute("CREATE TABLE events (event_id TEXT PRIMARY KEY, project TEXT, kind TEXT, envelope TEXT)")

            async def json_sqlite(messages: list[Any]) -> None:
                rows = []
                for msg in messages:
                    event = json.loads(msg.data)
                    rows.append((event["event_id"], event["project"], event["kind"], msg.data.decode()))
                db.executemany("INSERT OR IGNORE INTO events VALUES (?, ?, ?, ?)", rows)
                db.commit()
                for msg in messages:
                    await msg.ack()

            raw_s = await fetch_loop(nc, subject, "raw-ack", n, ack_only)
            bare_s = await fetch_loop(nc, subject, "raw-json-sqlite", n, json_sqlite)
            db.close()
            journal_s = await publish.journal_drain(nc, f"sqlite:///{root / 'journal.db'}", project, n)
        finally:
            await nc.close()
    what = f"journal observer drain, {n} events"
    return [
        throughput("drain", what, n / journal_s, "fetch + json + sqlite executemany + ack", n / bare_s, target=0.6),
        throughput("drain", what, n / journal_s, "raw fetch + ack", n / raw_s, target=None),
    ]


# (3) signed, validated publish_many ----------------------------------------------------------------------------


async def row_publish(root: Path, sizes: Sizes) -> list[Line]:
    n = sizes.events
    with fresh_server(root) as server:
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            await ensure_streams(js)
            await js.add_stream(
                StreamConfig(name="BENCH", subjects=["bench.>"], storage=StorageType.FILE, duplicate_window=600)
            )
            raw_s = await publish.raw_publish(js, n)
        finally:
            await nc.close()
        epi_s = await publish.epibus_publish(server.url, root / "home", project_name(), n, outbox=False)
    return [
        throughput(
            "publish",
            f"publish_many, signed + validated, no outbox, {n} events",
            n / epi_s,
            "raw nats-py publish_async (200 B, PubAcks awaited)",
            n / raw_s,
            target=0.6,
        )
    ]


# (4) mirror observer --------------------------------------------------------------------------------------------


async def row_mirror(root: Path, sizes: Sizes) -> list[Line]:
    raw, observer = await mirror.embed_vs_mirror(root, sizes.mirror_texts)  # a server of its own, stopped inside
    return [throughput("mirror", observer["what"], observer["per_s"], raw["what"], raw["per_s"], target=0.9)]


# (5) recall -----------------------------------------------------------------------------------------------------


async def row_recall(root: Path, sizes: Sizes) -> list[Line]:
    queries = [" ".join(random.Random(i).sample(mirror.WORDS, 3)) for i in range(sizes.recalls)]
    with fresh_server(root) as server:
        config = NodeConfig(home=root / "node", nats_url=server.url, journal_url=f"sqlite:///{root / 'journal.db'}")
        async with Node(config) as node, connect(server.url, agent="bench", home=root / "home", outbox=False) as client:
            if node.store is None or node.embedder is None:
                raise RuntimeError("the node runs no mirror")
            node.freeze_heap()  # as `epibus up` does: this process runs the node
            project = project_name()
            ids = await publish_findings(client, project, sizes.recall_events)
            # Watched from when the client is done (it builds and signs on this loop too) until all is indexed.
            indexing = asyncio.Event()
            gaps = asyncio.create_task(sealed.loop_gaps(indexing))
            try:
                await client.wait_indexed(ids, timeout_s=120 + sizes.recall_events / 50)
            finally:
                indexing.set()
            worst_gap_ms = await gaps
            remote, local = [], []
            for q in queries:
                t = time.perf_counter()
                answer = await client.recall(q, project)
                remote.append((time.perf_counter() - t) * 1000)
                t = time.perf_counter()
                result = await recall(node.store, node.embedder, q, project)
                local.append((time.perf_counter() - t) * 1000)
            if not answer.hits or not result.hits:
                raise RuntimeError("benchmark invalid: a recall found nothing in an indexed project")
    safe = await sealed.run(root / "store", sizes.safe_points, sizes.safe_queries, SEAL_POINTS)
    n = sizes.recall_events
    return [
        *await scale_recall(root, sizes),
        *[
            latency(
                "recall",
                f"recall from a client, p50, {n} points",
                percentile(remote, 0.5),
                "the same recall in-process, p50",
                percentile(local, 0.5),
                limit_ms=None,
            ),
            latency(
                "recall",
                f"recall from a client, p99, {n} points",
                percentile(remote, 0.99),
                "the same recall in-process, p99",
                percentile(local, 0.99),
                limit_ms=50,
            ),
            latency(
                "recall",
                f"safe recall in the store, p99, {sizes.safe_points} points in sealed shards "
                f"(recall@10 {safe['recall_at_10']} of exact)",
                safe["p99_ms"],
                "exact search (numpy, same filter), p99",
                safe["exact_p99_ms"],
                limit_ms=10,
                details=safe,
            ),
            latency(
                "recall",
                f"longest event-loop gap while {sizes.safe_points} points are written and sealed",
                safe["worst_loop_gap_ms"],
                "—",
                None,
                limit_ms=100,
            ),
            latency(
                "recall",
                f"longest event-loop gap in the node's process while its mirror indexes {n} events",
                worst_gap_ms,
                "—",
                None,
                limit_ms=100,
            ),
        ],
    ]


async def scale_recall(root: Path, sizes: Sizes) -> list[Line]:
    """Safe recall at `scale_points` (a million in `--full`), in the engine a node runs."""
    if not sizes.scale_points:
        return []
    at = await sealed.run(root / "scale", sizes.scale_points, sizes.safe_queries, SEAL_POINTS)
    return [
        latency(
            "recall",
            f"safe recall in the store, p99, {sizes.scale_points:,} points in sealed shards "
            f"(recall@10 {at['recall_at_10']} of exact; the engine's own memory "
            f"{at['engine_anonymous_bytes_per_point']} B/point)",
            at["p99_ms"],
            "exact search (numpy, same filter), p99",
            at["exact_p99_ms"],
            limit_ms=10,
            details=at,
        ),
        latency(
            "recall",
            f"longest event-loop gap while {sizes.scale_points:,} points are written and sealed",
            at["worst_loop_gap_ms"],
            "—",
            None,
            limit_ms=100,
        ),
    ]


# (6) a state change at a small and at a large project -----------------------------------------------------------


def cli_verify(url: str, home: Path, project: str, artifact_id: str) -> float:
    command = [
        sys.executable,
        "-m",
        "epibus",
        "verify",
        artifact_id,
        "--project",
        project,
        "--nats",
        url,
        "--agent",
        "bob",
        "--home",
        str(home),
        "--json",
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=os.environ | {"NO_COLOR": "1"})
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"`epibus verify` failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return elapsed


async def row_state(root: Path, sizes: Sizes) -> list[Line]:
    with fresh_server(root) as server:
        async with connect(server.url, agent="alice", home=root / "alice", outbox=False) as alice:
            small, large = project_name(), project_name()
            small_ids = await publish_findings(alice, small, sizes.state_small)
            large_ids = await publish_findings(alice, large, sizes.state_large)
        timings: dict[str, list[float]] = {"api small": [], "api large": [], "cli small": [], "cli large": []}
        async with connect(server.url, agent="bob", home=root / "bob", outbox=False) as bob:
            for i in range(sizes.state_repeats):
                for size, project, ids in (("small", small, small_ids), ("large", large, large_ids)):
                    start = time.perf_counter()
                    await bob.transition("verified", {"note": "bench"}, project=project, artifact_id=str(ids[i]))
                    timings[f"api {size}"].append(time.perf_counter() - start)
        for i in range(sizes.cli_repeats):
            for size, project, ids in (("small", small, small_ids), ("large", large, large_ids)):
                aid = str(ids[sizes.state_repeats + i])
                timings[f"cli {size}"].append(
                    await asyncio.to_thread(cli_verify, server.url, root / "bob", project, aid)
                )
    lines = []
    for door in ("api", "cli"):
        s, big = statistics.median(timings[f"{door} small"]), statistics.median(timings[f"{door} large"])
        what = "client.transition('verified')" if door == "api" else "`epibus verify ARTIFACT` (a process)"
        lines.append(
            Line(
                "state",
                f"{what} at {sizes.state_large} events",
                "s",
                big,
                s,
                f"the same at {sizes.state_small} events",
                big / s,
                "large / small",
                "≤ 1.2",
                big / s <= 1.2,
                {"seconds": timings},
            )
        )
    return lines


# (7) mesh handshakes --------------------------------------------------------------------------------------------


async def row_mesh(root: Path, sizes: Sizes) -> list[Line]:
    lines = []
    for peers, tasks, in_flight in sizes.mesh:
        where = root / f"peers-{peers}"
        with fresh_server(where) as server:
            raw_s, raw_lat = await mesh_handshake.raw_handshakes(server.url, peers, tasks, in_flight)
            epi_s, epi_lat = await mesh_handshake.epibus_handshakes(server.url, where / "home", peers, tasks, in_flight)
        details = {
            "tasks_per_peer": tasks,
            "in_flight_per_peer": in_flight,
            "epibus_p50_ms": 1000 * statistics.median(epi_lat),
            "epibus_p99_ms": 1000 * percentile(epi_lat, 0.99),
            "raw_p50_ms": 1000 * statistics.median(raw_lat),
        }
        lines.append(
            throughput(
                "mesh",
                f"mesh handshakes, {peers} peers + coordinator (node in-process)",
                len(epi_lat) / epi_s,
                "raw KV create + 4 CAS",
                len(raw_lat) / raw_s,
                target=0.25,
                unit="/s",
                details=details,
            )
        )
    return lines


# (8) a node catching up, with and without the fleet's shared vectors ------------------------------------------


async def catch_up(server_url: str, home: Path, n: int) -> tuple[float, Node]:
    """Start a node on `home` and time it from start until its mirror has indexed `n` claims."""
    config = NodeConfig(home=home, nats_url=server_url, journal_url=f"sqlite:///{home / 'journal.db'}")
    start = time.perf_counter()
    async with Node(config) as node:
        deadline = start + 120 + n / 10
        while node.mirror is None or node.mirror.indexed < n:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"benchmark invalid: {home.name} indexed {node.mirror and node.mirror.indexed}")
            await asyncio.sleep(0.05)
        return time.perf_counter() - start, node


def model_texts(node: Node) -> int:
    """Texts the node's model embedded (the fleet and the cache answered the others)."""
    fleet = node.embedder.inner if node.embedder is not None else None
    model = getattr(fleet, "model", None)
    return int(getattr(model, "texts_embedded", -1))


async def row_catch_up(root: Path, sizes: Sizes) -> list[Line]:
    n = sizes.catch_up
    with fresh_server(root) as server:
        async with connect(server.url, agent="bench", home=root / "home", outbox=False) as client:
            await publish_findings(client, project_name(), n)
        first_s, first = await catch_up(server.url, root / "first", n)
        second_s, second = await catch_up(server.url, root / "second", n)
    embedded = {"first node": model_texts(first), "second node": model_texts(second)}
    checks = 1 + n // 64  # the first vector of the one signer, then one in 64
    return [
        throughput(
            "catch-up",
            f"a second node catching up on {n} claims the first shared (start to all indexed)",
            n / second_s,
            "the first node, embedding every claim",
            n / first_s,
            target=None,
            details={"texts_embedded": embedded},
        ),
        Line(
            "catch-up",
            "texts the second node's model embedded (a fleet embeds a text once)",
            "texts",
            float(embedded["second node"]),
            float(embedded["first node"]),
            "texts the first node's model embedded",
            None,
            "—",
            f"≤ {checks} (its checks)",
            0 <= embedded["second node"] <= checks,
        ),
    ]


ROWS: dict[str, Callable[[Path, Sizes], Awaitable[list[Line]]]] = {
    "live": row_live,
    "drain": row_drain,
    "publish": row_publish,
    "mirror": row_mirror,
    "recall": row_recall,
    "state": row_state,
    "mesh": row_mesh,
    "catch-up": row_catch_up,
    "watch": row_watch,
}
