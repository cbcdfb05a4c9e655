"""One `epibus chaos` run: start the nodes, publish while the faults run one after another, let the system
settle, then read every store back and judge it against the ledger of attempts."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
from sqlalchemy.exc import SQLAlchemyError

from bus.errors import ConfigError, EpibusError, Unavailable, error_summary
from bus.host.home import private_dir
from bus.host.processes import alive
from bus.subjects import STREAM
from epibus.chaos.audit import journal_copies, make_leader, mirror_copies, mirror_lookup_copies, stream_copies
from epibus.chaos.faults import CLUSTER_ONLY, FAILPOINT_FAULTS, FAULTS
from epibus.chaos.ledger import StoreAudit, audit_store, unreadable, write_attempts
from epibus.chaos.topology import AttachedCluster, Topology
from epibus.chaos.workload import Workload
from epibus.cluster.local import Member
from epibus.node import failpoints

log = logging.getLogger(__name__)
ORPHAN_S = 10.0  # a killed node's server must be gone by then (parent-death signal)
TRIGGER_S = 60.0  # how long an armed one-shot failpoint may wait for a batch to fire on
ROUTES_LOST_S = 60.0  # a cut-off server notices after a few missed route pings
SETTLE_POLL_S = 0.5


@dataclass(frozen=True)
class ChaosSettings:
    run_dir: Path
    size: int = 1  # 1: one node on its embedded server; 3 to 5: the one-machine cluster
    faults: tuple[str, ...] = tuple(FAULTS)
    rounds: int = 1  # the faults run one after another, this many times over
    publishers: int = 3
    projects: int = 3
    rate: float = 80.0  # events per second, all publishers together
    max_events: int = 20_000
    hold_s: float = 4.0  # how long a fault with a duration lasts
    min_run_s: float = 10.0  # the workload runs at least this long, and until every fault has run
    min_events: int = 0  # ... and until this many publishes were attempted (faults slow a loaded machine down)
    settle_s: float = 180.0  # bound on the wait for outboxes to drain and observers to catch up
    network: Any = None  # epibus.cluster.netns.Namespaces for the partition fault; None: no partition possible
    network_unavailable: str | None = None  # why there are no namespaces, when there are none
    attach: Path | None = None  # the home of a running `epibus cluster up` to break instead of starting nodes


@dataclass
class FaultRecord:
    fault: str
    target: str | None = None
    outcome: str = "injected"  # injected | not applicable: ... | not available: ... | failed: ...
    at_s: float = 0.0  # seconds into the workload
    held_s: float = 0.0
    recovered_s: float | None = None  # until every node, server and replica was healthy again


@dataclass
class ChaosReport:
    settings: dict[str, Any]
    attempts: dict[str, int]
    faults: list[FaultRecord]
    stores: list[StoreAudit]
    settled: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No store lost, duplicated or changed an acknowledged event or went unread, and no fault failed (a
        fault fails when the system did not behave as it must, e.g. a server outlived its killed node)."""
        stores_ok = bool(self.stores) and not any(store.failed for store in self.stores)
        return stores_ok and not any(fault.outcome.startswith("failed") for fault in self.faults)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "settings": self.settings,
            "attempts": self.attempts,
            "faults": [asdict(f) for f in self.faults],
            "stores": [s.as_dict() for s in self.stores],
            "settled": self.settled,
            "seconds": self.seconds,
        }


Say = Callable[[str], None]


