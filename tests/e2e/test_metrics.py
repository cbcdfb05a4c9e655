"""The node's Prometheus endpoint, scraped over HTTP from a real node (nats-server, SQLite journal, qdrant-edge
mirror, the real embedding model): a known workload's exact counts per label, read back against the journal by
plain SQL; the cap on publisher-chosen label values; the bearer token; the endpoint gone once the node stops;
and the Grafana dashboard asks only for metrics a node exports."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import replace
from pathlib import Path

import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from sqlalchemy import text

from bus.broker.tally import OTHER
from bus.client.client import EpibusClient, connect
from bus.errors import ConfigError
from bus.host.home import read_node_info
from bus.host.server import NatsServer
from bus.model.ids import new_event_id
from bus.subjects import dlq_subject
from epibus.cli.mesh_roster import seat_as_operator
from epibus.monitoring.metrics_http import TOKEN_FILE
from epibus.node.node import Node, NodeConfig
from mesh.agent import MeshAgent
from observers.journal_engine import make_engine
from tests.conftest import finding
from tests.support import eventually, start_node_process, stop_node_process

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "epibus-dashboard.json"
SHA = "d" * 40


def scrape(url: str, token: str | None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def samples(node: Node) -> list[Sample]:
    assert node.metrics is not None
    status, body = await asyncio.to_thread(scrape, node.metrics.url, node.metrics.token)
    assert status == 200, body
    return [s for family in text_string_to_metric_families(body) for s in family.samples]


def values(found: list[Sample], name: str, *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(s.labels[label] for label in labels): s.value for s in found if s.name == name}


def journal_counts(url: str) -> dict[tuple[str, str], float]:
    """Events per (project, kind) in the journal, by plain SQL."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT project, kind, COUNT(*) FROM events GROUP BY project, kind"))
            return {(row[0], row[1]): float(row[2]) for row in rows}
    finally:
        engine.dispose()


async def mesh_workload(client: EpibusClient, url: str, home: Path, project: str) -> None:
    """One task left proposed, one completed and not yet acknowledged by its proposer (alice)."""
    await seat_as_operator([url], home, project, "alice")
    mesh = MeshAgent(client)
    await mesh.propose(project, "rotate logs", "the disk fills up", category="operational", agents=["alice"])
    done = await mesh.propose(project, "trim the cache", "it grows", category="operational", agents=["alice"])
    task_id = done.record.task_id
    await mesh.accept(task_id, assignee="alice", project=project)
    await mesh.start(task_id, project=project)
    await mesh.complete(task_id, SHA, project=project)


async def publish_hostile(url: str, project: str, journal_consumer: str) -> None:
    """Two messages on well-formed event subjects that no observer can admit, and a forged dead letter in the
    journal's name with a reason of its own invention (the server here has no authentication to stop it)."""
    raw = await nats.connect(url)
    try:
        js = raw.jetstream()
        await js.publish(f"epi.{project}.finding.hostile-1", b"not json at all")
        await js.publish(f"epi.{project}.finding.hostile-2", json.dumps({"kind": "finding"}).encode())
        await js.publish(dlq_subject(journal_consumer, "reason-made-up-by-a-forger"), b"forged")
    finally:
        await raw.close()


