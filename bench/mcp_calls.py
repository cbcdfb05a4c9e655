"""What an agent pays for reaching epibus through MCP: the same calls through `epibus mcp` (the official SDK's
client, stdio) and through the Python client, one after another, in the same run against the same node.

    python bench/mcp_calls.py [-n 300] [--json]

Rows: publish an `unknown` (receipt `published`), the safe `artifacts` read of the project (20 rows), and
`whoami` (the protocol's own round trip, no bus work). Baseline for the first two: the Python client's
`publish` and `observers.reads.artifacts` on the node's journal, called the same way (sequentially)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

# Run as `python bench/mcp_calls.py`: the repository root goes first on sys.path for the
# tests' node helpers.
sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

from mcp import Client, StdioServerParameters  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bus.client.client import connect  # noqa: E402
from observers import reads  # noqa: E402
from observers.journal import Journal  # noqa: E402
from tests.support import start_node_process, stop_node_process  # noqa: E402


async def timed(n: int, call: Callable[[int], Awaitable[Any]]) -> list[float]:
    await call(-1)  # warm: connections, caches, the first import of whatever the call needs
    samples = []
    for i in range(n):
        start = time.perf_counter()
        await call(i)
        samples.append(time.perf_counter() - start)
    return samples


def figures(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "calls_per_s": len(samples) / sum(samples),
        "p50_ms": statistics.median(ordered) * 1000,
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000,
    }


async def run(n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        process, _ = start_node_process(home)
        env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"EPIBUS_HOME": str(home)}
        project = f"bench-{uuid.uuid4().hex[:8]}"
        try:
            params = StdioServerParameters(
                command=sys.executable, args=["-m", "epibus", "mcp", "--agent", "ada"], env=env
            )
            async with Client(params, read_timeout_seconds=60) as mcp, connect(agent="ada", home=home) as client:

                async def mcp_publish(i: int) -> None:
                    args = {"project": project, "question": f"mcp question {i}", "impact": 0.3}
                    result = await mcp.call_tool("publish_unknown", args)
                    assert not result.is_error, result.content

                async def client_publish(i: int) -> None:
                    event = client.event(
                        "unknown", {"question": f"client question {i}", "impact": 0.3}, project=project
                    )
                    await client.publish(event)

                async def mcp_artifacts(i: int) -> None:
                    result = await mcp.call_tool("artifacts", {"project": project, "limit": 20})
                    assert not result.is_error, result.content

                journal = Journal(f"sqlite:///{home / 'journal.db'}")

                async def direct_artifacts(i: int) -> None:
                    await asyncio.to_thread(reads.artifacts, journal, project, limit=20)

                async def whoami(i: int) -> None:
                    assert not (await mcp.call_tool("whoami", {})).is_error

                rows = {
                    "publish, Python client (baseline)": figures(await timed(n, client_publish)),
                    "publish_unknown through epibus mcp": figures(await timed(n, mcp_publish)),
                    "artifacts, reads.artifacts on the journal (baseline)": figures(await timed(n, direct_artifacts)),
                    "artifacts through epibus mcp": figures(await timed(n, mcp_artifacts)),
                    "whoami through epibus mcp (protocol round trip)": figures(await timed(n, whoami)),
                }
                journal.close()
        finally:
            stop_node_process(process)
    publish_ratio = (
        rows["publish_unknown through epibus mcp"]["calls_per_s"]
        / rows["publish, Python client (baseline)"]["calls_per_s"]
    )
    read_ratio = (
        rows["artifacts through epibus mcp"]["calls_per_s"]
        / rows["artifacts, reads.artifacts on the journal (baseline)"]["calls_per_s"]
    )
    return {"calls": n, "rows": rows, "publish_ratio": publish_ratio, "artifacts_ratio": read_ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    result = asyncio.run(run(options.n))
    if options.json:
        print(json.dumps(result, indent=2))
        return
    table = Table(title=f"epibus mcp vs the Python client, {options.n} sequential calls each")
    for column in ("what", "calls/s", "p50 ms", "p99 ms"):
        table.add_column(column)
    for name, row in result["rows"].items():
        table.add_row(name, f"{row['calls_per_s']:.0f}", f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}")
    Console().print(table)
    print(f"ratio publish (mcp / client): {result['publish_ratio']:.2f}")
    print(f"ratio artifacts (mcp / direct): {result['artifacts_ratio']:.2f}")


if __name__ == "__main__":
    main()
