"""What the `epibus chaos` tests share: running the command as a user does, and reading its report and leftovers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RUN_TIMEOUT_S = 900
SOAK_TIMEOUT_S = 3600
PRESENCE_ONLY = "presence only: asked through the running node's lookup service"


def chaos(run_dir: Path, *args: str, timeout_s: float = RUN_TIMEOUT_S) -> tuple[int, dict[str, Any]]:
    """`epibus chaos --json` in a process of its own, as a user runs it: its exit code and its report."""
    code, report, _ = chaos_process(run_dir, *args, timeout_s=timeout_s)
    return code, report


def chaos_process(run_dir: Path, *args: str, timeout_s: float = RUN_TIMEOUT_S) -> tuple[int, dict[str, Any], int]:
    """As `chaos`, with the command's pid (what it left behind is found by it: other runs may go side by side)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"EPIBUS_HOME": str(run_dir.parent)}
    with subprocess.Popen(
        [sys.executable, "-m", "epibus", "chaos", "--json", "--run-dir", str(run_dir), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL,
    ) as process:  # fmt: skip
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        finally:
            if process.poll() is None:
                process.kill()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"no report (exit {process.returncode}): {stderr[-3000:]}"
    return process.returncode, json.loads(lines[-1]), process.pid


def left_running(run_dir: Path) -> list[str]:
    """Processes whose command line names the run directory: none may outlive the command."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if str(run_dir) in argv:
            found.append(f"{proc.name}: {argv.replace(chr(0), ' ')[:200]}")
    return found


def what_failed(report: dict[str, Any], run_dir: Path) -> str:
    """The parts of a report that explain a failed run (the whole report is cut short by pytest): each failed
    store with the ids it lost, the settle, each fault with its target and time, the nodes' error and
    dead-letter lines."""
    failed = [store for store in report.get("stores", []) if not store.get("ok")]
    faults = [(f["fault"], f.get("target"), f["at_s"], f["outcome"]) for f in report.get("faults", [])]
    errors = [
        f"{log.parent.name}: {line[:240]}"
        for log in sorted((run_dir / "cluster").glob("node-*/node.log"))
        for line in log.read_text(errors="replace").splitlines()
        if " ERROR " in line or "Traceback" in line or "dead-lettered" in line
    ]
    return json.dumps({"failed": failed, "settled": report.get("settled"), "faults": faults, "errors": errors[-40:]})


def assert_every_store_holds_every_acknowledged_event(report: dict[str, Any], nodes: int) -> None:
    acknowledged = report["attempts"]["published"] + report["attempts"]["outboxed"]
    stores = {store["store"]: store for store in report["stores"]}
    expected = {f"{kind}@node-{i}" for kind in ("stream", "journal", "mirror") for i in range(1, nodes + 1)}
    assert set(stores) == expected
    for name, store in stores.items():
        assert (store["acked"], store["present"]) == (acknowledged, acknowledged), name
        assert (store["lost"], store["duplicated"], store["wrong"], store["error"]) == (0, 0, 0, None), name
    assert report["ok"] is True


def assert_failpoints_fired(run_dir: Path) -> None:
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "cluster").glob("node-*/node.log"))
    assert "failpoint observer-kill" in logs  # a node died half-way through a batch
    assert "failpoint mirror-unavailable is armed" in logs  # and a mirror held its events through an outage
