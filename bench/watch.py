"""The `watch` row of `python -m bench`: semantic watch at the load the feature is built for. One node (in this
process) on a fresh server holds `sizes.watches` standing questions (agents of 32 watches each, the per-agent
limit), registered through its watch service as an agent does:

- claims are published at 200 a second into the watched project, and each notice is timed from its claim's publish
  to its arrival at a reader of the notices' stream (p50/p99, target p99 ≤ 1 s);
- the node's mirror ingest is timed for bursts of claims into the watched project and into a project nobody
  watches, alternately (ABBA, so a drift over the run cancels): the ratio watched / unwatched, target ≥ 0.85;
- the paraphrase pairs the recall tests use are watched in one set of words and claimed in the other: precision
  and recall of what is pushed at the default threshold, every claim against every watch."""

from __future__ import annotations

import asyncio
import bisect
import random
import time
import uuid
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from bench.harness import Line, Sizes, fresh_server, latency, percentile, throughput
from bench.mirror import WORDS
from bus.client.client import EpibusClient, connect
from bus.client.watch import decode_notice
from bus.model.watch import DEFAULT_THRESHOLD, MAX_WATCHES_PER_AGENT
from bus.subjects import WATCH_STREAM
from epibus.node.node import Node, NodeConfig
from tests.observers.test_mirror import TOPICS

CLAIMS_PER_S = 200.0
# One claim in this many repeats a watch's words. It reaches that watch and every other whose words score above
# the threshold against it (the row reports how many: short texts of the same shape score 0.2-0.5 with the
# default model, so one such claim reaches hundreds of 1,000 watches at the default threshold).
OWN_WORDS_EVERY = 50
LATENCY_LIMIT_MS = 1_000.0
INGEST_TARGET = 0.85
SETTLE_S = 120.0  # bound on waiting for the node to index a burst, or for the last notices
# Words of many trades, none of them the tech words the claims are made of: the watches are distinct questions, as
# a thousand agents' would be, not one question asked a thousand ways.
NOUNS = """
anchor apricot archive atlas autumn badger bakery ballad banjo barley basil beacon beetle bicycle biscuit blanket
bridge bronze buckle butter cabin cactus canal candle canyon carpet carrot castle cathedral cedar cello chapel
cherry chimney cinnamon clarinet cliff clover comet compass copper coral cottage cotton crayon cricket crystal
cypress dagger daisy dolphin dragonfly drum eagle easel eclipse elbow emerald fabric falcon fern ferry fiddle fig
flannel flute fossil fountain fox gallery garlic garnet geyser ginger glacier goblet gondola granite grape
greenhouse guitar hammock harbor harp hazel hedgehog helmet honey horizon iceberg ivory jasmine jelly kayak kettle
kiln lagoon lantern lavender lemon library lighthouse lily linen lobster locket loom lute magnet mango maple marble
meadow melon meteor mill mint mirror monastery mosaic moss mountain mustard nectar needle nutmeg oak oasis olive
opal orchard orchid otter owl oyster paddle palace pansy parrot pasta peach pearl pebble pelican pepper piano
pigeon pine plum pottery prairie quarry quill quilt rabbit radish raft raven reef ribbon river robin saddle
saffron sailboat salmon sandal satchel scarf sculpture shell sherbet silk sparrow spinach spruce squirrel statue
stirrup strawberry sunflower swan tambourine tapestry teapot telescope thistle thunder tiger timber tortoise
trumpet tulip turnip valley vanilla velvet vineyard violin volcano walnut walrus waterfall wheat whistle willow
windmill wolf yarn zebra
""".split()  # noqa: SIM905 - a block of words reads better than a list of strings


def watch_texts(n: int, seed: int = 11) -> list[str]:
    """`n` distinct standing questions of four words each, drawn from NOUNS."""
    rng = random.Random(seed)
    texts: dict[str, None] = {}
    while len(texts) < n:
        a, b, c, d = rng.sample(NOUNS, 4)
        texts[f"{a} {b} {c} {d}"] = None
    return list(texts)


def claim_text(i: int, salt: str) -> str:
    """A claim in the words of the stream the other rows publish: mostly unlike every watch, as most claims are."""
    return f"{salt} finding {i}: " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(9))


def finding(client: EpibusClient, text: str, project: str) -> Any:
    return client.event(
        "finding", {"text": text, "impact": 0.5, "confidence": 0.7, "subject": "bench"}, project=project
    )