async def test_a_known_workload_scrapes_as_exact_counts_per_label(
    nats_server: NatsServer, home: Path, sqlite_journal_url: str
) -> None:
    a, b = f"metrics-a-{new_event_id().hex[:6]}", f"metrics-b-{new_event_id().hex[:6]}"
    config = NodeConfig(home=home, nats_url=nats_server.url, journal_url=sqlite_journal_url)
    async with Node(config) as node, connect(nats_server.url, agent="alice", home=home) as alice:
        assert node.metrics is not None
        assert node.runner is not None
        assert node.mirror_runner is not None
        for i in range(7):
            await alice.publish(alice.event("finding", finding(i), project=a))
        for i in range(3):
            await alice.publish(alice.event("unknown", {"question": f"why {i}?", "impact": 0.5}, project=b))
        await mesh_workload(alice, nats_server.url, home, a)
        await publish_hostile(nats_server.url, a, node.runner.observer.name)

        def settled() -> bool:
            journaled = node.runner.tally.handled if node.runner else None
            mirrored = node.mirror_runner.tally.handled if node.mirror_runner else None
            view = node.status.view if node.status else None
            return bool(
                journaled and mirrored and view and view.caught_up and len(view.records) == 2
                and journaled.total() == sum(journal_counts(sqlite_journal_url).values())
                and mirrored.total() == journaled.total()
                and node.runner and sum(node.runner.stats.dead_lettered.values()) == 2
                and node.mirror_runner and sum(node.mirror_runner.stats.dead_lettered.values()) == 2
            )  # fmt: skip

        await eventually(settled, timeout_s=60)
        # Each runner reports its consumer's pending count as of its own last check: wait for both.
        await eventually(
            lambda: all(r is not None and r.stats.pending == 0 for r in (node.runner, node.mirror_runner)),
            timeout_s=20,
        )
        answer = await alice.recall("finding number 3", a, k=3)
        assert answer.hits
        found = await samples(node)

    in_journal = journal_counts(sqlite_journal_url)
    assert in_journal[(a, "finding")] == 7
    assert in_journal[(b, "unknown")] == 3
    # Every (project, kind) the journal holds, exactly as the journal counts it, and nothing else.
    assert values(found, "epibus_events_journaled_total", "project", "kind") == in_journal
    assert values(found, "epibus_events_mirrored_total", "project", "kind") == in_journal
    total = sum(in_journal.values())
    assert values(found, "epibus_publish_to_journaled_seconds_count") == {(): total}
    assert values(found, "epibus_publish_to_recallable_seconds_count") == {(): total}
    buckets = values(found, "epibus_publish_to_journaled_seconds_bucket", "le")
    counts = [n for _, n in sorted((float(le), n) for (le,), n in buckets.items())]
    assert counts[-1] == total
    assert counts == sorted(counts)
    dead = values(found, "epibus_events_dead_lettered_total", "observer", "project", "kind")
    assert dead.keys() >= {("journal", a, "finding"), ("mirror", a, "finding")}
    assert sum(n for (role, *_), n in dead.items() if role == "journal") == 2
    assert sum(n for (role, *_), n in dead.items() if role == "mirror") == 2
    dlq = Counter[str]()
    in_dlq = values(found, "epibus_dlq_messages", "observer", "reason")
    for (role, reason), n in in_dlq.items():
        dlq[role] += int(n) if reason != OTHER else 0
    assert sum(dlq.values()) == 2  # both observers refused both; the DLQ keeps one copy each (the first's)
    assert set(dlq) <= {"journal", "mirror"}
    assert in_dlq[("journal", OTHER)] == 1  # the forged reason is no label of its own
    assert values(found, "epibus_dlq_stream_messages") == {(): 3.0}
    assert values(found, "epibus_mesh_tasks", "project", "state") == {(a, "proposed"): 1, (a, "completed"): 1}
    assert values(found, "epibus_mesh_pending_acknowledgements", "project") == {(a,): 1}
    assert values(found, "epibus_consumer_pending_messages", "observer") == {("journal",): 0, ("mirror",): 0}
    assert values(found, "epibus_outbox_messages", "state") == {("waiting",): 0, ("parked",): 0}
    recall_answered = values(found, "epibus_requests_total", "service", "outcome")[("epibus.recall", "answered")]
    assert recall_answered == 1
    assert values(found, "epibus_request_seconds_count", "service")[("epibus.recall",)] == 1
    assert values(found, "epibus_recalls_total") == {(): 1}
    spent = values(found, "epibus_recall_seconds_total", "phase")
    assert set(spent) == {("embed",), ("search",), ("total",)}
    assert 0 < spent[("embed",)] + spent[("search",)] <= spent[("total",)]  # the parts within the whole
    embedded = values(found, "epibus_embed_texts_total")[()] + values(found, "epibus_embed_cache_hits_total")[()]
    assert embedded >= 7 + 3 + 1  # every finding, unknown and the recall query went through the embedder
    assert values(found, "epibus_embed_seconds_total")[()] > 0
    assert values(found, "epibus_nats_connected") == {(): 1.0}