async def run_chaos(settings: ChaosSettings, say: Say = log.info) -> ChaosReport:
    """Run the workload and faults, settle, audit. The nodes are stopped before this returns, whatever
    happens. Raises ConfigError for impossible settings, Unavailable when the nodes cannot start."""
    if settings.attach is None and settings.size != 1 and not 3 <= settings.size <= 5:
        raise ConfigError("--nodes", f"{settings.size}: chaos runs 1 node, or a cluster of 3 to 5")
    topology = (
        AttachedCluster(settings.attach)
        if settings.attach is not None
        else Topology(settings.run_dir, settings.size, network=settings.network)
    )
    private_dir(settings.run_dir)
    began = time.monotonic()
    projects = [f"chaos-{uuid.uuid4().hex[:8]}-{i}" for i in range(settings.projects)]
    if settings.attach is not None:
        say(f"attaching to the cluster of {len(topology.members)} nodes under {settings.attach}")
    else:
        say(f"starting {settings.size} node(s) under {settings.run_dir}")
    async with topology:
        await topology.await_healthy()
        workload = Workload(
            settings.run_dir, topology.nats_urls, publishers=settings.publishers, projects=projects,
            rate=settings.rate,
        )  # fmt: skip
        await workload.enrol(topology.admin)
        await workload.connect()
        try:
            faults = await _publish_through_faults(settings, topology, workload, say)
            say("settling: draining outboxes, waiting for every observer to catch up")
            settled = await _settle(settings, topology, workload)
        finally:
            await workload.close()
        write_attempts(settings.run_dir / "attempts.jsonl", workload.attempts)
        say("auditing the event stream on every server")
        stores = await _audit_streams(topology, projects, workload)
        if not topology.owns_nodes:
            say("auditing every node's journal, and its mirror through its lookup service")
            stores += await _audit_running(topology, projects, workload)
    if topology.owns_nodes:
        say("auditing every node's journal and mirror")
        stores += await _audit_files(topology.members, projects, workload)
    levels = Counter(a.level for a in workload.attempts)
    report = ChaosReport(
        settings={
            "nodes": len(topology.members),
            "attached": str(settings.attach) if settings.attach is not None else None,
            "faults": list(settings.faults),
            "rounds": settings.rounds,
            "publishers": settings.publishers,
            "projects": projects,
            "rate": settings.rate,
            "hold_s": settings.hold_s,
            "run_dir": str(settings.run_dir),
        },
        attempts={
            "total": len(workload.attempts),
            **{level: levels[level] for level in ("published", "outboxed", "error")},
        },
        faults=faults,
        stores=stores,
        settled=settled,
        seconds=round(time.monotonic() - began, 1),
    )
    (settings.run_dir / "report.json").write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    return report


async def _publish_through_faults(
    settings: ChaosSettings, topology: Topology, workload: Workload, say: Say
) -> list[FaultRecord]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    started = loop.time()
    records: list[FaultRecord] = []
    async with asyncio.TaskGroup() as group:
        publishing = group.create_task(workload.run(stop, settings.max_events))
        try:
            for name in settings.faults * settings.rounds:
                await asyncio.sleep(1.0)  # some traffic between two faults
                record = FaultRecord(name, at_s=round(loop.time() - started, 1))
                say(f"fault {name}: {FAULTS[name]}")
                await _inject(name, settings, topology, record)
                if record.outcome == "injected":
                    record.recovered_s = await topology.await_healthy()
                say(f"fault {name}: {record.outcome} (target {record.target}, recovered in {record.recovered_s}s)")
                records.append(record)
            left_s = settings.min_run_s - (loop.time() - started)
            if left_s > 0 and not publishing.done():
                await asyncio.sleep(left_s)
            enough = group.create_task(workload.attempted(settings.min_events))
            await asyncio.wait([publishing, enough], return_when=asyncio.FIRST_COMPLETED)
            enough.cancel()  # the publishers stopped short of it (max_events): waiting longer would wait forever
        finally:
            stop.set()
    return records


async def _inject(name: str, settings: ChaosSettings, topology: Topology, record: FaultRecord) -> None:
    """Inject one fault and heal it; the outcome says whether it ran. Never leaves a node paused."""
    if name in CLUSTER_ONLY and not topology.clustered:
        record.outcome = "not applicable: one node has one server"
        return
    if name == "partition" and settings.network is None:
        record.outcome = f"not available: {settings.network_unavailable or 'no network namespaces'}"
        return
    if name in FAILPOINT_FAULTS and (why := topology.failpoints_unavailable()) is not None:
        record.outcome = f"not available: {why}"
        return
    began = time.monotonic()
    try:
        await _INJECTORS[name](topology, settings, record)
    except EpibusError as e:
        record.outcome = f"failed: {e}"
    finally:
        record.held_s = round(time.monotonic() - began, 1)


async def _kill_leader(topology: Topology, settings: ChaosSettings, record: FaultRecord) -> None:
    leader = await topology.stream_leader()
    record.target = leader.name
    _require_signalled(topology.signal(leader, signal.SIGKILL, server=True), leader, "server")