async def register(clients: list[EpibusClient], texts: list[str], project: str | list[str]) -> dict[str, str]:
    """Each text a watch of one of the agents, MAX_WATCHES_PER_AGENT each. Returns watch id -> text."""
    watched: dict[str, str] = {}
    for index, text in enumerate(texts):
        view = await clients[index // MAX_WATCHES_PER_AGENT].watch(text, project)
        watched[view.watch_id] = text
    return watched


async def held_by_node(node: Node, watch_ids: set[str]) -> None:
    deadline = time.monotonic() + SETTLE_S
    while node.live_mirror is None or any(node.live_mirror.watches.book.get(w) is None for w in watch_ids):
        if time.monotonic() > deadline:
            raise RuntimeError("benchmark invalid: the node does not hold every registered watch")
        await asyncio.sleep(0.05)


async def indexed(node: Node, count: int) -> None:
    deadline = time.monotonic() + SETTLE_S + count / 20
    while node.mirror is None or node.mirror.indexed < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"benchmark invalid: indexed {node.mirror and node.mirror.indexed} of {count}")
        await asyncio.sleep(0.01)


class NoticeReader:
    """Every notice the stream stores from now on, by (watch, event), with the time it reached this reader."""

    def __init__(self) -> None:
        self.arrived: dict[tuple[str, str], float] = {}
        self.kinds: dict[str, int] = {}

    async def on_message(self, msg: Msg) -> None:
        notice = decode_notice(msg.subject, msg.data)
        self.arrived.setdefault((notice.watch_id, str(notice.event_id)), time.perf_counter())
        self.kinds[notice.notice] = self.kinds.get(notice.notice, 0) + 1


async def paraphrase_quality(client: EpibusClient, node: Node, reader: NoticeReader, project: str) -> dict[str, Any]:
    """Watch each pair's first text, claim each second text; a push is right when it joins a pair."""
    watched = await register([client], list(TOPICS), project)
    await held_by_node(node, set(watched))
    claims = {}
    count = node.mirror.indexed if node.mirror else 0
    for text, paraphrase in TOPICS.items():
        event = finding(client, paraphrase, project)
        await client.publish(event)
        claims[str(event.event_id)] = text
    await indexed(node, count + len(claims))
    await asyncio.sleep(2.0)  # notices are pushed after indexing; the reader takes them as they come
    pushed = {(watch, event) for watch, event in reader.arrived if watch in watched}
    right = {(w, e) for w, e in pushed if claims.get(e) == watched[w]}
    return {
        "pairs": len(TOPICS),
        "pushed": len(pushed),
        "right": len(right),
        "precision": round(len(right) / len(pushed), 3) if pushed else None,
        "recall": round(len(right) / len(TOPICS), 3),
        "threshold": DEFAULT_THRESHOLD,
    }


async def watch_indexing(node: Node, counts: list[tuple[float, int]], stop: asyncio.Event) -> None:
    """(time, claims indexed) every few ms: when each claim became recallable, the latency's baseline."""
    while not stop.is_set():
        counts.append((time.perf_counter(), node.mirror.indexed if node.mirror else 0))
        await asyncio.sleep(0.005)


def indexed_at(counts: list[tuple[float, int]], ordinal: int) -> float | None:
    """When the indexed count first reached `ordinal` (claims are indexed in stream order)."""
    index = bisect.bisect_left([c for _, c in counts], ordinal)
    return counts[index][0] if index < len(counts) else None


async def notice_latency(
    client: EpibusClient, node: Node, reader: NoticeReader, project: str, watched: dict[str, str], n: int
) -> dict[str, Any]:
    """Claims at CLAIMS_PER_S into the watched project, one in OWN_WORDS_EVERY in a watch's own words (the others
    in words no watch is near); every notice of them timed from its claim's publish, and each claim's indexing
    (when it became recallable) timed the same way: what the watch adds is the difference."""
    texts = list(watched.values())
    sent: dict[str, tuple[float, int]] = {}  # event id -> (published at, its ordinal in the mirror)
    count = node.mirror.indexed if node.mirror else 0
    counts: list[tuple[float, int]] = []
    stop = asyncio.Event()
    watching = asyncio.create_task(watch_indexing(node, counts, stop))
    began = time.perf_counter()
    for i in range(n):
        await asyncio.sleep(max(0.0, began + i / CLAIMS_PER_S - time.perf_counter()))
        own = i % OWN_WORDS_EVERY == 0
        text = f"{texts[i // OWN_WORDS_EVERY % len(texts)]} again" if own else claim_text(i, "live")
        event = finding(client, text, project)
        sent[str(event.event_id)] = (time.perf_counter(), count + i + 1)
        await client.publish(event)
    rate = n / (time.perf_counter() - began)
    await indexed(node, count + n)  # the node has taken every claim...
    quiet_since, seen = time.perf_counter(), 0
    while time.perf_counter() - quiet_since < 3.0:  # ... and the notices stopped coming
        if len(reader.arrived) != seen:
            seen, quiet_since = len(reader.arrived), time.perf_counter()
        await asyncio.sleep(0.1)
    stop.set()
    await watching
    waits = [(at - sent[event][0]) * 1000 for (_, event), at in reader.arrived.items() if event in sent]
    recallable = [(at - published) * 1000 for published, ordinal in sent.values()
                  if (at := indexed_at(counts, ordinal)) is not None]  # fmt: skip
    own_words = sum(1 for i in range(n) if i % OWN_WORDS_EVERY == 0)
    matched = {event for (_, event) in reader.arrived if event in sent}
    return {"claims": n, "claims_per_s": round(rate, 1), "notices": len(waits), "claims_notified": len(matched),
            "claims_in_a_watchs_words": own_words, "waits_ms": waits, "indexed_ms": recallable}  # fmt: skip


