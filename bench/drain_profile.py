"""The journal observer's drain and the live publish -> journaled pipeline, each against the bare pipeline a
user would write over the same bytes, in one run on one nats-server; optionally where the drain's time goes.

    python bench/drain_profile.py [-n 10000] [--repeat 2] [--profile] [--live] [--json]

drain: N signed events (findings, and verifications of some by a second agent) are published once; then
  - bare: a pull consumer fetching 256 at a time, json.loads of each body, one executemany into SQLite
    (WAL, synchronous=FULL, as the journal), commit, ack each;
  - epibus: the journal observer on its runner (admission: decode, validation, subject, time, signature,
    registered key; the state projection; the journal rows), from the same messages.
live: the same N events published (gather of publish_async, bounded in flight) while the consumer drains,
  timed until the last is journaled: the bare pipeline vs epibus publish_many into a running journal runner.
--profile: cProfile of one epibus drain, in µs per event for the stages that matter."""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sqlite3
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

# Run as `python bench/drain_profile.py`: this folder must not shadow the packages (bench/mesh.py).
sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

import nats  # noqa: E402
from nats.aio.client import Client as NatsClient  # noqa: E402
from nats.js import JetStreamContext  # noqa: E402

from bus.broker.streams import ensure_streams  # noqa: E402
from bus.enrolment.registry import AgentRegistry  # noqa: E402
from bus.host.server import NatsServer  # noqa: E402
from bus.identity.signing import AgentKey, wire_message  # noqa: E402
from bus.intake.runner import ConsumerRunner  # noqa: E402
from bus.model.event import Envelope, draft_event  # noqa: E402
from bus.subjects import STREAM, events_filter  # noqa: E402
from observers.journal import Journal, JournalObserver  # noqa: E402

BATCH = 256
CPU: dict[str, float] = {}  # CPU seconds of this process (every thread) in the last drain of each kind
MAX_IN_FLIGHT = 512
VERIFY_EVERY = 10  # one event in ten verifies an earlier finding (a transition: the projection has work)


def make_events(author: AgentKey, reviewer: AgentKey, project: str, n: int) -> list[Envelope]:
    made: list[Envelope] = []
    for i in range(n):
        if i % VERIFY_EVERY == VERIFY_EVERY - 1:
            target = made[i - 1].artifact_id
            draft = draft_event(
                "verified",
                {"note": "checked"},
                project=project,
                actor=reviewer.actor,
                session_id="s",
                artifact_id=target,
            )
            made.append(reviewer.sign(draft))
            continue
        body = {"text": f"finding {i} " + "x" * 40, "impact": 0.5, "confidence": 0.7, "subject": "bench"}
        made.append(author.sign(draft_event("finding", body, project=project, actor=author.actor, session_id="s")))
    return made


async def publish_all(js: JetStreamContext, events: list[Envelope]) -> None:
    slots = asyncio.Semaphore(MAX_IN_FLIGHT)
    futures = []
    for event in events:
        wire = wire_message(event)
        await slots.acquire()
        headers = {**wire.headers, "Nats-Msg-Id": str(event.event_id)}
        future = await js.publish_async(wire.subject, wire.data, headers=headers)
        future.add_done_callback(lambda _: slots.release())
        futures.append(future)
    await asyncio.gather(*futures)


BARE_SCHEMA = """CREATE TABLE IF NOT EXISTS events (event_id TEXT PRIMARY KEY, stream_seq INTEGER, subject TEXT,
project TEXT, kind TEXT, artifact_id TEXT, actor_id TEXT, recorded_at TEXT, envelope TEXT)"""


