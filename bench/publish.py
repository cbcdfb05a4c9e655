"""Publish and drain throughput, each against a baseline measured in the same run on the same nats-server.

    python bench/publish.py [-n 10000] [--json] [--sync always|default]

1. raw nats-py publish_async of N 200-byte messages (bounded in flight, every PubAck awaited)
   vs epibus publish_many of N events built, validated and signed in the timed section, without and with
   the outbox (SQLite, synchronous=FULL), and of N events each signed as built (`client.event`);
2. a raw pull-fetch-ack loop over N messages vs the journal observer (validate, verify signature, insert into
   SQLite, ack) over N events."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import nats
from nats.aio.client import Client as NatsClient
from nats.js.api import StorageType, StreamConfig
from rich.console import Console
from rich.table import Table

from bus.broker.streams import ensure_streams
from bus.client.client import connect
from bus.host.server import NatsServer
from bus.intake.runner import ConsumerRunner
from bus.subjects import events_filter
from observers.journal import Journal, JournalObserver

MAX_IN_FLIGHT = 512


async def raw_publish(js: nats.js.JetStreamContext, n: int) -> float:
    payload = b"x" * 200
    slots = asyncio.Semaphore(MAX_IN_FLIGHT)
    futures = []
    start = time.perf_counter()
    for i in range(n):
        await slots.acquire()
        future = await js.publish_async(f"bench.raw.{i % 16}", payload, headers={"Nats-Msg-Id": f"raw-{i}"})
        future.add_done_callback(lambda _: slots.release())
        futures.append(future)
    await asyncio.gather(*futures)
    return time.perf_counter() - start


async def epibus_publish(url: str, home: Path, project: str, n: int, *, outbox: bool, drafts: bool = True) -> float:
    """`drafts`: events built with `client.draft` and signed by publish_many in bulk; else each signed by
    `client.event` as it is built. Built, validated and signed inside the timed section either way."""
    async with connect(url, agent="bench", home=home, outbox=outbox, max_in_flight=MAX_IN_FLIGHT) as client:
        start = time.perf_counter()
        build = client.draft if drafts else client.event
        events = [
            build(
                "finding",
                {"text": f"finding {i} " + "x" * 40, "impact": 0.5, "confidence": 0.7, "subject": "bench"},
                project=project,
            )
            for i in range(n)
        ]
        receipts = await client.publish_many(events, timeout_s=600)
        elapsed = time.perf_counter() - start
    levels = {r.level.value for r in receipts}
    if levels != {"published"}:
        raise SystemExit(f"benchmark invalid: receipts reached {levels}, expected only 'published'")
    return elapsed


async def raw_drain(nc: NatsClient, n: int) -> float:
    js = nc.jetstream()
    sub = await js.pull_subscribe("bench.raw.>", durable="raw-drain", stream="BENCH")
    seen = 0
    start = time.perf_counter()
    while seen < n:
        try:
            messages = await sub.fetch(256, timeout=1)
        except TimeoutError:
            continue
        for msg in messages:
            await msg.ack()
        seen += len(messages)
    return time.perf_counter() - start


async def journal_drain(nc: NatsClient, journal_url: str, project: str, n: int) -> float:
    journal = Journal(journal_url)
    journal.migrate()
    observer = JournalObserver(journal, name=f"bench-{project}")
    runner = ConsumerRunner(nc, observer, filter_subject=events_filter(project), batch_size=256)
    start = time.perf_counter()
    while runner.stats.handled < n:
        await runner.step()
    elapsed = time.perf_counter() - start
    written = journal.count(project)
    journal.close()
    if written != n:
        raise SystemExit(f"benchmark invalid: journal holds {written} rows for {project}, expected {n}")
    return elapsed


async def main(n: int, as_json: bool, *, sync_always: bool = True) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = NatsServer(root / "nats", sync_always=sync_always)  # always: as deployed
        server.start()
        try:
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            await ensure_streams(js)
            await js.add_stream(
                StreamConfig(name="BENCH", subjects=["bench.>"], storage=StorageType.FILE, duplicate_window=600)
            )
            direct_project, outbox_project = f"b-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
            signed_project = f"b-{uuid.uuid4().hex[:8]}"
            raw_s = await raw_publish(js, n)
            direct_s = await epibus_publish(server.url, root / "home", direct_project, n, outbox=False)
            signed_s = await epibus_publish(server.url, root / "home", signed_project, n, outbox=False, drafts=False)
            outbox_s = await epibus_publish(server.url, root / "home", outbox_project, n, outbox=True)
            raw_drain_s = await raw_drain(nc, n)
            journal_s = await journal_drain(nc, f"sqlite:///{root / 'journal.db'}", direct_project, n)
            await nc.close()
        finally:
            server.stop()
    rows = [
        ("raw nats-py publish_async, 200 B", raw_s, None),
        ("epibus publish_many, no outbox", direct_s, raw_s),
        ("epibus publish_many of client.event, no outbox", signed_s, raw_s),
        ("epibus publish_many, outbox", outbox_s, raw_s),
        ("raw pull fetch + ack", raw_drain_s, None),
        ("journal observer (SQLite)", journal_s, raw_drain_s),
    ]
    results = [
        {
            "what": what,
            "n": n,
            "seconds": round(s, 3),
            "per_s": round(n / s),
            "ratio_vs_baseline": None if base is None else round(base / s, 3),
        }
        for what, s, base in rows
    ]
    if as_json:
        print(json.dumps({"n": n, "python": sys.version.split()[0], "results": results}))
        return
    table = Table(title=f"epibus publish/drain, N={n} (ratio = baseline time / this time)")
    for column in ("what", "events/s", "seconds", "ratio vs baseline"):
        table.add_column(column)
    for r in results:
        table.add_row(
            str(r["what"]),
            f"{r['per_s']:,}",
            f"{r['seconds']}",
            "baseline" if r["ratio_vs_baseline"] is None else f"{r['ratio_vs_baseline']:.2f}",
        )
    Console().print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=10_000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--sync", choices=("always", "default"), default="always", help="nats-server sync_interval (default: 2 min)"
    )
    args = parser.parse_args()
    asyncio.run(main(args.n, args.json, sync_always=args.sync == "always"))
