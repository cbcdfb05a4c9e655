"""One state change against the size of the project, in one run on one nats-server.

    python bench/state_change.py [--sizes 100,20000,100000] [--runs 3] [--full-up-to 20000] [--json]

For each size, a project is filled with that many signed findings (publish_many); then `--runs` rounds each time
one `verify` in every project in turn, from the client API (`EpibusClient.transition`, a connected client: CLI
start-up is not in it), each on a fresh claim. The ratio to the smallest size is taken round by round (the
machine is shared), and each read the direct path makes is timed alone. The whole project's fold (what every
transition did before: `project_view`, decide, publish) is timed too, up to `--full-up-to` events (it grows
with the project: 20,000 events take tens of seconds)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bus.client.client import EpibusClient, connect
from bus.client.project_view import _read_admitted
from bus.enrolment.registry import AgentRegistry
from bus.host.server import NatsServer
from bus.intake.admission import Admission
from bus.intake.batch_context import EnrolmentLog
from bus.intake.stream_read import last_matching
from bus.subjects import STREAM, artifact_filter, events_filter


async def fill(client: EpibusClient, project: str, n: int) -> None:
    chunk = 5_000
    for start in range(0, n, chunk):
        events = [
            client.event(
                "finding",
                {"text": f"finding {i} " + "x" * 40, "impact": 0.5, "confidence": 0.7, "subject": "bench"},
                project=project,
            )
            for i in range(start, min(n, start + chunk))
        ]
        await client.publish_many(events, timeout_s=600)


async def one_verify(author: EpibusClient, verifier: EpibusClient, project: str, *, whole: bool) -> float:
    claim = author.event(
        "finding",
        {"text": f"claim {uuid.uuid4().hex}", "impact": 0.5, "confidence": 0.6, "subject": "b"},
        project=project,
    )
    await author.publish(claim)
    start = time.perf_counter()
    view = await verifier.project_view(project) if whole else None
    await verifier.transition(
        "verified", {"note": "checked"}, project=project, artifact_id=claim.artifact_id, view=view
    )
    return time.perf_counter() - start


async def phases(author: EpibusClient, verifier: EpibusClient, project: str) -> dict[str, float]:
    """Where one direct read's time goes: each read it makes, timed alone (ms)."""
    claim = author.event(
        "finding",
        {"text": f"claim {uuid.uuid4().hex}", "impact": 0.5, "confidence": 0.6, "subject": "b"},
        project=project,
    )
    await author.publish(claim)
    admission = Admission(AgentRegistry(verifier.js))
    out: dict[str, float] = {}
    for name, read in (
        ("last_matching", lambda: last_matching(verifier.js, STREAM, artifact_filter(project, claim.artifact_id))),
        (
            "artifact_subjects",
            lambda: _read_admitted(verifier.js, admission, artifact_filter(project, claim.artifact_id)),
        ),
        ("forgets", lambda: _read_admitted(verifier.js, admission, events_filter(project, "forgotten"))),
        ("enrolments", lambda: EnrolmentLog(verifier.js, admission).read_filtered()),
    ):
        start = time.perf_counter()
        await read()
        out[name] = (time.perf_counter() - start) * 1000
    return out


async def run(sizes: list[int], runs: int, full_up_to: int) -> dict[str, Any]:
    """Fill a project per size, then take `runs` rounds, each timing one verify in every project in turn: every
    size sees the same load (the machine is shared), and the ratio is taken round by round."""
    results: dict[str, Any] = {"load_average": os.getloadavg(), "sizes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp) / "nats")
        server.start()
        try:
            home = Path(tmp) / "home"
            async with (
                connect(server.url, agent="bench-author", home=home, outbox=False) as author,
                connect(server.url, agent="bench-verifier", home=home, outbox=False) as verifier,
            ):
                projects: dict[int, str] = {}
                for size in sizes:
                    projects[size] = f"sc-{uuid.uuid4().hex[:8]}"
                    started = time.perf_counter()
                    await fill(author, projects[size], size)
                    figures: dict[str, Any] = {"fill_s": time.perf_counter() - started, "direct_s": []}
                    figures["whole_project_s"] = []
                    figures["phases"] = []
                    results["sizes"][size] = figures
                    await one_verify(author, verifier, projects[size], whole=False)  # warm: imports, caches
                for _ in range(runs):
                    for size in sizes:
                        figures = results["sizes"][size]
                        figures["direct_s"].append(await one_verify(author, verifier, projects[size], whole=False))
                        figures["phases"].append(await phases(author, verifier, projects[size]))
                        if size <= full_up_to:
                            whole = await one_verify(author, verifier, projects[size], whole=True)
                            figures["whole_project_s"].append(whole)
        finally:
            server.stop()
    base = results["sizes"][sizes[0]]["direct_s"]
    for figures in results["sizes"].values():
        figures["direct_ratio_to_smallest"] = statistics.median(
            mine / small for mine, small in zip(figures["direct_s"], base, strict=True)
        )
        figures["phases_ms"] = {
            name: statistics.median(p[name] for p in figures["phases"]) for name in figures["phases"][0]
        }
    results["load_average_after"] = os.getloadavg()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100,20000")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--full-up-to", type=int, default=20_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    results = asyncio.run(run(sizes, args.runs, args.full_up_to))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"load average {results['load_average']} before, {results['load_average_after']} after")
    for size, f in results["sizes"].items():
        direct = " ".join(f"{s * 1000:.0f}" for s in f["direct_s"])
        whole = " ".join(f"{s * 1000:.0f}" for s in f["whole_project_s"]) or "-"
        print(
            f"{size:>7} events: verify {direct} ms (x{f['direct_ratio_to_smallest']:.2f} of the smallest, "
            "median of the per-round ratios); "
            f"whole-project fold {whole} ms; filled in {f['fill_s']:.1f} s"
        )
        print("         reads alone, median (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in f["phases_ms"].items()))


if __name__ == "__main__":
    main()