async def _kill_follower(topology: Topology, settings: ChaosSettings, record: FaultRecord) -> None:
    leader = await topology.stream_leader()
    follower = next(m for m in topology.members if m.name != leader.name)
    record.target = follower.name
    _require_signalled(topology.signal(follower, signal.SIGKILL, server=True), follower, "server")


async def _kill_node(topology: Topology, settings: ChaosSettings, record: FaultRecord) -> None:
    victim = await topology.stream_leader()
    record.target = victim.name
    server = topology.processes(victim).server
    _require_signalled(topology.signal(victim, signal.SIGKILL, group=True), victim, "node")
    # The server leads a session of its own: only its parent-death signal takes it down with the node.
    deadline = time.monotonic() + ORPHAN_S
    while server is not None and alive(server):
        if time.monotonic() > deadline:
            os.kill(server, signal.SIGKILL)
            raise Unavailable(victim.name, f"its nats-server (pid {server}) outlived the node by {ORPHAN_S:.0f}s")
        await asyncio.sleep(0.05)


async def _pause(topology: Topology, settings: ChaosSettings, record: FaultRecord) -> None:
    leader = await topology.stream_leader()
    record.target = leader.name
    _require_signalled(topology.signal(leader, signal.SIGSTOP, server=True), leader, "server")
    try:
        await asyncio.sleep(settings.hold_s)
    finally:
        topology.signal(leader, signal.SIGCONT, server=True)


async def _nats_down(topology: Topology, settings: ChaosSettings, record: FaultRecord) -> None:
    record.target = "every server"
    paused = [m for m in topology.members if topology.signal(m, signal.SIGSTOP) is not None]
    try:
        for member in topology.members:
            topology.signal(member, signal.SIGKILL, server=True)
        await asyncio.sleep(settings.hold_s)
    finally:
        for member in paused:
            topology.signal(member, signal.SIGCONT)  # each node sees its server gone and starts it again


async def _kill_observer(topology: Topology, settings: ChaosSettings, record: FaultRecord) -> None:
    victim = topology.members[-1]
    record.target = victim.name
    home = Path(victim.home)
    node = topology.processes(victim).node
    failpoints.arm(home, "observer-kill")
    deadline = time.monotonic() + TRIGGER_S
    while failpoints.armed(home, "observer-kill"):
        if time.monotonic() > deadline:
            failpoints.disarm(home, "observer-kill")
            record.outcome = f"not triggered: no observer batch on {victim.name} in {TRIGGER_S:.0f}s"
            return
        await asyncio.sleep(0.1)
    while node is not None and alive(node):  # the node kills itself right after the half batch
        if time.monotonic() > deadline:
            raise Unavailable(victim.name, f"still runs {TRIGGER_S:.0f}s after its observer-kill failpoint fired")
        await asyncio.sleep(0.1)


async def _mirror_unavailable(topology: Topology, settings: ChaosSettings, record: FaultRecord) -> None:
    victim = topology.members[0]
    record.target = victim.name
    home = Path(victim.home)
    failpoints.arm(home, "mirror-unavailable")
    try:
        await asyncio.sleep(settings.hold_s)
        # Held until the mirror has met the outage at least once: a hold with no call to the store proves nothing.
        deadline = time.monotonic() + TRIGGER_S
        while not failpoints.was_hit(home, "mirror-unavailable"):
            if time.monotonic() > deadline:
                record.outcome = f"not triggered: no call to {victim.name}'s mirror store in {TRIGGER_S:.0f}s"
                return
            await asyncio.sleep(0.1)
    finally:
        failpoints.disarm(home, "mirror-unavailable")


async def _partition(topology: Topology, settings: ChaosSettings, record: FaultRecord) -> None:
    leader = await topology.stream_leader()
    index = topology.members.index(leader)
    record.target = f"{leader.name} cut off"
    settings.network.partition([index], [i for i in range(len(topology.members)) if i != index])
    try:
        # The cut is real once the cut-off server has dropped its routes (missed pings): from then on it holds.
        deadline = time.monotonic() + ROUTES_LOST_S
        while await topology.routes_of(leader) != 0:
            if time.monotonic() > deadline:
                raise Unavailable(leader.name, f"still has routes {ROUTES_LOST_S:.0f}s after it was cut off")
            await asyncio.sleep(0.25)
        await asyncio.sleep(settings.hold_s)
    finally:
        settings.network.heal()


