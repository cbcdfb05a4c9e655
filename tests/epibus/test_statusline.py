"""The statusline's lean path and its reading of the home's files: the lazy `epibus` package still gives every
public name, the statusline loads none of the heavy libraries, and the line says `up` only for a fresh snapshot
of the live process node.json names (files written here, read back by `epibus statusline`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import typer

import epibus
from bus.host.home import NodeInfo, outbox_path, write_node_info, write_private
from epibus.monitoring.statusline import STATUS_FILE, STATUS_FORMAT, gather, line

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("nats", "sqlalchemy", "typer", "pydantic", "rich")


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_every_public_name_of_the_epibus_package_resolves_on_first_use() -> None:
    for name in epibus.__all__:
        value = getattr(epibus, name)
        if name in ("reads", "sync"):
            assert value.__name__.endswith(f".{name}")
        else:
            assert value.__name__ == name
    assert set(epibus.__all__) <= set(dir(epibus))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        _ = epibus.nothing_here
    star = run_python("import json; from epibus import *; import epibus; print(json.dumps(epibus.__all__))")
    assert star.returncode == 0, star.stderr
    assert json.loads(star.stdout) == epibus.__all__


def test_the_typer_app_lives_in_epibus_cli_app_and_its_help_lists_the_statusline() -> None:
    from epibus.cli.app import app

    assert isinstance(app, typer.Typer)
    helped = subprocess.run(
        [sys.executable, "-m", "epibus", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert helped.returncode == 0, helped.stderr
    assert "statusline" in helped.stdout


def test_importing_epibus_and_running_the_statusline_loads_no_nats_sqlalchemy_typer_or_pydantic(tmp_path: Path) -> None:
    code = (
        "import json, sys\n"
        "import epibus, epibus.cli\n"
        "sys.argv = ['epibus', 'statusline', '--json', '--home', sys.argv[1]]\n"
        "try:\n"
        "    epibus.cli.main()\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(json.dumps({'code': code, 'heavy': heavy}))\n"
    )
    ran = run_python(code, str(tmp_path / "home"))
    assert ran.returncode == 0, ran.stderr
    statusline, check = ran.stdout.splitlines()
    assert json.loads(statusline)["node"] == "down"
    assert json.loads(check) == {"code": 0, "heavy": []}


def record_node(home: Path, pid: int) -> None:
    started = datetime.now(UTC).isoformat()
    info = NodeInfo(pid, "nats://127.0.0.1:1", None, "sqlite://", str(outbox_path(home)), True, started, "n1")
    write_node_info(home, info)


def write_snapshot(home: Path, pid: int, *, age_s: float = 0.0, **figures: Any) -> None:
    written_at = (datetime.now(UTC) - timedelta(seconds=age_s)).isoformat()
    snapshot = {"format": STATUS_FORMAT, "node": "n1", "pid": pid, "written_at": written_at} | figures
    write_private(home / STATUS_FILE, json.dumps(snapshot))


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(timeout=30)
    return process.pid


AGENTS = {"alice": {"inbox": {"demo": 2, "ops": 1}, "ack": {"demo": 1}}}


def test_a_fresh_snapshot_of_the_live_node_gives_its_figures_per_project_or_summed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    record_node(home, os.getpid())
    write_snapshot(home, os.getpid(), agents=AGENTS, unknowns={"demo": 3, "ops": 4})
    demo = gather(home, "alice", "demo")
    assert (demo["node"], demo["inbox"], demo["ack"], demo["unknowns"]) == ("up", 2, 1, 3)
    assert line(demo) == "epibus up · outbox 0 · inbox 2 · ack 1 · unknowns 3 (demo)"
    every = gather(home, "alice", None)
    assert (every["inbox"], every["ack"], every["unknowns"]) == (3, 1, 7)
    assert line(every) == "epibus up · outbox 0 · inbox 3 · ack 1 · unknowns 7"


def test_figures_the_snapshot_does_not_hold_are_unknown_never_zero(tmp_path: Path) -> None:
    home = tmp_path / "home"
    record_node(home, os.getpid())
    write_snapshot(home, os.getpid(), agents=None, unknowns=None)  # the node could not read the mesh or journal
    found = gather(home, "alice", "demo")
    assert (found["node"], found["inbox"], found["ack"], found["unknowns"]) == ("up", None, None, None)
    assert line(found) == "epibus up · outbox 0 · inbox ? · ack ? · unknowns ? (demo)"
    write_snapshot(home, os.getpid(), agents=AGENTS, unknowns={})
    stranger = gather(home, "bob", "demo")  # no key of bob's under this home: the node does not count for him
    assert (stranger["inbox"], stranger["ack"], stranger["unknowns"]) == (None, None, 0)


@pytest.mark.parametrize(
    ("node_pid", "snapshot_pid", "age_s", "expected"),
    [
        ("live", "live", 30.0, "stale"),  # the node stopped writing (hung)
        ("live", "other", 0.0, "stale"),  # written by another process
        ("dead", "dead", 0.0, "down"),  # killed: node.json and a fresh snapshot left behind
        (None, "live", 0.0, "down"),  # no node.json at all
    ],
)
def test_the_node_is_up_only_for_a_fresh_snapshot_of_the_live_process_node_json_names(
    tmp_path: Path, node_pid: str | None, snapshot_pid: str, age_s: float, expected: str
) -> None:
    home = tmp_path / "home"
    pids = {"live": os.getpid(), "dead": dead_pid(), "other": os.getppid()}
    if node_pid is not None:
        record_node(home, pids[node_pid])
    write_snapshot(home, pids[snapshot_pid], age_s=age_s, agents=AGENTS, unknowns={"demo": 3})
    found = gather(home, "alice", "demo")
    assert (found["node"], found["inbox"], found["ack"], found["unknowns"]) == (expected, None, None, None)
    assert line(found) == f"epibus {expected} · outbox 0 waiting"


def test_a_snapshot_with_figures_that_are_not_counts_is_reported_and_the_command_still_exits_zero(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    record_node(home, os.getpid())
    write_snapshot(home, os.getpid(), agents={"alice": {"inbox": {"demo": -1}, "ack": {}}}, unknowns={})
    main = "import sys; from epibus.monitoring.statusline import main; sys.exit(main(sys.argv[1:]))"
    ran = run_python(main, "--home", str(home), "--agent", "alice")
    assert ran.returncode == 0
    assert ran.stdout == "epibus up · outbox 0 · inbox ? · ack ? · unknowns ? · status ?\n"
    ran_json = run_python(main, "--home", str(home), "--agent", "alice", "--json")
    assert ran_json.returncode == 0
    found = json.loads(ran_json.stdout)
    assert found["status_readable"] is False
    assert found["problems"] == ["status.json's inbox figures are not counts"]
    assert found["line"] == "epibus up · outbox 0 · inbox ? · ack ? · unknowns ? · status ?"


def test_colour_codes_appear_only_when_asked_for_and_never_in_a_pipe(tmp_path: Path) -> None:
    home = tmp_path / "home"
    record_node(home, os.getpid())
    write_snapshot(home, os.getpid(), agents=AGENTS, unknowns={})
    assert line(gather(home, "alice", None), colour=True).startswith("epibus \033[32mup\033[0m · ")
    piped = run_python(
        "import sys; from epibus.monitoring.statusline import main; sys.exit(main(sys.argv[1:]))", "--home", str(home)
    )
    assert piped.stdout.startswith("epibus up · ")
    assert "\033" not in piped.stdout
