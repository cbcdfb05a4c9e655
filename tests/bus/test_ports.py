"""Who holds a port (psutil): found even while the holder opens and closes files all the time (as a node that
reconnects does), so a refusal names the process to stop."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from bus.host.ports import LOWEST_CHOSEN_PORT, free_ports, port_holder, port_taken


def test_the_holder_of_a_port_is_found_while_it_opens_and_closes_files(tmp_path: Path) -> None:
    churning = tmp_path / "churn"
    churning.write_text("")
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            opened = [os.open(churning, os.O_RDONLY) for _ in range(64)]
            for fd in opened:
                os.close(fd)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            me = f"pid {os.getpid()} ({Path('/proc/self/comm').read_text().strip()})"
            found = [port_holder(port) for _ in range(30)]
    finally:
        stop.set()
        worker.join()
    assert set(found) == {me}


def test_a_port_nobody_listens_on_has_no_holder() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: no holder to name
    assert port_holder(port) is None


def test_chosen_ports_lie_below_the_ephemeral_range_and_each_can_be_listened_on() -> None:
    """A cluster's ports are chosen before its servers start: outside the range the kernel lends to outgoing
    connections, so none is taken by a client's socket in between."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(9)
    assert len(set(ports)) == 9
    assert all(LOWEST_CHOSEN_PORT <= port < ephemeral_low for port in ports)
    for port in ports:
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))
            server.listen()
            assert port_taken("127.0.0.1", port)
