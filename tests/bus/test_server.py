"""The embedded nats-server's life: it dies with the process that started it, and a store directory never runs two
servers. Processes are found by reading /proc, not through NatsServer's own bookkeeping."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from bus.errors import Conflict
from bus.host.server import NatsServer, nats_server_binary
from tests.support import eventually_sync

# Starts a NatsServer in a process of its own, prints the server's pid, then waits for stdin to close (or, with
# "exit", leaves at once through os._exit). "no-death-signal" stands in for a platform without one.
HOLDER = """
import os, sys
from pathlib import Path
import bus.host.server
if "no-death-signal" in sys.argv:
    import bus.host.server_guard
    bus.host.server_guard.PARENT_DEATH_SIGNAL = 0
server = bus.host.server.NatsServer(Path(sys.argv[1]))
server.start()
print(server.pid, flush=True)
if "exit" in sys.argv:
    os._exit(0)
sys.stdin.read()
"""


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (an orphan's zombie may never be reaped here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def nats_servers_on(store_dir: Path) -> list[int]:
    """Pids of live nats-server processes whose command line names a path in store_dir."""
    root = str(store_dir.resolve())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if Path(argv[0]).name == "nats-server" and any(a.startswith(root) for a in argv[1:]) and alive(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)


@pytest.fixture
def store_dir(tmp_path: Path) -> Iterator[Path]:
    """A store directory; whatever nats-server still runs on it at the end is killed, so a failing test leaves
    no process behind."""
    path = tmp_path / "nats"
    yield path
    for pid in nats_servers_on(path):
        os.kill(pid, signal.SIGKILL)


def start_holder(store_dir: Path, *flags: str) -> tuple[subprocess.Popen[str], int]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(store_dir), *flags],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert holder.stdout is not None
    line = holder.stdout.readline()
    assert line.strip().isdigit(), f"the holder process did not start a server (exit {holder.wait(timeout=30)})"
    return holder, int(line)


def publish_and_read_back(url: str) -> bytes:
    async def roundtrip() -> bytes:
        async with asyncio.timeout(15):  # nats-py's connect can wait forever on a server that is gone
            nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
            try:
                js = nc.jetstream()
                await js.add_stream(name="PROBE", subjects=["probe.>"])
                ack = await js.publish("probe.one", b"still serving", timeout=5)
                return (await js.get_msg("PROBE", ack.seq)).data or b""
            finally:
                await nc.close()

    return asyncio.run(roundtrip())


def test_a_second_server_on_a_store_directory_in_use_is_refused_naming_the_pid_and_the_directory(
    store_dir: Path,
) -> None:
    with NatsServer(store_dir) as first:
        with pytest.raises(Conflict) as refused:
            NatsServer(store_dir).start()
        message = str(refused.value)
        assert str(first.pid) in message
        assert str(store_dir) in message
        assert "\n" not in message
        assert nats_servers_on(store_dir) == [first.pid]


def test_the_first_server_keeps_serving_after_a_second_is_refused(store_dir: Path) -> None:
    with NatsServer(store_dir) as first:
        with pytest.raises(Conflict):
            NatsServer(store_dir).start()
        assert publish_and_read_back(first.url) == b"still serving"


def test_a_killed_server_keeps_its_directory_for_its_owner_and_restarts_on_the_same_port(store_dir: Path) -> None:
    server = NatsServer(store_dir)
    server.start()
    try:
        port = server.port
        server.kill()  # a crash: the owner still lives and will start it again
        with pytest.raises(Conflict):
            NatsServer(store_dir).start()
        server.start()
        assert server.port == port
        assert nats_servers_on(store_dir) == [server.pid]
    finally:
        server.stop()


def test_a_stopped_server_frees_its_directory_for_another(store_dir: Path) -> None:
    NatsServer(store_dir).__enter__().stop()
    with NatsServer(store_dir) as second:
        assert nats_servers_on(store_dir) == [second.pid]


def test_a_server_outlives_the_short_lived_thread_that_started_it(store_dir: Path) -> None:
    # Linux sends the parent-death signal when the thread that forked exits, not the process.
    server = NatsServer(store_dir)
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join()
    try:
        eventually_sync(lambda: not Path(f"/proc/self/task/{starter.native_id}").exists())
        assert publish_and_read_back(server.url) == b"still serving"
        assert server.running()
        assert server.pid is not None
        assert alive(server.pid)
    finally:
        server.stop()


def test_a_server_dies_when_the_process_that_started_it_is_killed(store_dir: Path) -> None:
    holder, server_pid = start_holder(store_dir)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=10)
    eventually_sync(lambda: not alive(server_pid), timeout_s=10)
    assert nats_servers_on(store_dir) == []


def test_a_leftover_server_whose_owner_died_without_the_death_signal_is_stopped_and_replaced(store_dir: Path) -> None:
    holder, leftover = start_holder(store_dir, "no-death-signal", "exit")
    holder.wait(timeout=10)
    assert alive(leftover), "the leftover should outlive its owner for this test to mean anything"
    with NatsServer(store_dir) as server:
        assert not alive(leftover)
        assert nats_servers_on(store_dir) == [server.pid]


def test_a_stray_server_started_by_hand_on_the_store_directory_is_stopped_not_doubled(store_dir: Path) -> None:
    store_dir.mkdir()
    stray = subprocess.Popen(
        [str(nats_server_binary()), "-js", "-sd", str(store_dir), "-a", "127.0.0.1", "-p", "-1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        eventually_sync(lambda: nats_servers_on(store_dir) == [stray.pid])
        with NatsServer(store_dir) as server:
            assert stray.poll() is not None
            assert nats_servers_on(store_dir) == [server.pid]
    finally:
        if stray.poll() is None:
            stray.kill()
        stray.wait(timeout=10)


def test_restart_keeps_the_port_and_runs_one_server(store_dir: Path) -> None:
    with NatsServer(store_dir) as server:
        port, first_pid = server.port, server.pid
        server.restart()
        assert server.port == port
        assert server.pid != first_pid
        assert nats_servers_on(store_dir) == [server.pid]