def _require_signalled(pid: int | None, member: Member, what: str) -> None:
    if pid is None:
        raise Unavailable(member.name, f"its {what} was not running when the fault came")


_INJECTORS = {
    "leader": _kill_leader,
    "follower": _kill_follower,
    "node": _kill_node,
    "pause": _pause,
    "nats-down": _nats_down,
    "observer": _kill_observer,
    "mirror": _mirror_unavailable,
    "partition": _partition,
}
assert set(_INJECTORS) == set(FAULTS)


async def _settle(settings: ChaosSettings, topology: Topology, workload: Workload) -> dict[str, Any]:
    """Wait (bounded) for the outboxes to drain and every durable consumer to have nothing pending."""
    began = time.monotonic()
    outboxed = await workload.drain(settings.settle_s)
    await topology.await_healthy()
    assert topology.operator is not None
    js = topology.operator.jetstream()
    pending: dict[str, int] = {}
    while time.monotonic() - began < settings.settle_s:
        try:
            consumers = await js.consumers_info(STREAM)
        except (nats.errors.Error, TimeoutError) as e:
            pending = {"consumers_info": -1}
            log.warning("consumer info did not answer (%s); asking again", error_summary(e))
        else:
            pending = {
                c.name: (c.num_pending or 0) + (c.num_ack_pending or 0)
                for c in consumers
                if c.config.durable_name and ((c.num_pending or 0) + (c.num_ack_pending or 0))
            }
            if not pending:
                break
        await asyncio.sleep(SETTLE_POLL_S)
    return {"seconds": round(time.monotonic() - began, 1), "left_in_outboxes": outboxed, "pending": pending}


async def _audit_streams(topology: Topology, projects: list[str], workload: Workload) -> list[StoreAudit]:
    audits = []
    assert topology.operator is not None
    for member in topology.members:
        store = f"stream@{member.name}"
        try:
            if topology.clustered:
                await make_leader(topology.operator, member.name)
            audits.append(audit_store(store, workload.attempts, await stream_copies(topology.operator, projects)))
        except (EpibusError, nats.errors.Error, TimeoutError) as e:
            audits.append(unreadable(store, workload.attempts, error_summary(e)))
    return audits


async def _audit_files(members: list[Member], projects: list[str], workload: Workload) -> list[StoreAudit]:
    audits = []
    for member in members:
        audits += await _audit_journal(member, projects, workload)
        store = f"mirror@{member.name}"
        try:
            copies = await mirror_copies(Path(member.home) / "mirror", projects)
            audits.append(audit_store(store, workload.attempts, copies))
        except (EpibusError, OSError) as e:
            audits.append(unreadable(store, workload.attempts, error_summary(e)))
    return audits


async def _audit_journal(member: Member, projects: list[str], workload: Workload) -> list[StoreAudit]:
    store = f"journal@{member.name}"
    try:
        copies = await asyncio.to_thread(journal_copies, Path(member.home) / "journal.db", projects)
    except (EpibusError, OSError, SQLAlchemyError) as e:
        return [unreadable(store, workload.attempts, error_summary(e))]
    return [audit_store(store, workload.attempts, copies)]


async def _audit_running(topology: Topology, projects: list[str], workload: Workload) -> list[StoreAudit]:
    """The stores of nodes that go on running: each journal by SQL (read-only, beside its node), each mirror
    through its node's lookup service (presence only: its files cannot be opened beside the node)."""
    assert topology.operator is not None
    names = [member.name for member in topology.members]
    digests = {a.event_id: a.digest for a in workload.attempts}
    mirrors, problems = await mirror_lookup_copies(topology.operator, topology.admin, digests, names)
    audits = []
    for member in topology.members:
        audits += await _audit_journal(member, projects, workload)
        store = f"mirror@{member.name}"
        if member.name in problems:
            audits.append(unreadable(store, workload.attempts, f"{member.name}: {problems[member.name]}"))
            continue
        audit = audit_store(store, workload.attempts, mirrors[member.name])
        audit.note = "presence only: asked through the running node's lookup service"
        audits.append(audit)
    return audits