async def test_publisher_chosen_labels_are_capped_and_the_rest_count_as_other(
    nats_server: NatsServer, home: Path, sqlite_journal_url: str
) -> None:
    projects = [f"cap-{i}-{new_event_id().hex[:6]}" for i in range(5)]
    config = NodeConfig(home=home, nats_url=nats_server.url, journal_url=sqlite_journal_url, mirror="off")
    async with Node(config) as node, connect(nats_server.url, agent="alice", home=home) as alice:
        assert node.runner is not None
        tally = node.runner.tally.handled
        seen_before = len(tally.items())  # the enrolment records the node and client wrote
        tally.max_keys = seen_before + 3  # room for three of the five projects
        for project in projects:
            await alice.publish(alice.event("finding", finding(), project=project))

        def all_journaled() -> bool:
            in_journal = journal_counts(sqlite_journal_url)
            mine = sum(n for (project, _), n in in_journal.items() if project in projects)
            return mine == len(projects) and tally.total() == sum(in_journal.values())

        await eventually(all_journaled, timeout_s=30)
        found = await samples(node)
        status, body = await asyncio.to_thread(scrape, node.metrics.url if node.metrics else "", None)

    journaled = values(found, "epibus_events_journaled_total", "project", "kind")
    assert len(journaled) == seen_before + 4  # three projects of their own, and the fold
    assert journaled[(OTHER, OTHER)] == 2
    assert {(p, "finding") for p in projects[:3]} <= journaled.keys()
    assert sum(journaled.values()) == sum(journal_counts(sqlite_journal_url).values())  # nothing lost by folding
    assert status == 401
    assert "bearer token" in body
    assert TOKEN_FILE in body


async def test_the_endpoint_is_recorded_in_node_json_and_refuses_connections_once_the_node_stops(
    nats_server: NatsServer, home: Path, sqlite_journal_url: str
) -> None:
    config = NodeConfig(home=home, nats_url=nats_server.url, journal_url=sqlite_journal_url, mirror="off")
    async with Node(config) as node:
        assert node.metrics is not None
        url, port = node.metrics.url, node.metrics.port
        info = read_node_info(home)
        assert info is not None
        assert info.metrics_url == url == f"http://127.0.0.1:{port}/metrics"
        status, body = await asyncio.to_thread(scrape, url, (home / TOKEN_FILE).read_text().strip())
        assert status == 200
        assert "epibus_events_journaled_total" in body
        assert "later (or the smallest) ones count under project and kind '_other'" in body  # the help says so
        token = node.metrics.token
        answers = [await asyncio.to_thread(raw_http, port, request) for request in hostile_http(token)]
        got = [a.split(b" ", 2)[1] if a.startswith(b"HTTP/1.1 ") else b"closed" for a in answers]
        assert [answer in allowed for answer, allowed in zip(got, HOSTILE_ANSWERS, strict=True)] == [True] * len(
            HOSTILE_ANSWERS
        ), got
        assert (await asyncio.to_thread(scrape, url, token))[0] == 200  # one bad request stops nothing
        lingering = socket.create_connection(("127.0.0.1", port), timeout=10)
        lingering.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never more: the node stops regardless
    with lingering:
        assert await asyncio.to_thread(lingering.recv, 1024) == b""  # closed by the stopping server
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    async with Node(config) as again:  # the port is kept across restarts
        assert again.metrics is not None
        assert again.metrics.port == port


async def test_a_non_loopback_host_is_refused_unless_asked_for_and_port_0_turns_the_endpoint_off(
    nats_server: NatsServer, home: Path, sqlite_journal_url: str
) -> None:
    config = NodeConfig(
        home=home, nats_url=nats_server.url, journal_url=sqlite_journal_url, mirror="off", metrics_host="0.0.0.0"
    )
    with pytest.raises(ConfigError, match="--metrics-remote"):
        async with Node(config):
            pass
    assert not (home / "node.json").exists()
    async with Node(replace(config, metrics_host="127.0.0.1", metrics_port=0)) as node:
        assert node.metrics is None
        info = read_node_info(home)
        assert info is not None
        assert info.metrics_url is None


# What each hostile request may get. The 200 KB header is answered 400 and the connection closed while the
# client may still be sending: its reset can then discard the answer, which is also a refusal.
HOSTILE_ANSWERS = [
    {b"400"}, {b"405"}, {b"404"}, {b"401"}, {b"401"}, {b"401"}, {b"closed"}, {b"400", b"closed"}
]  # fmt: skip


