"""A node catching up on a long, hostile history, then reconciling it: how fast it catches up against a raw
read of the same stream in the same run, and what `verify` finds afterwards (it must find nothing stale).

    python bench/catch_up.py [--projects 100] [--seed 7] [--json]

The history: --projects random histories of up to 30 operations each (claims of every kind by three agents,
verifications, contradictions, resolutions, supersessions, rollbacks, forgets done as the client does them,
and forged, mis-signed, misfiled, misdated, reused-id and resent messages), from the grammar the
differential tests use (`tests/histories.py`). Then a fresh node (journal + edge mirror, the offline model)
catches up from sequence 1; the baseline is a raw ephemeral pull consumer reading the same messages."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as `python bench/catch_up.py`: the repository root goes first on sys.path for the
# tests' history generator.
sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

import nats  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bus.host.server import NatsServer  # noqa: E402
from bus.intake.stream_read import read_stream  # noqa: E402
from bus.subjects import STREAM  # noqa: E402
from epibus.node.node import Node, NodeConfig  # noqa: E402
from observers.verify import verify  # noqa: E402
from tests.e2e.test_one_truth import caught_up  # noqa: E402
from tests.histories import build, fresh_project, make_keys, publish, random_history, register_keys  # noqa: E402


async def run(projects: int, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = NatsServer(root / "nats")
        server.start()
        try:
            keys = make_keys()
            await register_keys(server.url, keys)
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            rng = random.Random(seed)
            for _ in range(projects):
                await publish(js, build(random_history(rng), keys, fresh_project()))
            messages = (await js.stream_info(STREAM)).state.messages
            start = time.perf_counter()
            read = 0
            async for batch in read_stream(js, STREAM):
                read += len(batch)
            raw_s = time.perf_counter() - start
            await nc.close()
            config = NodeConfig(home=root / "node", nats_url=server.url, agent="late", journal_url=None)
            async with Node(config) as node:
                start = time.perf_counter()
                await caught_up(node)
                catch_up_s = time.perf_counter() - start
                assert node.js is not None
                assert node.journal is not None
                report = await verify(node.js, node.journal, node.mirror)
        finally:
            server.stop()
    return {
        "projects": projects,
        "stream_messages": messages,
        "raw_read_s": raw_s,
        "raw_read_per_s": read / raw_s,
        "catch_up_s": catch_up_s,
        "catch_up_per_s": messages / catch_up_s,
        "ratio": raw_s / catch_up_s,
        "verify": report.as_dict(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--projects", type=int, default=100)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(run(args.projects, args.seed))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    table = Table(title=f"catch-up of {result['stream_messages']} messages ({args.projects} projects)")
    for column in ("what", "messages/s", "seconds", "ratio"):
        table.add_column(column)
    table.add_row("raw read of the stream", f"{result['raw_read_per_s']:,.0f}", f"{result['raw_read_s']:.2f}", "")
    table.add_row(
        "node catch-up (journal + mirror)",
        f"{result['catch_up_per_s']:,.0f}",
        f"{result['catch_up_s']:.2f}",
        f"{result['ratio']:.3f}",
    )
    Console().print(table)
    mirror = result["verify"]["mirror"]
    journal = result["verify"]["journal"]
    print(
        f"verify: journal missing {journal['missing']} extra {journal['extra']} mismatched {journal['mismatched']}; "
        f"mirror missing {mirror['missing']} extra {mirror['extra']} stale {mirror['stale']} "
        f"mismatched {mirror['mismatched']}; clean={result['verify']['clean']}"
    )
    sys.exit(0 if result["verify"]["clean"] else 1)


if __name__ == "__main__":
    main()
