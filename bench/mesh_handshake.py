"""Mesh handshakes per second and handshake latency with N peers on one node, against a baseline measured in
the same run on the same nats-server (`sync_interval: always`, as deployed).

    python bench/mesh_handshake.py [--peers 4] [--tasks 25] [--in-flight 2] [--json]

epibus: N peer agents, each on its own connection with its own inbox watcher, and one coordinator service
(policy auto-accept:operational) on another. Peer i proposes `--tasks` tasks to peer i+1, keeping
`--in-flight` open at a time. The assignee learns of the acceptance from its inbox and starts and completes
the task (a commit SHA); the proposer learns of the completion from its inbox and acknowledges it. Latency
is from the propose call to the acknowledgement; every step is a KV compare-and-set plus a signed event.

Baseline: the bare storage work of a handshake with raw nats-py on the same server: one KV create and four
compare-and-set updates of a small value, in sequence, with the same concurrency; no validation, no events,
no watchers, no coordinator."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import nats
from rich.console import Console
from rich.table import Table

from bus.broker.loops import cancel_and_wait
from bus.client.client import connect
from bus.host.server import NatsServer
from epibus.node.node import Node, NodeConfig
from mesh.agent import MeshAgent
from mesh.coordinator import Coordinator, parse_policy
from mesh.inbox import Inbox, Notification
from mesh.task import TaskRecord

PROJECT = "bench"
# This process's CPU time during each timed section: every agent, watcher and the coordinator share one
# Python process here, so a rate capped by it is CPU-bound, not waiting on NATS.
CPU_SECONDS: dict[str, float] = {}
SHA = "0123456789abcdef0123456789abcdef01234567"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def bounded(jobs: list[Callable[[], Awaitable[float]]], in_flight: int) -> list[float]:
    slots = asyncio.Semaphore(in_flight)

    async def run(job: Callable[[], Awaitable[float]]) -> float:
        async with slots:
            return await job()

    return list(await asyncio.gather(*(run(job) for job in jobs)))


async def raw_handshakes(url: str, peers: int, tasks: int, in_flight: int) -> tuple[float, list[float]]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(bucket="bench_raw", history=64)
        value = b'{"state":"x","pad":"' + b"y" * 400 + b'"}'

        def handshake(key: str) -> Callable[[], Awaitable[float]]:
            async def job() -> float:
                start = time.perf_counter()
                revision = await kv.create(key, value)
                for _ in range(4):  # accept, start, complete, acknowledge
                    revision = await kv.update(key, value, last=revision)
                return time.perf_counter() - start

            return job

        start, cpu = time.perf_counter(), time.process_time()
        per_peer = [bounded([handshake(f"t.{p}.{i}") for i in range(tasks)], in_flight) for p in range(peers)]
        latencies = [x for batch in await asyncio.gather(*per_peer) for x in batch]
        CPU_SECONDS["raw"] = time.process_time() - cpu
        return time.perf_counter() - start, latencies
    finally:
        await nc.close()


class Peer:
    """A bench peer: proposes to its neighbour, works what it is assigned, acknowledges what completes."""

    def __init__(self, mesh: MeshAgent, neighbour: str) -> None:
        self.mesh = mesh
        self.neighbour = neighbour
        self.completed: dict[str, asyncio.Future[None]] = {}
        self.inbox = Inbox(mesh, self.on_note, project=PROJECT, poll_timeout_s=0.5)

    async def on_note(self, note: Notification) -> None:
        if note.state.value == "accepted" and note.why.startswith("assigned to you"):
            await self.mesh.start(note.task_id, project=PROJECT)
            await self.mesh.complete(note.task_id, SHA, project=PROJECT)
        elif note.state.value == "completed":
            waiter = self.completed.get(note.task_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def handshake(self, i: int) -> Callable[[], Awaitable[float]]:
        async def job() -> float:
            start = time.perf_counter()
            task_id = f"{self.mesh.agent}-{i}"
            self.completed[task_id] = asyncio.get_running_loop().create_future()
            await self.mesh.propose(
                PROJECT, f"task {i}", "bench", category="operational", agents=[self.neighbour], task_id=task_id
            )
            await asyncio.wait_for(self.completed[task_id], timeout=120)
            await self.mesh.acknowledge(task_id, project=PROJECT)
            return time.perf_counter() - start

        return job


async def epibus_handshakes(url: str, home: Path, peers: int, tasks: int, in_flight: int) -> tuple[float, list[float]]:
    async with AsyncExitStack() as stack:
        # The mesh's writes go through a node's mesh service, as with `epibus up`: one runs here, in this process.
        config = NodeConfig(
            home=home / "node", nats_url=url, journal_url=f"sqlite:///{home / 'journal.db'}", mirror="off"
        )
        await stack.enter_async_context(Node(config))

        async def agent(name: str) -> MeshAgent:
            client = await stack.enter_async_context(connect(url, agent=name, home=home, outbox=False))
            return MeshAgent(client)

        coordinator = await agent("coord")
        await coordinator.add_coordinator(PROJECT, "coord")
        service = Coordinator(coordinator, PROJECT, parse_policy("auto-accept:operational"), poll_timeout_s=0.5)
        names = [f"peer{p}" for p in range(peers)]
        crew = [Peer(await agent(name), names[(p + 1) % peers]) for p, name in enumerate(names)]
        background = [asyncio.create_task(service.run())] + [asyncio.create_task(peer.inbox.run()) for peer in crew]
        try:
            start, cpu = time.perf_counter(), time.process_time()
            per_peer = [bounded([peer.handshake(i) for i in range(tasks)], in_flight) for peer in crew]
            latencies = [x for batch in await asyncio.gather(*per_peer) for x in batch]
            elapsed = time.perf_counter() - start
            CPU_SECONDS["epibus"] = time.process_time() - cpu
        finally:
            await cancel_and_wait(background)
        states = {e.record.state.value for e in await coordinator.tasks(PROJECT)}
        if states != {"acknowledged"}:
            raise SystemExit(f"bench invalid: tasks ended in states {states}, expected all acknowledged")
        check: TaskRecord = (await coordinator.tasks(PROJECT))[0].record
        assert [s.action.value for s in check.steps] == ["propose", "accept", "start", "complete", "acknowledge"]
        return elapsed, latencies


def summary(name: str, elapsed: float, latencies: list[float], base: float | None, cpu_s: float) -> dict[str, Any]:
    rate = len(latencies) / elapsed
    return {
        "client_cpu_share": round(cpu_s / elapsed, 2),
        "what": name,
        "handshakes": len(latencies),
        "handshakes_per_s": round(rate, 1),
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 1),
        "ratio_vs_baseline": None if base is None else round(rate / base, 3),
    }


async def main(peers: int, tasks: int, in_flight: int, as_json: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = NatsServer(root / "nats")  # sync_interval: always, as deployed
        server.start()
        try:
            raw_s, raw_lat = await raw_handshakes(server.url, peers, tasks, in_flight)
            epi_s, epi_lat = await epibus_handshakes(server.url, root / "home", peers, tasks, in_flight)
        finally:
            server.stop()
    base = len(raw_lat) / raw_s
    rows = [
        summary("raw nats-py KV: create + 4 CAS updates", raw_s, raw_lat, None, CPU_SECONDS["raw"]),
        summary(
            f"epibus mesh handshake, {peers} peers + coordinator service", epi_s, epi_lat, base, CPU_SECONDS["epibus"]
        ),
    ]
    if as_json:
        print(json.dumps({"peers": peers, "tasks_per_peer": tasks, "in_flight_per_peer": in_flight, "rows": rows}))
        return
    table = Table(title=f"mesh handshakes: {peers} peers x {tasks} tasks, {in_flight} in flight per peer")
    for column in ("what", "handshakes", "handshakes/s", "p50 ms", "p99 ms", "client CPU", "ratio vs baseline"):
        table.add_column(column)
    for r in rows:
        ratio = "baseline" if r["ratio_vs_baseline"] is None else f"{r['ratio_vs_baseline']:.3f}"
        table.add_row(
            r["what"],
            str(r["handshakes"]),
            str(r["handshakes_per_s"]),
            str(r["p50_ms"]),
            str(r["p99_ms"]),
            f"{r['client_cpu_share']:.0%}",
            ratio,
        )
    Console().print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=25, help="handshakes each peer starts")
    parser.add_argument("--in-flight", type=int, default=2, help="open handshakes per peer at a time")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.peers < 2:
        parser.error("--peers must be at least 2: peers propose to each other (a completion by oneself is not news)")
    asyncio.run(main(args.peers, args.tasks, args.in_flight, args.json))