def hostile_http(token: str) -> list[bytes]:
    """Requests no scraper sends; each gets an error status (or a closed connection), never the metrics."""
    return [
        b"\x00\xff garbage that is no HTTP at all\r\n\r\n",
        f"POST /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Length: 0\r\n\r\n".encode(),
        f"GET /../etc/passwd HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode(),
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n\r\n",
        f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: bearer {token}\r\n\r\n".encode(),  # not the scheme
        ("GET /metrics HTTP/1.1\r\nHost: x\r\n" + f"Authorization: Bearer {token}\r\n" * 2 + "\r\n").encode(),
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n",  # never finished: the server gives up on it, the node goes on
        b"GET /metrics HTTP/1.1\r\n" + b"X-Long: " + b"a" * 200_000 + b"\r\n\r\n",
    ]


def raw_http(port: int, request: bytes) -> bytes:
    """Send raw bytes, return the first line of the answer (b"" when the server closed without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
            answer = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return b""
        except OSError as e:  # the server closed before the client had sent it all: no longer connected
            if e.errno != errno.ENOTCONN:
                raise
            return b""
    return answer.split(b"\r\n", 1)[0]


def expr_metric_names(dashboard: dict[str, object]) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]  # type: ignore[attr-defined]
    return {name for expr in exprs for name in re.findall(r"\bepibus_[a-z0-9_]+", expr)}


def exported_names(body: str) -> set[str]:
    """Every series name a scrape can show, including those of families without samples yet."""
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for family in text_string_to_metric_families(body):
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
        names |= {s.name for s in family.samples}
    return names


async def test_every_metric_the_grafana_dashboard_asks_for_is_one_a_node_exports(
    nats_server: NatsServer, home: Path, sqlite_journal_url: str
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"]
    assert dashboard["schemaVersion"] >= 30
    assert dashboard["panels"]
    used = expr_metric_names(dashboard)
    assert len(used) >= 12
    graphs = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in graphs:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")"), expr
            assert expr.count("{") == expr.count("}"), expr
    quantiles = [t["expr"] for p in graphs for t in p["targets"] if "histogram_quantile" in t["expr"]]
    assert {m for e in quantiles for m in re.findall(r"epibus_\w+_bucket", e)} == {
        "epibus_publish_to_journaled_seconds_bucket",
        "epibus_publish_to_recallable_seconds_bucket",
        "epibus_request_seconds_bucket",
    }
    config = NodeConfig(home=home, nats_url=nats_server.url, journal_url=sqlite_journal_url)
    async with Node(config) as node:
        assert node.metrics is not None
        status, body = await asyncio.to_thread(scrape, node.metrics.url, node.metrics.token)
    assert status == 200
    assert used - exported_names(body) == set()


def test_epibus_up_prints_its_metrics_url_serves_it_and_frees_the_port_when_it_stops(tmp_path: Path) -> None:
    home = tmp_path / "home"
    refused = subprocess.run(
        [sys.executable, "-m", "epibus", "up", "--metrics-host", "0.0.0.0"],
        env={k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"EPIBUS_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert refused.returncode == 1
    assert "--metrics-remote" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert not (home / "node.json").exists()

    process, status = start_node_process(home, "--mirror", "off")
    try:
        url = status["metrics_url"]
        assert url.startswith("http://127.0.0.1:")
        assert scrape(url, None)[0] == 401
        code, body = scrape(url, (home / TOKEN_FILE).read_text().strip())
        assert code == 200
        assert "epibus_nats_connected 1.0" in body
    finally:
        stop_node_process(process)
    assert process.returncode == 0
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass


async def test_a_reindex_keeps_the_mirrors_counts_going(
    nats_server: NatsServer, home: Path, sqlite_journal_url: str, project: str
) -> None:
    config = NodeConfig(home=home, nats_url=nats_server.url, journal_url=sqlite_journal_url)
    async with Node(config) as node, connect(nats_server.url, agent="alice", home=home) as alice:
        for i in range(2):
            await alice.publish(alice.event("finding", finding(i), project=project))

        def mirrored() -> float:
            runner = node.mirror_runner
            return dict(runner.tally.handled.items()).get((project, "finding"), 0) if runner else 0

        await eventually(lambda: mirrored() == 2, timeout_s=30)
        before = node.mirror_runner
        await node.reindex_mirror()
        assert node.mirror_runner is not before
        await alice.publish(alice.event("finding", finding(2), project=project))
        await eventually(lambda: mirrored() == 3, timeout_s=30)
        assert node.mirror_runner is not None
        assert node.mirror_runner.stats.handled == 3  # what `epibus status` shows agrees with the metrics
        found = await samples(node)
    assert values(found, "epibus_events_mirrored_total", "project", "kind")[(project, "finding")] == 3
