"""Mesh handshakes per second against the raw KV handshake, with everything a node runs for the mesh started
in this process: a nats-server (`sync_interval: always`, as deployed), the mesh service (the bucket's only
writer, on a connection of its own with a node key), the node's mesh recorder, N peers and a coordinator.

    python bench/mesh_profile.py [--peers 2] [--tasks 25] [--in-flight 2] [--repeat 1] [--profile FILE] [--json]

Each peer i proposes `--tasks` tasks to peer i+1, `--in-flight` open at a time; the coordinator service
(auto-accept:operational) accepts; the assignee learns it from its inbox, starts and completes; the proposer
learns of the completion from its inbox and acknowledges. Baseline, in the same run on the same server: one
KV create and four compare-and-set updates per handshake with raw nats-py, with the same concurrency.

`--profile FILE` writes a cProfile of the epibus part (every agent, watcher and the node share this process);
the script also counts, per handshake, the KV reads, KV writes, requests to the node and signature checks."""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

# Run as `python bench/mesh_profile.py`, this file's folder comes first on sys.path; a file of it named like
# the `mesh` package would shadow it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import nats  # noqa: E402
from nats.js.kv import KeyValue  # noqa: E402

import bus.identity.signing  # noqa: E402
from bus.broker.loops import cancel_and_wait  # noqa: E402
from bus.client.client import EpibusClient, connect  # noqa: E402
from bus.client.connection import open_nats  # noqa: E402
from bus.host.server import NatsServer  # noqa: E402
from bus.identity.signing import AgentKey  # noqa: E402
from mesh import asker as mesh_asker  # noqa: E402
from mesh import events as mesh_events  # noqa: E402
from mesh import trust as mesh_trust  # noqa: E402
from mesh.agent import MeshAgent  # noqa: E402
from mesh.coordinator import Coordinator, parse_policy  # noqa: E402
from mesh.inbox import Inbox, Notification  # noqa: E402
from mesh.recorder import MeshRecorder  # noqa: E402
from mesh.service import MeshService  # noqa: E402

PROJECT = "bench"
SHA = "0123456789abcdef0123456789abcdef01234567"
COUNTS: Counter[str] = Counter()
WAITED: defaultdict[str, float] = defaultdict(
    float
)  # seconds spent awaiting each counted call (overlapping calls add up)


@contextmanager
def counted() -> Iterator[None]:
    """Count KV gets and writes, node requests and signature verifications while the block runs."""
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        patched.append((owner, name, original))
        if asyncio.iscoroutinefunction(original):

            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                COUNTS[label] += 1
                if label == "kv get":  # which records: bucket and the key's first part
                    COUNTS[f"kv get {args[0]._name}:{str(args[1]).split('.')[0]}"] += 1
                started = time.perf_counter()
                try:
                    return await original(*args, **kwargs)
                finally:
                    WAITED[label] += time.perf_counter() - started

            setattr(owner, name, async_wrapper)
        else:

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                COUNTS[label] += 1
                return original(*args, **kwargs)

            setattr(owner, name, wrapper)

    wrap(KeyValue, "get", "kv get")
    wrap(KeyValue, "update", "kv update/create")
    wrap(mesh_asker.NodeAsker, "ask", "node request")
    wrap(EpibusClient, "publish", "event publish")
    wrap(MeshService, "_apply_step", "node applies a step")
    wrap(MeshAgent, "send", "agent sends a message")
    for module in (bus.identity.signing, mesh_events, mesh_trust):
        if hasattr(module, "verify_signature"):
            wrap(module, "verify_signature", "signature verified")
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


async def bounded(jobs: list[Callable[[], Awaitable[float]]], in_flight: int) -> list[float]:
    slots = asyncio.Semaphore(in_flight)

    async def run(job: Callable[[], Awaitable[float]]) -> float:
        async with slots:
            return await job()

    return list(await asyncio.gather(*(run(job) for job in jobs)))


async def raw_handshakes(url: str, peers: int, tasks: int, in_flight: int, bucket: str) -> tuple[float, int]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(bucket=bucket, history=64)
        value = b'{"state":"x","pad":"' + b"y" * 400 + b'"}'

        def handshake(key: str) -> Callable[[], Awaitable[float]]:
            async def job() -> float:
                start = time.perf_counter()
                revision = await kv.create(key, value)
                for _ in range(4):  # accept, start, complete, acknowledge
                    revision = await kv.update(key, value, last=revision)
                return time.perf_counter() - start

            return job

        start = time.perf_counter()
        per_peer = [bounded([handshake(f"t.{p}.{i}") for i in range(tasks)], in_flight) for p in range(peers)]
        done = sum(len(batch) for batch in await asyncio.gather(*per_peer))
        return time.perf_counter() - start, done
    finally:
        await nc.close()


