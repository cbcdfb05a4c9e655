"""A node's Prometheus metrics, gathered when they are scraped from the counts the node already keeps: its
runners' stats and tallies (bus/intake/runner.py, bus/broker/tally.py), its services' responders, its embedder,
forwarder and outbox, the status snapshot's mesh view, and the EPI and EPI_DLQ streams (asked with a deadline). Each
node has its own CollectorRegistry, so two nodes in one process never share a series.

Label values a publisher chooses (projects, kinds) are capped (bus/broker/tally.py): past the cap they count under
`_other`, a value no project or kind can take. Every other label comes from a fixed vocabulary."""

from __future__ import annotations

import asyncio
import logging
import math
import sqlite3
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import fields
from typing import TYPE_CHECKING

import nats.errors
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from bus.broker.nats_errors import NATS_OR_API_ERROR
from bus.broker.tally import DEFAULT_MAX_KEYS, OTHER, LatencyHistogram, fold_top
from bus.errors import EpibusError
from bus.intake.runner import ConsumerRunner
from bus.model.vocab import DeadLetterReason
from bus.services.responder import ServiceCounts
from bus.subjects import DLQ_STREAM, DLQ_SUBJECTS, STREAM, parse_dlq_subject
from epibus.monitoring.store_metrics import embed_families, recall_families, storage_families, watch_families
from epibus.node.supervise import service_failures
from mesh.protocol import awaits_acknowledgement

if TYPE_CHECKING:
    from epibus.node.view import NodeView

log = logging.getLogger(__name__)
SOURCE_DEADLINE_S = 2.0  # a scrape waits this long for the server's stream figures, then reports without them


def capped(labels: str = "project and kind") -> str:
    """The help text's note on a capped label."""
    return f" At most {DEFAULT_MAX_KEYS} label sets; later (or the smallest) ones count under {labels} {OTHER!r}."


CAPPED = capped()
# What asking the server about a stream can raise when it does not answer.
ASK_FAILED: tuple[type[BaseException], ...] = (*NATS_OR_API_ERROR, nats.errors.Error, TimeoutError)
OUTCOMES = tuple(f.name for f in fields(ServiceCounts))
REASONS = frozenset(reason.value for reason in DeadLetterReason)


