"""`kill -9` of a running `epibus up`: its nats-server goes with it, and the next `epibus up` on the same home runs
exactly one server and still has every event acknowledged before the kill. Read back through /proc and nats-py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from tests.bus.test_server import alive, nats_servers_on
from tests.e2e.test_cli import as_json, epibus
from tests.support import eventually_sync, operator_credentials

pytestmark = pytest.mark.slow


class Up:
    """`epibus up` in a session of its own, so the test can kill its whole process group as a terminal would."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.processes: list[subprocess.Popen[str]] = []

    def start(self) -> dict[str, object]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"EPIBUS_HOME": str(self.home)}
        process = subprocess.Popen(
            [sys.executable, "-m", "epibus", "up", "--json", "--mirror", "off"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.processes.append(process)
        assert process.stdout is not None
        assert process.stderr is not None
        line = process.stdout.readline()
        assert line, f"`epibus up` exited with {process.poll()}: {process.stderr.read()}"
        status: dict[str, object] = json.loads(line)
        return status

    def kill_group(self) -> None:
        process = self.processes[-1]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=30)
        for pid in nats_servers_on(self.home / "nats"):  # left behind by a failing run
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    runner = Up(tmp_path / "epibus-home")
    try:
        yield runner
    finally:
        runner.close()


def publish_finding(home: Path, text: str) -> str:
    out = epibus(
        home,
        "publish",
        "finding",
        "-p",
        "demo",
        "--text",
        text,
        "--impact",
        "0.5",
        "--confidence",
        "0.7",
        "--subject",
        "kill",
        "--wait",
        "published",
        "--json",
    )
    receipt = as_json(out)
    assert isinstance(receipt, dict)
    assert receipt["level"] == "published"
    return str(receipt["event_id"])


def stream_event_ids(url: str, home: Path) -> set[str]:
    """The Nats-Msg-Id of every message in stream EPI, read message by message up to the last sequence."""

    async def read() -> set[str]:
        async with asyncio.timeout(30):  # nats-py's connect can wait forever on a server that is gone
            nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0, **operator_credentials(home))
            try:
                js = nc.jetstream()
                info = await js.stream_info("EPI")
                ids = set()
                for seq in range(info.state.first_seq, info.state.last_seq + 1):
                    msg = await js.get_msg("EPI", seq)
                    ids.add((msg.headers or {}).get("Nats-Msg-Id", f"seq {seq} without an id"))
                return ids
            finally:
                await nc.close()

    return asyncio.run(read())


def test_kill_9_of_a_running_node_leaves_no_nats_server_behind(up: Up) -> None:
    up.start()
    (server_pid,) = nats_servers_on(up.home / "nats")
    up.kill_group()
    eventually_sync(lambda: not alive(server_pid), timeout_s=10)
    assert nats_servers_on(up.home / "nats") == []


def test_a_node_started_again_after_kill_9_runs_one_server_and_keeps_every_published_event(up: Up) -> None:
    up.start()
    published = {publish_finding(up.home, f"acknowledged before the kill {i}") for i in range(3)}
    up.kill_group()
    status = up.start()
    assert len(nats_servers_on(up.home / "nats")) == 1
    assert published - stream_event_ids(str(status["nats_url"]), up.home) == set()
