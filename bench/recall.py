"""`recall` from a client against the same recall in the node's process, in one run: a node with an edge mirror
holding --points events, then --rounds recalls each way (the same queries), p50/p99 of both.

    python bench/recall.py [--points 3000] [--rounds 200] [--json]

The client path is what an agent runs (`EpibusClient.recall`: a signed request fanned out on NATS, answered by
every live node, merged); the in-process path is the node's own recall handler on the same request, no bus."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as `python bench/recall.py`: this folder comes first on sys.path (its mesh.py would shadow the `mesh`
# package), and the repository root is needed.
sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

from bus.client.client import connect  # noqa: E402
from bus.client.recall import recall_request  # noqa: E402
from bus.host.server import NatsServer  # noqa: E402
from bus.subjects import RECALL  # noqa: E402
from epibus.node.node import Node, NodeConfig  # noqa: E402

PROJECT = "bench-recall"
TOPICS = ["cache", "deploy", "database", "latency", "queue", "index", "schema", "network", "disk", "auth"]
QUERIES = [f"why is the {a} slow after the {b} change" for a in TOPICS for b in TOPICS[:3]]


def _finding(i: int) -> dict[str, object]:
    a, b = TOPICS[i % len(TOPICS)], TOPICS[(i // len(TOPICS)) % len(TOPICS)]
    return {
        "text": f"finding {i}: the {a} misbehaves when the {b} is busy",
        "impact": 0.5,
        "confidence": 0.7,
        "subject": a,
    }


def _percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    return {
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
        "mean_ms": round(statistics.fmean(ms), 2),
        "n": len(ms),
    }


async def run(points: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="epibus-bench-recall-") as tmp:
        root = Path(tmp)
        server = NatsServer(root / "nats")
        server.start()
        try:
            config = NodeConfig(home=root / "node", nats_url=server.url, name="bench", mirror="edge")
            async with (
                Node(config) as node,
                connect(server.url, agent="bench", home=root / "agent", outbox=False) as client,
            ):
                started = time.monotonic()
                for start in range(0, points, 500):
                    events = [
                        client.event("finding", _finding(i), project=PROJECT)
                        for i in range(start, min(points, start + 500))
                    ]
                    await client.publish_many(events)
                assert node.mirror is not None
                for _ in range(6000):  # at most 20 minutes
                    if node.mirror.indexed >= points:
                        break
                    await asyncio.sleep(0.2)
                else:
                    raise SystemExit(f"the mirror indexed {node.mirror.indexed} of {points} points in 20 minutes")
                fill_s = time.monotonic() - started
                requests = [
                    recall_request(q, PROJECT, k=10, kinds=None, include_resolved=False, as_of=None, audit=False)
                    for q in QUERIES
                ]
                # Warm both paths; every query's embedding is then cached (the node keeps a content-hash cache),
                # so neither path pays for embedding a query the other one embedded first.
                assert node.mirror_services is not None
                answer_recall = node.mirror_services.recall  # the node's own answer, without the round trip
                for request in requests:
                    await answer_recall(request)
                    await client.recall(request.query, PROJECT, k=10)
                local: list[float] = []
                remote: list[float] = []
                served = node.services[RECALL].latency
                served_before = (served.sum, served.count)
                partial = 0
                for i in range(rounds):
                    request = requests[i % len(requests)]
                    t0 = time.perf_counter()
                    await answer_recall(request)
                    local.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    answer = await client.recall(request.query, PROJECT, k=10)
                    remote.append(time.perf_counter() - t0)
                    partial += getattr(answer, "partial", False)  # an older RecallAnswer has none
                    assert answer.nodes == ["bench"], answer.as_dict()
                # The node's own time per request (arrival to reply: signature check, rule, recall, reply).
                node_s = (served.sum - served_before[0]) / max(1, served.count - served_before[1])
                presence = await _presence_read(client, rounds)
        finally:
            server.stop()
    client_stats, local_stats = _percentiles(remote), _percentiles(local)
    return {
        "points": points,
        "fill_s": round(fill_s, 1),
        "client_recall": client_stats,
        "in_process_recall": local_stats,
        "client_over_in_process_p50": round(client_stats["p50_ms"] / local_stats["p50_ms"], 2),
        "node_handling_mean_ms": round(node_s * 1000, 2),
        "partial_answers": partial,
        "live_nodes_read": presence,
        "load_average": os.getloadavg(),
    }


async def _presence_read(client: Any, rounds: int) -> dict[str, float] | None:
    """What reading the live set costs a fan-out (it overlaps the nodes' work); None before there was one."""
    try:
        from bus.broker.presence import live_nodes
    except ImportError:
        return None
    samples: list[float] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await live_nodes(client.nc.jetstream())
        samples.append(time.perf_counter() - t0)
    return _percentiles(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(run(args.points, args.rounds))
    if args.json:
        print(json.dumps(result))
        return
    for path in ("client_recall", "in_process_recall"):
        s = result[path]
        print(
            f"{path:18} p50 {s['p50_ms']:8.2f} ms  p99 {s['p99_ms']:8.2f} ms  mean {s['mean_ms']:8.2f} ms  n={s['n']}"
        )
    print(
        f"points {result['points']} (filled in {result['fill_s']} s), client/in-process p50 "
        f"{result['client_over_in_process_p50']}, partial answers {result['partial_answers']}, "
        f"load {', '.join(f'{x:.2f}' for x in result['load_average'])}"
    )
    print(f"the node's own handling of a client recall: mean {result['node_handling_mean_ms']} ms")
    if read := result["live_nodes_read"]:
        print(f"live-set read p50 {read['p50_ms']} ms p99 {read['p99_ms']} ms")


if __name__ == "__main__":
    main()