class NodeMetrics:
    """The node's registry and what fills it: `await render()` gathers everything on the node's event loop
    (no other thread reads the node's counts), then writes the text exposition."""

    def __init__(self, node: NodeView) -> None:
        self.node = node
        self.registry = CollectorRegistry(auto_describe=False)
        self._prepared = _Prepared()
        self.registry.register(self._prepared)
        self.source_errors: Counter[str] = Counter()  # figures a scrape could not get, by source
        self._failing: set[str] = set()

    async def render(self) -> bytes:
        self._prepared.families = await self.gather()
        return generate_latest(self.registry)

    async def gather(self) -> list[Metric]:
        node = self.node
        found = [*_observer_families(node), *_consumer_families(node), *_service_families(node)]
        found += [*embed_families(node), *_node_families(node), *_mesh_families(node), *_limit_families(node)]
        found += storage_families(node)
        found += watch_families(node)
        found += recall_families(node)
        found += await self._stream_families()
        found += await self._outbox_families()
        errors = CounterMetricFamily(
            "epibus_metrics_source_errors",
            "Scrapes that went without a source's figures (it did not answer in time, or failed), by source.",
            labels=["source"],
        )
        for source in ("dlq", "stream", "outbox"):
            errors.add_metric([source], self.source_errors[source])
        return [*found, errors]

    def _failed(self, source: str, error: BaseException) -> None:
        self.source_errors[source] += 1
        if source not in self._failing:  # once per outage, not once per scrape
            log.warning("metrics: %s figures unavailable: %s %s", source, type(error).__name__, error)
        self._failing.add(source)

    def _answered(self, source: str) -> None:
        if source in self._failing:
            log.info("metrics: %s figures available again", source)
        self._failing.discard(source)

    async def _stream_families(self) -> list[Metric]:
        node = self.node
        js = node.js if node.nc is not None and node.nc.is_connected else None
        last = GaugeMetricFamily("epibus_stream_last_sequence", "The EPI stream's last sequence number.")
        dlq_total = GaugeMetricFamily("epibus_dlq_stream_messages", "Messages in EPI_DLQ, of every node.")
        dlq = GaugeMetricFamily(
            "epibus_dlq_messages",
            "Messages in EPI_DLQ this node's observers put there, by reason.",
            labels=["observer", "reason"],
        )
        if js is None:
            return [last, dlq_total, dlq]
        try:
            async with asyncio.timeout(SOURCE_DEADLINE_S):
                info = await js.stream_info(STREAM)
            last.add_metric([], info.state.last_seq)
            self._answered("stream")
        except ASK_FAILED as e:
            self._failed("stream", e)
        try:
            async with asyncio.timeout(SOURCE_DEADLINE_S):
                dead = await js.stream_info(DLQ_STREAM, subjects_filter=DLQ_SUBJECTS[0])
            dlq_total.add_metric([], dead.state.messages)
            for (role, reason), n in sorted(_dlq_by_role(node, dead.state.subjects or {}).items()):
                dlq.add_metric([role, reason], n)
            self._answered("dlq")
        except ASK_FAILED as e:
            self._failed("dlq", e)
        return [last, dlq_total, dlq]

    async def _outbox_families(self) -> list[Metric]:
        depth = GaugeMetricFamily(
            "epibus_outbox_messages",
            "Events in this node's outbox: waiting to be forwarded, or parked.",
            labels=["state"],
        )
        forwarder = self.node.forwarder
        if forwarder is None:
            return [depth]
        try:
            async with asyncio.timeout(SOURCE_DEADLINE_S):
                waiting = await forwarder.outbox.depth()
                parked = len(await forwarder.outbox.parked())
        except (EpibusError, sqlite3.Error, TimeoutError, RuntimeError) as e:  # RuntimeError: its executor closed
            self._failed("outbox", e)
            return [depth]
        self._answered("outbox")
        depth.add_metric(["waiting"], waiting)
        depth.add_metric(["parked"], parked)
        return [depth]


class _Prepared(Collector):
    """Yields the families gathered just before the registry is asked (on the same loop, with no await in
    between, so two scrapes never mix)."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self) -> Iterable[Metric]:
        return list(self.families)


def runners(node: NodeView) -> Iterator[tuple[str, ConsumerRunner]]:
    """The node's observers by role, the label every per-observer series carries."""
    for role, runner in (("journal", node.runner), ("mirror", node.mirror_runner)):
        if runner is not None:
            yield role, runner


def _dlq_by_role(node: NodeView, subjects: dict[str, int]) -> Counter[tuple[str, str]]:
    roles = {runner.observer.name: role for role, runner in runners(node)}
    found: Counter[tuple[str, str]] = Counter()
    for subject, n in subjects.items():
        parsed = parse_dlq_subject(subject)
        if parsed is not None and parsed[0] in roles:
            # Anyone who may publish on epidlq.> could name any reason: only the vocabulary's are labels.
            reason = parsed[1] if parsed[1] in REASONS else OTHER
            found[(roles[parsed[0]], reason)] += n
    return found


def histogram(name: str, documentation: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, documentation, labels=labels)


def add_histogram(family: HistogramMetricFamily, labels: list[str], kept: LatencyHistogram) -> None:
    buckets = [("+Inf" if math.isinf(b) else repr(float(b)), float(n)) for b, n in kept.cumulative()]
    family.add_metric(labels, buckets, kept.sum)


