"""`epibus statusline` latency, as a shell prompt runs it: a new process each time, against a running node.

    python bench/statusline.py [-n 50] [--json]

Starts `epibus up` (mirror off) in a temporary home, publishes one claim so the snapshot has an agent, waits for
the node to read as up, then runs each command N times as a subprocess, the commands taking turns so that
machine noise falls on all of them alike: `python -c pass` (the baseline: an interpreter that does nothing),
`python -c "import epibus"` (the lazy package), and `epibus statusline` in text and JSON. Prints p50 and p95 in
milliseconds and each p50's ratio to the baseline's (baseline / this). Measures this checkout (PYTHONPATH)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
WARM_UP = 3


def epibus_command() -> list[str]:
    """The console script next to this interpreter, as a prompt runs it; `python -m epibus` without one."""
    script = Path(sys.executable).with_name("epibus")
    return [str(script)] if script.exists() else [sys.executable, "-m", "epibus"]


def run_once(command: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)
    elapsed_ms = (time.perf_counter() - start) * 1000
    if done.returncode != 0:
        raise SystemExit(f"benchmark invalid: {' '.join(command)} exited {done.returncode}: {done.stderr.strip()}")
    return elapsed_ms, done.stdout


def wait_until_up(statusline: list[str], env: dict[str, str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        facts = json.loads(run_once([*statusline, "--json"], env)[1])
        if facts["node"] == "up" and facts["inbox"] is not None:
            return
        time.sleep(0.2)
    raise SystemExit(f"benchmark invalid: the node did not read as up within {timeout_s:.0f}s")


def measure(commands: dict[str, list[str]], env: dict[str, str], n: int) -> dict[str, list[float]]:
    """Each command n times, taking turns; every statusline run must say the node is up."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    for i in range(WARM_UP + n):
        for name, command in commands.items():
            elapsed_ms, out = run_once(command, env)
            if "statusline" in command and "up" not in out:
                raise SystemExit(f"benchmark invalid: {name} printed {out.strip()!r}, expected the node up")
            if i >= WARM_UP:
                times[name].append(elapsed_ms)
    return times


def start_node(env: dict[str, str]) -> subprocess.Popen[str]:
    node = subprocess.Popen(
        [sys.executable, "-m", "epibus", "up", "--json", "--mirror", "off"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert node.stdout is not None
    if not node.stdout.readline():
        raise SystemExit(f"benchmark invalid: `epibus up` exited: {node.stderr.read() if node.stderr else ''}")
    return node


def main(n: int, as_json: bool) -> None:
    epibus = epibus_command()
    statusline = [*epibus, "statusline", "--agent", "alice", "-p", "bench"]
    commands = {
        "python -c pass (baseline)": [sys.executable, "-c", "pass"],
        "python -c 'import epibus'": [sys.executable, "-c", "import epibus"],
        "epibus statusline": statusline,
        "epibus statusline --json": [*statusline, "--json"],
    }
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")}
        env |= {"EPIBUS_HOME": str(Path(tmp) / "home"), "PYTHONPATH": str(ROOT)}
        node = start_node(env)
        try:
            claim = ["publish", "unknown", "-p", "bench", "--question", "q?", "--impact", "0.5", "--agent", "alice"]
            run_once([*epibus, *claim, "--json"], env)
            wait_until_up(statusline, env)
            times = measure(commands, env, n)
        finally:
            node.send_signal(signal.SIGTERM)
            node.wait(timeout=30)
    baseline = statistics.median(times["python -c pass (baseline)"])
    results = [
        {
            "what": name,
            "n": n,
            "p50_ms": round(statistics.median(xs), 1),
            "p95_ms": round(statistics.quantiles(xs, n=20)[-1], 1),
            "ratio_vs_baseline": None if name.endswith("(baseline)") else round(baseline / statistics.median(xs), 3),
        }
        for name, xs in times.items()
    ]
    if as_json:
        print(json.dumps({"n": n, "python": sys.version.split()[0], "command": epibus, "results": results}))
        return
    table = Table(title=f"epibus statusline, a new process per run, N={n} (ratio = baseline p50 / this p50)")
    for column in ("what", "p50 ms", "p95 ms", "ratio vs baseline"):
        table.add_column(column)
    for r in results:
        ratio = r["ratio_vs_baseline"]
        table.add_row(
            str(r["what"]), f"{r['p50_ms']}", f"{r['p95_ms']}", "baseline" if ratio is None else f"{ratio:.2f}"
        )
    Console().print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    main(args.n, args.json)
