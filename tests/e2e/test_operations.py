"""`epibus status`, `doctor`, `down`, `--version` and shell completion through the command line, against real
`epibus up` processes: what status reports is checked against the processes in /proc and the node's own
start line, and `down` against the processes and files it leaves."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from bus.host.processes import alive
from bus.host.server import nats_server_binary, server_version
from epibus.cli.app import app
from tests.bus.test_server import nats_servers_on
from tests.e2e.test_mesh_processes import env_for, epibus
from tests.support import eventually_sync, start_node_process, stop_node_process


def as_json(result: subprocess.CompletedProcess[str] | Result) -> Any:
    return json.loads(result.stdout.strip().splitlines()[-1])


def cli(*args: str) -> Result:
    """The command line in this process: for commands whose subject is not the process they run in."""
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


@pytest.mark.slow
def test_status_doctor_and_down_on_a_running_node(tmp_path: Path) -> None:
    home = tmp_path / "home"
    process, up = start_node_process(home, "--mirror", "off")
    try:
        servers = nats_servers_on(home / "nats")
        assert len(servers) == 1
        status = as_json(eventually_sync(lambda: _status_answering(home), timeout_s=30))
        assert (status["running"], status["answering"], status["problems"]) == (True, True, [])
        assert status["pid"] == up["pid"] == process.pid
        assert status["server_pids"] == servers
        assert up["monitor_url"] is None  # none is served: its pages would list every client's key
        assert status["urls"] == {"nats": up["nats_url"], "metrics": up["metrics_url"]}
        assert (status["name"], status["authenticated"], status["mirror"]["backend"]) == (up["name"], True, "off")
        journal = [stats for name, stats in status["observers"].items() if name.startswith("journal-")]
        assert len(journal) == 1
        assert journal[0]["stalled"] is False
        assert status["outbox"] == {"depth": 0, "parked": 0}

        checks = cli("doctor", "--json", "--home", str(home))
        assert checks.exit_code == 0, checks.stdout
        report = {line["check"]: line["status"] for line in as_json(checks)}
        assert set(report.values()) == {"ok"}, report
        assert {"jetstream", "stream EPI", "stream EPI_DLQ", "node key", "journal", "home mode"} <= report.keys()

        down = epibus(home, "down", "--json")
        stopped = as_json(down)
        assert (stopped["stopped"], stopped["killed"], stopped["pid"], stopped["servers"]) == (
            True,
            False,
            process.pid,
            servers,
        )
        assert process.wait(timeout=5) == 0  # it stopped in order
        assert not any(alive(pid) for pid in servers)
        assert not (home / "node.json").exists()
    finally:
        stop_node_process(process)
    after = cli("status", "--json", "--home", str(home))
    assert after.exit_code == 1
    assert as_json(after)["running"] is False
    again = cli("down", "--json", "--home", str(home))
    assert (again.exit_code, as_json(again)["stopped"]) == (0, False)  # nothing to stop


def _status_answering(home: Path) -> subprocess.CompletedProcess[str] | None:
    result = epibus(home, "status", "--json", check=False)
    return result if result.returncode == 0 else None


@pytest.mark.slow
def test_down_kills_a_node_that_does_not_stop_in_time_and_says_so(tmp_path: Path) -> None:
    home = tmp_path / "home"
    process, _ = start_node_process(home, "--mirror", "off")
    try:
        servers = nats_servers_on(home / "nats")
        os.kill(process.pid, signal.SIGSTOP)  # frozen: SIGTERM waits until it runs again, which it never does
        down = epibus(home, "down", "--timeout", "1")
        assert "killed (SIGKILL) after 1s" in down.stdout
        assert process.wait(timeout=10) == -signal.SIGKILL
        eventually_sync(lambda: not any(alive(pid) for pid in servers))  # its server dies with it
        assert not (home / "node.json").exists()
    finally:
        stop_node_process(process)


def test_a_node_json_naming_another_process_is_stale_and_that_process_is_left_alone(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    other = subprocess.Popen(["sleep", "60"])
    try:
        record = {
            "pid": other.pid,
            "nats_url": "nats://127.0.0.1:1",
            "monitor_url": None,
            "journal_url": "sqlite:///x",
            "outbox_path": str(home / "outbox.db"),
            "embedded_server": True,
            "started_at": "2020-01-01T00:00:00+00:00",  # long before `sleep` started: a reused pid
        }
        (home / "node.json").write_text(json.dumps(record))
        status = cli("status", "--home", str(home))
        assert status.exit_code == 1
        assert f"node.json names pid {other.pid}" in " ".join(status.stdout.split())
        result = cli("down", "--json", "--home", str(home))
        down = as_json(result)
        assert (result.exit_code, down["stopped"]) == (0, False)
        assert str(other.pid) in down["reason"]
        assert other.poll() is None  # not signalled
        assert not (home / "node.json").exists()
    finally:
        other.kill()
        other.wait()


def test_version_names_the_package_and_the_bundled_server() -> None:
    package = importlib.metadata.version("epibus")
    server = ".".join(map(str, server_version(nats_server_binary())))
    assert cli("--version").stdout.strip() == f"epibus {package} (nats-server {server})"
    assert as_json(cli("version", "--json")) == {"epibus": package, "nats_server": server}


def test_completing_sta_offers_stats_and_status(tmp_path: Path) -> None:
    env = env_for(tmp_path) | {"_EPIBUS_COMPLETE": "complete_bash", "COMP_WORDS": "epibus sta", "COMP_CWORD": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "epibus"], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.split() == ["stats", "status", "statusline"]
    fish = as_json(cli("completion", "fish", "--json"))
    assert fish["shell"] == "fish"
    assert "_EPIBUS_COMPLETE=complete_fish" in fish["script"]


def test_the_printed_bash_script_completes_in_bash(tmp_path: Path) -> None:
    """The script `epibus completion bash` prints, sourced in a real bash, calling the installed `epibus`."""
    script = (
        'eval "$(epibus completion bash)"; COMP_WORDS=(epibus sta); COMP_CWORD=1; '
        '_epibus_completion epibus sta epibus; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = env_for(tmp_path) | {"PATH": path}
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split() == ["stats", "status", "statusline"]