def bare_db(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute(BARE_SCHEMA)
    db.commit()
    return db


async def bare_drain(js: JetStreamContext, db: sqlite3.Connection, project: str, n: int) -> float:
    """fetch + json + sqlite executemany + ack: what a user would write without any checks."""
    sub = await js.pull_subscribe(events_filter(project), durable=f"bare-{uuid.uuid4().hex[:8]}", stream=STREAM)
    seen = 0
    start, cpu = time.perf_counter(), time.process_time()
    while seen < n:
        try:
            messages = await sub.fetch(BATCH, timeout=1)
        except TimeoutError:
            continue
        rows = []
        for msg in messages:
            e = json.loads(msg.data)
            rows.append(
                (
                    e["event_id"],
                    msg.metadata.sequence.stream,
                    msg.subject,
                    e["project"],
                    e["kind"],
                    e["artifact_id"],
                    e["actor"]["agent_id"],
                    e["recorded_at"],
                    msg.data.decode(),
                )
            )
        db.executemany("INSERT OR IGNORE INTO events VALUES (?,?,?,?,?,?,?,?,?)", rows)
        db.commit()
        for msg in messages:
            await msg.ack()
        seen += len(messages)
    elapsed = time.perf_counter() - start
    CPU["bare"] = time.process_time() - cpu
    await sub.unsubscribe()
    return elapsed


async def epibus_drain(nc: NatsClient, journal: Journal, project: str, n: int) -> float:
    observer = JournalObserver(journal, name=f"bench-{uuid.uuid4().hex[:8]}")
    runner = ConsumerRunner(nc, observer, filter_subject=events_filter(project), batch_size=BATCH)
    start, cpu = time.perf_counter(), time.process_time()
    while runner.stats.handled + sum(runner.stats.dead_lettered.values()) < n:
        await runner.step()
    elapsed = time.perf_counter() - start
    CPU["epibus"] = time.process_time() - cpu
    if runner.stats.dead_lettered:
        raise SystemExit(f"benchmark invalid: dead letters {runner.stats.dead_lettered}")
    return elapsed


async def setup(url: str, n: int) -> tuple[str, list[Envelope], AgentKey, AgentKey]:
    author, reviewer = AgentKey.generate(f"a-{uuid.uuid4().hex[:6]}"), AgentKey.generate(f"r-{uuid.uuid4().hex[:6]}")
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_streams(js)
    registry = AgentRegistry(js)
    for key in (author, reviewer):
        await registry.bind(key.actor)
    project = f"b-{uuid.uuid4().hex[:8]}"
    events = make_events(author, reviewer, project, n)
    await nc.close()
    return project, events, author, reviewer


async def drain_round(url: str, root: Path, n: int, profile: bool) -> dict[str, Any]:
    project, events, _, _ = await setup(url, n)
    nc = await nats.connect(url)
    js = nc.jetstream()
    await publish_all(js, events)
    tag = uuid.uuid4().hex[:6]
    db = bare_db(root / f"bare-{tag}.db")
    bare_s = await bare_drain(js, db, project, n)
    db.close()
    journal = Journal(f"sqlite:///{root / f'journal-{tag}.db'}")
    journal.migrate()
    profiler = cProfile.Profile() if profile else None
    to_thread = asyncio.to_thread
    if profiler is not None:
        asyncio.to_thread = inline  # cProfile sees only its own thread
        profiler.enable()
    try:
        epibus_s = await epibus_drain(nc, journal, project, n)
    finally:
        if profiler is not None:
            profiler.disable()
        asyncio.to_thread = to_thread
    written = journal.count(project)
    journal.close()
    await nc.close()
    if written != n:
        raise SystemExit(f"benchmark invalid: journal holds {written} rows, expected {n}")
    result: dict[str, Any] = {
        "bare_per_s": round(n / bare_s),
        "epibus_per_s": round(n / epibus_s),
        "ratio": round(bare_s / epibus_s, 3),
        "bare_cpu_us": round(CPU["bare"] / n * 1e6, 1),
        "epibus_cpu_us": round(CPU["epibus"] / n * 1e6, 1),
        "cpu_ratio": round(CPU["bare"] / CPU["epibus"], 3),
    }
    if profiler is not None:
        result["profile_us_per_event"] = stages(profiler, n)
        profiler.dump_stats(str(Path(tempfile.gettempdir()) / "drain.prof"))
    return result


async def inline(func: Any, /, *args: Any, **kwargs: Any) -> Any:
    return func(*args, **kwargs)


async def live_round(url: str, root: Path, n: int) -> dict[str, Any]:
    """Publish while the consumer drains; timed from the first publish to the last event journaled."""
    project, events, _, _ = await setup(url, n)
    tag = uuid.uuid4().hex[:6]
    nc = await nats.connect(url)
    js = nc.jetstream()
    db = bare_db(root / f"live-bare-{tag}.db")
    start = time.perf_counter()
    drain = asyncio.create_task(bare_drain(js, db, project, n))
    await publish_all(js, events)
    await drain
    bare_s = time.perf_counter() - start
    db.close()
    project2, events2, _, _ = await setup(url, n)
    journal = Journal(f"sqlite:///{root / f'live-journal-{tag}.db'}")
    journal.migrate()
    start = time.perf_counter()
    drain2 = asyncio.create_task(epibus_drain(nc, journal, project2, n))
    await publish_all(js, events2)
    await drain2
    epibus_s = time.perf_counter() - start
    written = journal.count(project2)
    journal.close()
    await nc.close()
    if written != n:
        raise SystemExit(f"benchmark invalid: journal holds {written} rows, expected {n}")
    return {"bare_per_s": round(n / bare_s), "epibus_per_s": round(n / epibus_s), "ratio": round(bare_s / epibus_s, 3)}


# (label, function-name match) for the profile summary: cumulative µs per event.
STAGES = (
    ("runner.process (all but fetch)", "runner.py", "process"),
    ("admission (admit_msg)", "admission.py", "admit_msg"),
    ("  decode_event", "event.py", "decode_event"),
    ("  verify_message", "signing.py", "verify_message"),
    ("  ed25519 verify", "signing.py", "verify"),
    ("batch context (attach)", "admission.py", "attach"),
    ("Journal.write (thread)", "journal.py", "write"),
    ("  _row", "journal.py", "_row"),
    ("  Delivery.digest", "admission.py", "digest"),
    ("  project_deliveries", "projection.py", "project_deliveries"),
    ("    BatchState.__init__", "projection.py", "__init__"),
    ("    decide", "state.py", "decide"),
    ("    flush", "projection.py", "flush"),
    ("ack", "msg.py", "ack"),
    ("fetch", "js/client.py", "fetch"),
)


def stages(profiler: cProfile.Profile, n: int) -> dict[str, float]:
    stats = pstats.Stats(profiler)
    found: dict[str, float] = {}
    for label, file, name in STAGES:
        total = 0.0
        for (path, _line, func), row in stats.stats.items():  # type: ignore[attr-defined]
            if func == name and path.endswith(file):
                total += row[3]  # cumulative time
        found[label] = round(total / n * 1e6, 1)
    return found


async def main(n: int, repeat: int, profile: bool, live: bool, as_json: bool) -> None:
    results: dict[str, Any] = {"n": n, "drain": [], "live": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = NatsServer(root / "nats")
        server.start()
        try:
            for i in range(repeat):
                results["drain"].append(await drain_round(server.url, root, n, profile and i == repeat - 1))
                if live:
                    results["live"].append(await live_round(server.url, root, n))
        finally:
            server.stop()
    if as_json:
        print(json.dumps(results, indent=2))
        return
    for r in results["drain"]:
        print(
            f"drain: bare {r['bare_per_s']:,}/s  epibus {r['epibus_per_s']:,}/s  ratio {r['ratio']:.3f}  "
            f"(CPU µs/event: bare {r['bare_cpu_us']}, epibus {r['epibus_cpu_us']}, ratio {r['cpu_ratio']:.3f})"
        )
        for label, us in r.get("profile_us_per_event", {}).items():
            print(f"    {label:34} {us:8.1f} µs/event (cProfile, inflated)")
    for r in results["live"]:
        print(f"live:  bare {r['bare_per_s']:,}/s  epibus {r['epibus_per_s']:,}/s  ratio {r['ratio']:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--live", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    asyncio.run(main(args.n, args.repeat, args.profile, args.live, args.json))