def _observer_families(node: NodeView) -> list[Metric]:
    """Per project and kind: what each observer applied and dead-lettered; recording-to-write latency."""
    applied = {
        "journal": CounterMetricFamily(
            "epibus_events_journaled",
            "Events this node's journal observer wrote, by project and kind." + CAPPED,
            labels=["project", "kind"],
        ),
        "mirror": CounterMetricFamily(
            "epibus_events_mirrored",
            "Events this node's mirror applied (recallable), by project and kind." + CAPPED,
            labels=["project", "kind"],
        ),
    }
    latency = {
        "journal": histogram(
            "epibus_publish_to_journaled_seconds", "From an event's recorded_at to the journal's commit.", []
        ),
        "mirror": histogram(
            "epibus_publish_to_recallable_seconds", "From an event's recorded_at to the mirror's write.", []
        ),
    }
    dead = CounterMetricFamily(
        "epibus_events_dead_lettered",
        "Messages this node's observers dead-lettered, by project, kind and reason; project and kind "
        f"{'_unparsed'!r} when the subject named none." + CAPPED,
        labels=["observer", "project", "kind", "reason"],
    )
    for role, runner in runners(node):
        for (project, kind), n in runner.tally.handled.items():
            applied[role].add_metric([project, kind], n)
        for (project, kind, reason), n in runner.tally.dead_lettered.items():
            dead.add_metric([role, project, kind, reason], n)
        add_histogram(latency[role], [], runner.tally.latency)
    return [*applied.values(), *latency.values(), dead]


def _consumer_families(node: NodeView) -> list[Metric]:
    """Each observer's durable consumer as the server last reported it, and the runner's own counts."""
    labels = ["observer"]
    pending = GaugeMetricFamily(
        "epibus_consumer_pending_messages",
        "Messages not yet acked by the observer (as of its last check).",
        labels=labels,
    )
    floor = GaugeMetricFamily("epibus_consumer_ack_floor_sequence", "The consumer's ack floor.", labels=labels)
    stalled = GaugeMetricFamily("epibus_observer_stalled", "1 when messages wait and nothing is acked.", labels=labels)
    degraded = GaugeMetricFamily("epibus_observer_degraded", "1 while the store is down (events held).", labels=labels)
    redelivered = CounterMetricFamily(
        "epibus_consumer_redelivered", "Messages fetched again after an earlier delivery.", labels=labels
    )
    fetch_errors = CounterMetricFamily("epibus_consumer_fetch_errors", "Failed fetches (retried).", labels=labels)
    failures = CounterMetricFamily(
        "epibus_observer_handler_failures", "Batches or events the observer failed on (retried).", labels=labels
    )
    for role, runner in runners(node):
        stats = runner.stats
        if stats.pending is not None:
            pending.add_metric([role], stats.pending)
        if stats.ack_floor_seq is not None:
            floor.add_metric([role], stats.ack_floor_seq)
        stalled.add_metric([role], float(stats.stalled))
        degraded.add_metric([role], float(stats.degraded))
        redelivered.add_metric([role], stats.redelivered)
        fetch_errors.add_metric([role], stats.fetch_errors)
        failures.add_metric([role], stats.handler_failures)
    return [pending, floor, stalled, degraded, redelivered, fetch_errors, failures]


def _service_families(node: NodeView) -> list[Metric]:
    """Request services (by subject, a fixed set), and supervised loops' failures (by service name)."""
    requests = CounterMetricFamily(
        "epibus_requests", "Requests each service got, by outcome.", labels=["service", "outcome"]
    )
    seconds = histogram("epibus_request_seconds", "From a request's arrival to its reply.", ["service"])
    for subject, responder in sorted(node.services.items()):
        for outcome in OUTCOMES:
            requests.add_metric([subject, outcome], getattr(responder.counts, outcome))
        add_histogram(seconds, [subject], responder.latency)
    failures = CounterMetricFamily(
        "epibus_service_failures", "Failures of the node's supervised loops (each restarted).", labels=["service"]
    )
    for name, n in sorted(service_failures.items()):
        failures.add_metric([name], n)
    return [requests, seconds, failures]