async def ingest_rates(client: EpibusClient, node: Node, watched_project: str, n: int) -> dict[str, float]:
    """Claims per second the node indexes in bursts into each project, ABBA: unwatched, watched, watched,
    unwatched, n/2 claims each (bursts of seconds, so a pause of the machine weighs little)."""
    unwatched = f"b-{uuid.uuid4().hex[:10]}"
    seconds = {watched_project: 0.0, unwatched: 0.0}
    claims = {watched_project: 0, unwatched: 0}
    burst = max(1, n // 2)
    for turn, project in enumerate([unwatched, watched_project, watched_project, unwatched]):
        events = [finding(client, claim_text(turn * burst + i, f"burst{turn}"), project) for i in range(burst)]
        start_count = node.mirror.indexed if node.mirror else 0
        started = time.perf_counter()
        await client.publish_many(events, timeout_s=600)
        await indexed(node, start_count + burst)
        seconds[project] += time.perf_counter() - started
        claims[project] += burst
    return {
        "watched": claims[watched_project] / seconds[watched_project],
        "unwatched": claims[unwatched] / seconds[unwatched],
    }


async def row_watch(root: Path, sizes: Sizes) -> list[Line]:
    # The watches stand on two projects: one for the latency phase, one that stays empty until the ingest phase
    # (compared with another empty project nobody watches: the same node, the same state, only the watches differ).
    project, ingest_project = f"b-{uuid.uuid4().hex[:10]}", f"b-{uuid.uuid4().hex[:10]}"
    agents = -(-sizes.watches // MAX_WATCHES_PER_AGENT)
    with fresh_server(root) as server:
        config = NodeConfig(home=root / "node", nats_url=server.url, journal_url=f"sqlite:///{root / 'journal.db'}")
        async with Node(config) as node, AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(
                    connect(server.url, agent=f"watcher-{i}", home=root / f"agent-{i}", outbox=False)
                )
                for i in range(agents + 1)
            ]
            reader = NoticeReader()
            js = clients[0].js
            subscription = await js.subscribe(
                "epiwatch.>", stream=WATCH_STREAM, cb=reader.on_message, ordered_consumer=True,
                deliver_policy=DeliverPolicy.NEW,
            )  # fmt: skip
            stack.push_async_callback(subscription.unsubscribe)
            quality = await paraphrase_quality(clients[-1], node, reader, f"b-{uuid.uuid4().hex[:10]}")
            started = time.perf_counter()
            watched = await register(clients[:agents], watch_texts(sizes.watches), [project, ingest_project])
            await held_by_node(node, set(watched))
            registering_s = time.perf_counter() - started
            timed = await notice_latency(clients[-1], node, reader, project, watched, sizes.watch_claims)
            rates = await ingest_rates(clients[-1], node, ingest_project, 2 * sizes.watch_claims)
            pusher = node.live_mirror.pusher.stats if node.live_mirror is not None else None
    waits, recallable = timed.pop("waits_ms"), timed.pop("indexed_ms")
    if not waits or not recallable:
        raise RuntimeError("benchmark invalid: no claim was pushed to any watch, or none was seen indexed")
    match_ms = 1000 * pusher.match_s / pusher.claims if pusher is not None and pusher.claims else None
    common = {"watches": len(watched), "agents": agents, "registering_s": round(registering_s, 1),
              "match_ms_per_claim": match_ms and round(match_ms, 3), "notice_kinds": reader.kinds}  # fmt: skip
    return [
        latency(
            "watch",
            f"claim published -> notice read, p99, {len(watched)} watches, {timed['claims_per_s']:.0f} claims/s "
            f"({CLAIMS_PER_S:.0f} asked)",
            percentile(waits, 0.99),
            "claim published -> indexed (recallable), p99, same claims",
            percentile(recallable, 0.99),
            limit_ms=LATENCY_LIMIT_MS,
            details=common
            | timed
            | {
                "p50_ms": round(percentile(waits, 0.5), 1),
                "indexed_p50_ms": round(percentile(recallable, 0.5), 1),
            },
        ),
        throughput(
            "watch",
            f"mirror ingest into a project with {len(watched)} watches",
            rates["watched"],
            "the same node, a project with none",
            rates["unwatched"],
            target=INGEST_TARGET,
            unit="claims/s",
        ),
        Line(
            "watch",
            f"paraphrase pairs pushed at the default threshold ({DEFAULT_THRESHOLD})",
            "recall",
            quality["recall"],
            quality["precision"],
            "precision",
            None,
            "—",
            "recall 1.0, precision 1.0",
            quality["recall"] == 1.0 and quality["precision"] == 1.0,
            details=quality,
        ),
    ]
