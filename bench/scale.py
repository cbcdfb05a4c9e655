"""`python -m bench --scale`: a million events through one node started as a user starts it (`epibus up`, the
embedded defaults: nats-server, SQLite journal, qdrant-edge mirror), measured from outside its processes.

1. The node runs with `--mirror off`; an agent publishes the events in waves (`publish_many`); the journal
   drains them. The node stops.
2. It starts again with the edge mirror, which catches up on the whole stream: its ingest rate near 10k points
   and near the end, node and engine RSS against points mirrored (the slope), the peak.
3. Stopped: each store's bytes on disk per event. Started again: restart to ready, RSS once idle, recall p50/p99
   from an agent (texts already published, so the first hit is known: self-recall@1).

The mirror's vectors: the model's for one text in SAMPLE_EVERY, deterministic clustered unit vectors for the
rest (bench.sampled); the model's own rate is its own line. The agent's publish budget is lifted for the run."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import psutil

from bench import sampled
from bench.harness import percentile
from bus.client.client import connect
from bus.host.home import default_journal_url
from bus.identity.signing import node_key
from bus.subjects import STREAM
from epibus.monitoring.metrics_http import TOKEN_FILE
from epibus.ops.disk_use import store_sizes
from observers.mirror.embed import FastEmbedder

WAVE = 20_000
RECALLS = 200
PROJECT = "scale"
UP_ARGS = ("--name", "scale", "--budget-msgs", "100000000", "--budget-mib", "1000000")
NEAR_START = (2_000, 20_000)  # the mirror's rate near 10k points: between these counts
TARGETS = {"rss_mb": 1536.0, "slope_b": 1024.0, "disk_kib": 4.0, "ready_s": 10.0, "recall_p99_ms": 10.0, "ratio": 0.8}


def text(i: int) -> str:
    """A finding of 60-90 characters, distinct per i."""
    words = ("cache", "queue", "disk", "lease", "index", "shard", "token", "retry", "flush", "socket", "quota")
    tail = " ".join(words[(i // 11**k) % 11] for k in range(4))
    return f"finding {i}: the {tail} path stalls when node {i % 97} restarts under load"


@dataclass
class Sampler:
    """RSS of the node's processes (the node, its mirror engine, its nats-server, seal workers), once a second."""

    pid: int
    samples: list[dict[str, float]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.wait(1.0):
            sample = rss_by_role(self.pid)
            if sample:
                anon = {f"anon_{role}": mb for role, mb in rss_by_role(self.pid, anon=True).items()}
                self.samples.append({"t": time.monotonic(), **sample, **anon})


def anon_mb(pid: int) -> float:
    """A process's anonymous resident memory (RssAnon), MB: what it holds, without the page cache of the files it
    maps (qdrant-edge's on-disk vectors, payload and graph), which the kernel takes back under pressure."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


def rss_by_role(pid: int, *, anon: bool = False) -> dict[str, float]:
    """MB resident per role (`anon`: anonymous memory only, see anon_mb)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    found = {"node": 0.0, "engine": 0.0, "nats": 0.0, "seal": 0.0}
    for proc in procs:
        try:
            line = " ".join(proc.cmdline())
            rss = anon_mb(proc.pid) if anon else proc.memory_info().rss / 2**20
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            continue
        role = (
            "node" if proc.pid == pid else "nats" if "nats-server" in line
            else "seal" if "observers.mirror.seal" in line else "engine" if "observers.mirror" in line else "node"
        )  # fmt: skip
        found[role] += rss
    return found


def start_node(home: Path, *args: str) -> tuple[subprocess.Popen[str], float]:
    process, seconds, _ = start_node_said(home, *args)
    return process, seconds


def start_node_said(home: Path, *args: str) -> tuple[subprocess.Popen[str], float, dict[str, Any]]:
    """Start `epibus up --json` and wait for its ready line: the process, seconds to ready, what the line said."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"EPIBUS_HOME": str(home)}
    env["EPIBUS_BENCH_SAMPLE_EVERY"] = str(sampled.SAMPLE_EVERY)
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.scale_node", "up", "--json", *UP_ARGS, *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"epibus up exited {process.wait()}: {process.stderr.read() if process.stderr else ''}")
    said: dict[str, Any] = json.loads(line)
    return process, time.perf_counter() - started, said


def stop_node(process: subprocess.Popen[str]) -> None:
    process.terminate()
    process.wait(timeout=600)


async def consumer_done(home: Path, prefix: str) -> tuple[int, int]:
    """(events the node's consumer named prefix* has finished, events in the stream)."""
    nc = await nats.connect(json.loads((home / "node.json").read_text())["nats_url"], **node_key(home).nats_credentials)
    try:
        js = nc.jetstream()
        info = await js.stream_info(STREAM)
        for consumer in await js.consumers_info(STREAM):
            if consumer.name.startswith(prefix):
                done = int(info.state.messages) - int(consumer.num_pending or 0) - int(consumer.num_ack_pending or 0)
                return done, int(info.state.messages)
        return 0, int(info.state.messages)
    finally:
        await nc.close()


async def publish_all(home: Path, events: int, report: dict[str, Any]) -> None:
    started = time.perf_counter()
    async with connect(agent="bench", home=home, outbox=False) as client:
        for offset in range(0, events, WAVE):
            wave = [
                client.event("finding", {"text": text(i), "impact": 0.5, "confidence": 0.7, "subject": "scale"},
                             project=PROJECT)
                for i in range(offset, min(events, offset + WAVE))
            ]  # fmt: skip
            await client.publish_many(wave, timeout_s=600)
    report["publish_per_s"] = round(events / (time.perf_counter() - started))


async def wait_consumer(home: Path, prefix: str, events: int, progress: list[tuple[float, int]]) -> None:
    while True:
        done, _ = await consumer_done(home, prefix)
        progress.append((time.monotonic(), done))
        if done >= events:
            return
        await asyncio.sleep(1.0)


def rate_between(progress: list[tuple[float, int]], low: int, high: int) -> float:
    inside = [(t, n) for t, n in progress if low <= n <= high]
    if len(inside) < 2 or inside[-1][0] == inside[0][0]:
        raise RuntimeError(f"too few samples between {low} and {high} points to take a rate")
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


async def model_rate() -> float:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model = await FastEmbedder(Path(tmp)).load()
        try:
            texts = [text(i) for i in range(2_000)]
            started = time.perf_counter()
            await model.embed(texts)
            return len(texts) / (time.perf_counter() - started)
        finally:
            model.close()


async def idle_rss(pid: int, *, settle_s: float = 20.0, limit_s: float = 900.0) -> dict[str, float]:
    """RSS once no seal worker has run for settle_s (the mirror's background work is done), or at limit_s."""
    deadline, quiet_since = time.monotonic() + limit_s, time.monotonic()
    while time.monotonic() < deadline:
        if rss_by_role(pid).get("seal", 0.0) > 0:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= settle_s:
            break
        await asyncio.sleep(1.0)
    return rss_by_role(pid)


def recall_seconds(home: Path) -> dict[str, float]:
    """The node's recall counters from /metrics: recalls answered and seconds per phase (embed, search, total)."""
    token = (home / TOKEN_FILE).read_text().strip()
    url = json.loads((home / "node.json").read_text())["metrics_url"]
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        text = answer.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("epibus_recalls_total "):
            found["recalls"] = float(line.split()[-1])
        elif line.startswith("epibus_recall_seconds_total{"):
            found[line.split('phase="')[1].split('"')[0]] = float(line.split()[-1])
    return found


async def recall_pass(home: Path, events: int) -> tuple[list[float], int, dict[str, float]]:
    """RECALLS recalls through the node: latencies (ms), self-hits at 1, and the node's mean ms per recall phase."""
    latencies, first = [], 0
    before = await asyncio.to_thread(recall_seconds, home)
    async with connect(agent="bench", home=home, outbox=False) as client:
        for q in range(RECALLS):
            i = (q * 4_999 + 17) % events
            started = time.perf_counter()
            answer = await client.recall(text(i), PROJECT, k=10)
            latencies.append((time.perf_counter() - started) * 1000)
            first += bool(answer.hits) and answer.hits[0]["content"] == text(i)
    after = await asyncio.to_thread(recall_seconds, home)
    answered = after["recalls"] - before.get("recalls", 0.0)
    phases = {k: round(1000 * (after[k] - before.get(k, 0.0)) / answered, 1) for k in ("embed", "search", "total")}
    return latencies, first, phases


async def recall_figures(home: Path, events: int) -> dict[str, Any]:
    """Recalls right after the restart (cold: the shards' pages as the restart left them), then the same queries
    again (warm): the latencies and, from the node's own counters, where a recall's time goes."""
    cold, first, cold_phases = await recall_pass(home, events)
    warm, _, warm_phases = await recall_pass(home, events)
    return {
        "recall_p50_ms": round(percentile(cold, 0.5), 1),
        "recall_p99_ms": round(percentile(cold, 0.99), 1),
        "recall_warm_p50_ms": round(percentile(warm, 0.5), 1),
        "recall_warm_p99_ms": round(percentile(warm, 0.99), 1),
        "recall_phases_ms": {"cold": cold_phases, "warm": warm_phases},
        "self_recall_at_1": round(first / RECALLS, 3),
    }


def total(sample: dict[str, float], *roles: str) -> float:
    return sum(sample.get(r, 0.0) for r in roles)


async def run_scale(root: Path, events: int, say: Any) -> dict[str, Any]:
    home = root / "home"
    report: dict[str, Any] = {"events": events, "sample_every": sampled.SAMPLE_EVERY}
    say("model rate on 2,000 texts …")
    report["model_texts_per_s"] = round(await model_rate(), 1)
    say(f"publishing {events:,} events, journal only …")
    node, report["first_start_s"] = start_node(home, "--mirror", "off")
    try:
        await publish_all(home, events, report)
        journal_progress: list[tuple[float, int]] = []
        await wait_consumer(home, "journal-", events, journal_progress)
    finally:
        stop_node(node)
    say("mirror catching up on the stream …")
    node, report["mirror_start_s"] = start_node(home, "--mirror", "edge")
    sampler = Sampler(node.pid)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    progress: list[tuple[float, int]] = []
    try:
        started = time.monotonic()
        await wait_consumer(home, "mirror-", events, progress)
        report["mirror_catch_up_s"] = round(time.monotonic() - started, 1)
        after = await idle_rss(node.pid)
        report["rss_anon_after_ingest_mb"] = {k: round(v) for k, v in rss_by_role(node.pid, anon=True).items()}
    finally:
        sampler.stop.set()
        thread.join()
        stop_node(node)
    report["rate_near_10k"] = round(rate_between(progress, *NEAR_START))
    report["rate_near_end"] = round(rate_between(progress, int(events * 0.9), events))
    report["rss_after_ingest_mb"] = {k: round(v) for k, v in after.items()}
    peak = max(sampler.samples, key=lambda s: total(s, "node", "engine", "nats", "seal"))
    report["rss_peak_mb"] = {k: round(v) for k, v in peak.items() if k != "t" and not k.startswith("anon_")}
    report["rss_slope_b_per_event"] = slope(sampler.samples, progress, events)
    report["anon_slope_b_per_event"] = slope(sampler.samples, progress, events, anon=True)
    sizes = store_sizes(home, default_journal_url(home))
    report["disk"] = {s.store: round(s.bytes / events) for s in sizes}
    report["disk_total_b_per_event"] = round(sum(s.bytes for s in sizes) / events)
    say("restart to ready, recall …")
    node, report["restart_to_ready_s"], said = start_node_said(home, "--mirror", "edge")
    report["restart_parts_s"] = said.get("startup_s", {})
    try:
        report.update(await recall_figures(home, events))
        report["rss_after_restart_mb"] = {k: round(v) for k, v in (await idle_rss(node.pid, settle_s=5)).items()}
    finally:
        stop_node(node)
    return report


def slope(
    samples: list[dict[str, float]], progress: list[tuple[float, int]], events: int, *, anon: bool = False
) -> float:
    """Node + engine RSS growth per mirrored event, from 10% to the end of the catch-up (least squares); `anon`:
    of their anonymous memory only (without the mapped file pages the kernel may take back)."""
    roles = ("anon_node", "anon_engine") if anon else ("node", "engine")
    pairs = []
    for sample in samples:
        done = [n for t, n in progress if t <= sample["t"]]
        if done and done[-1] >= events * 0.1:
            pairs.append((done[-1], total(sample, *roles) * 2**20))
    if len(pairs) < 3:
        raise RuntimeError("too few memory samples to take a slope")
    n = len(pairs)
    mean_x, mean_y = sum(p[0] for p in pairs) / n, sum(p[1] for p in pairs) / n
    cov = sum((x - mean_x) * (y - mean_y) for x, y in pairs)
    var = sum((x - mean_x) ** 2 for x, _ in pairs)
    return round(cov / var, 1) if var else 0.0


def scale_rows(report: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(figure, value, target, met) for the table and the docs."""
    t = TARGETS
    after, peak = report["rss_after_ingest_mb"], report["rss_peak_mb"]
    node_after = after["node"] + after["engine"] + after["nats"]
    restart = report["rss_after_restart_mb"]
    node_restart = restart["node"] + restart["engine"] + restart["nats"]
    kib = report["disk_total_b_per_event"] / 1024
    ratio = report["rate_near_end"] / report["rate_near_10k"]
    stores = ", ".join(f"{k} {v:,}" for k, v in report["disk"].items())
    return [
        ("events (journal and mirror)", f"{report['events']:,}", "", None),
        ("vectors from the model", f"1 in {report['sample_every']} texts; the rest unit vectors", "", None),
        ("model alone, texts/s", f"{report['model_texts_per_s']:,}", "", None),
        ("publish_many, events/s", f"{report['publish_per_s']:,}", "", None),
        ("node RSS after ingest, MB (node+engine+nats)",
         f"{node_after:,} ({after['node']}+{after['engine']}+{after['nats']})",
         f"<= {t['rss_mb']:,.0f}", node_after <= t["rss_mb"]),
        ("  of which anonymous (not file pages), MB", _roles(report.get("rss_anon_after_ingest_mb")), "", None),
        ("node RSS after a restart, MB", f"{node_restart:,}", f"<= {t['rss_mb']:,.0f}", node_restart <= t["rss_mb"]),
        ("RSS peak while mirroring, MB (with seal workers)", f"{sum(peak.values()):,} (seal {peak['seal']})", "", None),
        ("RAM slope, bytes per mirrored event", f"{report['rss_slope_b_per_event']:,}", f"<= {t['slope_b']:,.0f}",
         report["rss_slope_b_per_event"] <= t["slope_b"]),
        ("  of anonymous memory only", f"{report['anon_slope_b_per_event']:,}" if "anon_slope_b_per_event" in report
         else "not measured", "", None),
        ("home disk, KiB per event", f"{kib:.2f}", f"<= {t['disk_kib']}", kib <= t["disk_kib"]),
        ("  per store, bytes per event", stores, "", None),
        ("restart to ready, s", f"{report['restart_to_ready_s']:.1f}", f"<= {t['ready_s']}",
         report["restart_to_ready_s"] <= t["ready_s"]),
        ("  of which, s", _parts(report.get("restart_parts_s")), "", None),
        ("recall via the node p50 / p99, ms", f"{report['recall_p50_ms']} / {report['recall_p99_ms']}",
         f"p99 <= {t['recall_p99_ms']}", report["recall_p99_ms"] <= t["recall_p99_ms"]),
        ("recall again, warm, p50 / p99, ms",
         f"{report.get('recall_warm_p50_ms', '-')} / {report.get('recall_warm_p99_ms', '-')}", "", None),
        ("  the node's mean per recall, cold / warm, ms", _phases(report.get("recall_phases_ms")), "", None),
        ("self-recall@1 (a published text finds its event)", f"{report['self_recall_at_1']}", "", None),
        ("mirror ingest near 10k / near the end, points/s", f"{report['rate_near_10k']:,} / {report['rate_near_end']:,}"
         f" = {ratio:.2f}", f">= {t['ratio']}", ratio >= t["ratio"]),
        ("mirror catch-up on the whole stream, s", f"{report['mirror_catch_up_s']:,}", "", None),
    ]  # fmt: skip


def _parts(parts: dict[str, float] | None) -> str:
    if not parts:
        return "not measured"
    return ", ".join(f"{part} {seconds:.1f}" for part, seconds in sorted(parts.items(), key=lambda p: -p[1]))


def _phases(phases: dict[str, dict[str, float]] | None) -> str:
    if not phases:
        return "not measured"
    cold, warm = phases["cold"], phases["warm"]
    return ", ".join(f"{k} {cold[k]} / {warm[k]}" for k in ("embed", "search", "total"))


def _roles(mb: dict[str, float] | None) -> str:
    if mb is None:
        return "not measured"
    return f"{mb['node'] + mb['engine'] + mb['nats']:,} ({mb['node']}+{mb['engine']}+{mb['nats']})"


def scale_markdown(report: dict[str, Any]) -> str:
    lines = ["| figure | value | target | met |", "|---|---|---|---|"]
    for figure, value, target, met in scale_rows(report):
        lines.append(f"| {figure} | {value} | {target} | {'' if met is None else 'yes' if met else 'no'} |")
    return "\n".join(lines) + "\n"