class Peer:
    """Proposes to its neighbour, works what it is assigned, acknowledges what completes."""

    def __init__(self, mesh: MeshAgent, neighbour: str, run: int) -> None:
        self.mesh = mesh
        self.neighbour = neighbour
        self.run = run
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
            task_id = f"{self.mesh.agent}-{self.run}-{i}"
            self.completed[task_id] = asyncio.get_running_loop().create_future()
            await self.mesh.propose(
                PROJECT, f"task {i}", "bench", category="operational", agents=[self.neighbour], task_id=task_id
            )
            await asyncio.wait_for(self.completed[task_id], timeout=120)
            await self.mesh.acknowledge(task_id, project=PROJECT)
            return time.perf_counter() - start

        return job


async def epibus_handshakes(
    url: str, home: Path, peers: int, tasks: int, in_flight: int, run: int, profile: cProfile.Profile | None
) -> tuple[float, list[float], float]:
    async with AsyncExitStack() as stack:
        node_key = AgentKey.generate("node")
        node_nc = await open_nats([url], name="bench-node", timeout_s=5, key=node_key)
        stack.push_async_callback(node_nc.close)
        service = MeshService(node_nc.jetstream(), node_key, node="bench-node")
        await service.serve(node_nc)
        recorder = MeshRecorder(lambda: node_nc.jetstream(), closed=lambda: node_nc.is_closed)

        async def agent(name: str) -> MeshAgent:
            client = await stack.enter_async_context(connect(url, agent=name, home=home, outbox=False))
            return MeshAgent(client)

        coordinator = await agent("coord")
        await coordinator.add_coordinator(PROJECT, "coord")
        policy = Coordinator(coordinator, PROJECT, parse_policy("auto-accept:operational"), poll_timeout_s=0.5)
        names = [f"peer{p}" for p in range(peers)]
        crew = [Peer(await agent(name), names[(p + 1) % peers], run) for p, name in enumerate(names)]
        background = [asyncio.create_task(policy.run()), asyncio.create_task(recorder.run())]
        background += [asyncio.create_task(peer.inbox.run()) for peer in crew]
        await asyncio.sleep(0.5)  # the watchers subscribe
        try:
            COUNTS.clear()
            WAITED.clear()
            if profile is not None:
                profile.enable()
            start, cpu = time.perf_counter(), time.process_time()
            with counted():
                per_peer = [bounded([peer.handshake(i) for i in range(tasks)], in_flight) for peer in crew]
                latencies = [x for batch in await asyncio.gather(*per_peer) for x in batch]
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            if profile is not None:
                profile.disable()
        finally:
            await cancel_and_wait(background)
        ours = [
            e
            for e in await coordinator.tasks(PROJECT)
            if e.record.task_id.endswith(tuple(f"-{run}-{i}" for i in range(tasks)))
        ]
        states = {e.record.state.value for e in ours}
        if len(ours) != peers * tasks or states != {"acknowledged"}:
            raise SystemExit(f"bench invalid: {len(ours)} tasks in states {states}, expected all acknowledged")
        actions = [s.action.value for s in ours[0].record.steps]
        assert actions == ["propose", "accept", "start", "complete", "acknowledge"], actions
        return elapsed, latencies, cpu


async def one_run(peers: int, tasks: int, in_flight: int, run: int, profile: cProfile.Profile | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = NatsServer(root / "nats")
        server.start()
        try:
            raw_s, raw_n = await raw_handshakes(server.url, peers, tasks, in_flight, f"bench_raw_{run}")
            epi_s, lat, cpu = await epibus_handshakes(server.url, root / "home", peers, tasks, in_flight, run, profile)
        finally:
            server.stop()
    base, rate = raw_n / raw_s, len(lat) / epi_s
    n = len(lat)
    return {
        "peers": peers,
        "raw_per_s": round(base, 1),
        "epibus_per_s": round(rate, 1),
        "ratio": round(rate / base, 3),
        "p50_ms": round(1000 * statistics.median(lat), 1),
        "cpu_share": round(cpu / epi_s, 2),
        "cpu_ms_per_handshake": round(1000 * cpu / n, 2),
        "per_handshake": {k: round(v / n, 1) for k, v in sorted(COUNTS.items())},
        "ms_awaited_per_call": {k: round(1000 * v / COUNTS[k], 2) for k, v in sorted(WAITED.items())},
    }


async def main(args: argparse.Namespace) -> None:
    profile = cProfile.Profile() if args.profile else None
    rows = [await one_run(args.peers, args.tasks, args.in_flight, run, profile) for run in range(args.repeat)]
    if profile is not None:
        profile.dump_stats(args.profile)
    for row in rows:
        print(json.dumps(row) if args.json else row)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=25, help="handshakes each peer starts")
    parser.add_argument("--in-flight", type=int, default=2, help="open handshakes per peer at a time")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--profile", help="write a cProfile of the epibus part here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.peers < 2:
        parser.error("--peers must be at least 2: peers propose to each other")
    asyncio.run(main(args))