def _limit_families(node: NodeView) -> list[Metric]:
    """Each agent's publish budget and use on this node's server, and the consumer slots it was refused."""
    found: list[Metric] = []
    if node.budget is not None:
        report = node.budget.report()
        limit = GaugeMetricFamily("epibus_publish_budget", "What one agent may send per window.", labels=["unit"])
        limit.add_metric(["messages"], report["msgs_per_window"])
        limit.add_metric(["bytes"], report["bytes_per_window"])
        used = GaugeMetricFamily(
            "epibus_agent_publish_window", "What each agent sent in the last window.", labels=["agent", "unit"]
        )
        suspended = GaugeMetricFamily("epibus_agent_suspended", "1 while an agent is over budget.", labels=["agent"])
        suspensions = CounterMetricFamily(
            "epibus_agent_budget_suspensions", "Times each agent went over its budget.", labels=["agent"]
        )
        for agent, use in report["agents"].items():
            used.add_metric([agent, "messages"], use["msgs"])
            used.add_metric([agent, "bytes"], use["bytes"])
            suspended.add_metric([agent], 1.0 if use["suspended"] else 0.0)
            suspensions.add_metric([agent], use["suspensions"])
        found += [limit, used, suspended, suspensions]
    if node.consumer_slots is not None:
        slots = CounterMetricFamily(
            "epibus_agent_consumers",
            "Agents' consumers this node opened, or refused (all slots in use).",
            labels=["outcome"],
        )
        slots.add_metric(["opened"], node.consumer_slots.counts.opened)
        slots.add_metric(["refused"], node.consumer_slots.counts.full)
        found.append(slots)
    return found


def _node_families(node: NodeView) -> list[Metric]:
    connected = GaugeMetricFamily("epibus_nats_connected", "1 while the node's NATS connection is up.")
    connected.add_metric([], float(node.nc is not None and node.nc.is_connected))
    restarts = CounterMetricFamily(
        "epibus_restarts", "Restarts of the node's NATS connection and embedded server.", labels=["what"]
    )
    restarts.add_metric(["connection"], node.connection_restarts)
    restarts.add_metric(["server"], node.server_restarts)
    forwarded = CounterMetricFamily(
        "epibus_outbox_forwarded", "Outbox events the forwarder sent to the stream, by outcome.", labels=["outcome"]
    )
    if node.forwarder is not None:
        stats = node.forwarder.stats
        forwarded.add_metric(["sent"], stats.sent)
        forwarded.add_metric(["duplicate"], stats.duplicates)
        forwarded.add_metric(["rejected"], stats.rejected)
        forwarded.add_metric(["failed_attempt"], stats.failed_attempts)
    return [connected, restarts, forwarded]


def _mesh_families(node: NodeView) -> list[Metric]:
    """Mesh tasks by project and state, and completed tasks awaiting their proposer's acknowledgement, from the
    status snapshot's view of the mesh bucket (absent until it has read the bucket once)."""
    ready = GaugeMetricFamily("epibus_mesh_view_ready", "1 once the node has read the whole mesh bucket.")
    tasks = GaugeMetricFamily(
        "epibus_mesh_tasks",
        "Mesh tasks by project and state." + capped("project"),
        labels=["project", "state"],
    )
    acks = GaugeMetricFamily(
        "epibus_mesh_pending_acknowledgements",
        "Completed tasks awaiting acknowledgement, by project." + capped("project"),
        labels=["project"],
    )
    view = node.mesh_view
    ready.add_metric([], float(view is not None and view.caught_up))
    if view is None or not view.caught_up:
        return [ready, tasks, acks]
    by_state: Counter[tuple[str, ...]] = Counter()
    awaiting: Counter[tuple[str, ...]] = Counter()
    for (project, _), record in view.records.items():
        by_state[(project, record.state.value)] += 1
        awaiting[(project,)] += awaits_acknowledgement(record)
    for (project, state), n in sorted(fold_top(by_state).items()):
        tasks.add_metric([project, state], n)
    for (project,), n in sorted(fold_top(awaiting).items()):
        acks.add_metric([project], n)
    return [ready, tasks, acks]
