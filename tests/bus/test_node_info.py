"""node.json names the running node; a node that was killed is not running, even before its parent reaps it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bus.host.home import NodeInfo, read_node_info, write_node_info


def info_of(pid: int) -> NodeInfo:
    return NodeInfo(
        pid=pid, nats_url="nats://127.0.0.1:4222", monitor_url=None, journal_url="sqlite:///x.db",
        outbox_path="outbox.db", embedded_server=True, started_at=datetime.now(UTC).isoformat(),
    )  # fmt: skip


def test_a_node_killed_with_9_and_not_yet_reaped_is_not_running(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_node_info(tmp_path, info_of(child.pid))
        assert read_node_info(tmp_path) is not None  # running: the file names it
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the killed child never became a zombie"
            time.sleep(0.01)
        assert read_node_info(tmp_path) is None  # a zombie: killed, only not reaped by its parent yet
    finally:
        child.kill()
        child.wait()
