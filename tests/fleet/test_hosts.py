"""A fleet on three hosts, simulated with three network namespaces (each its own address, reaching the others
only through a bridge): the hub, then two nodes that join with invite tokens only (nothing else is copied between
them). Every command runs as a user would run it, `epibus ...` inside the host's namespace; the test reads the
stores' files from outside. Skipped where namespaces cannot be made (they need root)."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.host.server_guard import die_with_parent
from bus.identity.signing import AgentKey
from epibus.cluster.netns import Namespaces, netns_unavailable
from tests.support import eventually_sync, journal_event_ids

UNAVAILABLE = netns_unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or ""),
]
FLEET_PORT = 7422
PROJECT = "fleet"
START_S = 120.0
CLI_S = 60.0


class Host:
    """One machine of the fleet: a namespace, a home, and the node process run there."""

    def __init__(self, net: Namespaces, index: int, home: Path) -> None:
        self.net = net
        self.index = index
        self.home = home
        self.address = net.hosts[index]
        self.process: subprocess.Popen[bytes] | None = None
        self.status: dict[str, Any] = {}

    def argv(self, *args: str) -> list[str]:
        return [*self.net.exec_prefix(self.index), sys.executable, "-m", "epibus", *args]

    def up(self, *args: str) -> dict[str, Any]:
        """`epibus up --json ...` in this host's namespace; returns its status line. Raises AssertionError with
        its stderr when it exits instead."""
        self.home.mkdir(parents=True, exist_ok=True)
        log = (self.home / "up.log").open("ab")
        self.process = subprocess.Popen(
            self.argv("up", "--json", "--home", str(self.home), *args),
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: kill -9 of the group takes its server too
            preexec_fn=die_with_parent(),
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(timeout=30)
            raise AssertionError(f"up exited {self.process.returncode}: {(self.home / 'up.log').read_text()[-2000:]}")
        self.status = json.loads(line)
        assert self.status.get("ok") is True, self.status
        return self.status

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            self.argv(*args, "--json"), capture_output=True, text=True, timeout=CLI_S, stdin=subprocess.DEVNULL
        )
        if check:
            assert done.returncode == 0, f"epibus {' '.join(args)}: {done.stderr[-2000:]}"
        return done

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill_group()

    def kill_group(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def journaled(self) -> list[str]:
        return journal_event_ids(f"sqlite:///{self.home / 'journal.db'}", PROJECT)

    def server_log(self) -> str:
        path = self.home / "nats" / "nats-server.log"
        return path.read_text(errors="replace") if path.exists() else ""


class Fleet:
    def __init__(self, net: Namespaces, root: Path) -> None:
        self.hub = Host(net, 0, root / "hub")
        self.two = Host(net, 1, root / "two")
        self.three = Host(net, 2, root / "three")
        self.root = root

    def start_hub(self) -> None:
        self.hub.up("--name", "hub", "--host", self.hub.address, "--fleet-port", str(FLEET_PORT), "--mirror", "off")

    def invite(self, name: str, host: Host) -> str:
        done = self.hub.cli("fleet", "invite", name, "--host", host.address, "--home", str(self.hub.home))
        token = json.loads(done.stdout)["token"]
        assert isinstance(token, str)
        return token

    def publish(self, host: Host, text: str, *extra: str) -> str:
        done = host.cli(
            "publish",
            "finding",
            "-p",
            PROJECT,
            "--text",
            text,
            "--impact",
            "0.6",
            "--confidence",
            "0.7",
            "--subject",
            "sensors",
            *extra,
        )
        event_id = json.loads(done.stdout)["event_id"]
        assert isinstance(event_id, str)
        return event_id


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet")
    with Namespaces(3) as net:
        fleet = Fleet(net, root)
        try:
            fleet.hub.up(
                "--name", "hub", "--host", fleet.hub.address, "--fleet-port", str(FLEET_PORT), "--mirror", "off"
            )
            fleet.two.up("--join", fleet.invite("node-2", fleet.two), "--mirror", "edge")
            fleet.three.up("--join", fleet.invite("node-3", fleet.three), "--mirror", "off")
            yield fleet
        finally:
            for host in (fleet.three, fleet.two, fleet.hub):
                host.stop()


def test_an_event_published_on_one_host_is_journaled_on_another_and_recalled_on_the_third(fleet: Fleet) -> None:
    event_id = fleet.publish(fleet.hub, "the loading dock sensor drifts two degrees every night", "--home",
                             str(fleet.hub.home))  # fmt: skip
    eventually_sync(lambda: event_id in fleet.three.journaled(), timeout_s=60)
    eventually_sync(lambda: event_id in fleet.two.journaled(), timeout_s=60)

    def recalled() -> bool:
        done = fleet.two.cli("recall", "temperature sensor drift at night", "-p", PROJECT, "--home",
                             str(fleet.two.home))  # fmt: skip
        return event_id in done.stdout

    eventually_sync(recalled, timeout_s=90)
    listed = json.loads(fleet.three.cli("fleet", "list", "--home", str(fleet.three.home)).stdout)
    assert {row["name"]: row["role"] for row in listed} == {"hub": "hub", "node-2": "leaf", "node-3": "leaf"}
    assert all(row["heartbeat"] is not None for row in listed), listed


def test_an_agent_enrolled_through_one_node_connects_to_another(fleet: Fleet) -> None:
    carol_home = fleet.root / "carol"
    carol = AgentKey.load_or_create(carol_home, "carol")
    fleet.two.cli("agent", "add", "carol", "--key", carol.public_key, "-p", PROJECT, "--home", str(fleet.two.home))
    node_3 = fleet.three.status["nats_url"]

    def published() -> str | None:
        who = ("--agent", "carol", "--home", str(carol_home), "--nats", node_3)
        claim = ("-p", PROJECT, "--text", "carol was here", "--impact", "0.5", "--confidence", "0.5", "--subject", "x")
        done = fleet.three.cli("publish", "finding", *claim, *who, check=False)
        return json.loads(done.stdout)["event_id"] if done.returncode == 0 else None

    event_id = eventually_sync(published, timeout_s=30)  # the enrolment reaches node 3's server within seconds
    eventually_sync(lambda: event_id in fleet.hub.journaled(), timeout_s=60)


def test_nothing_a_host_opens_to_the_network_answers_without_the_fleets_certificate(fleet: Fleet) -> None:
    for host in (fleet.hub, fleet.two, fleet.three):
        listening = subprocess.run(
            [*fleet.hub.net.exec_prefix(host.index), "ss", "-ltnH"], capture_output=True, text=True, check=True
        ).stdout
        outside = sorted({line.split()[3] for line in listing(listening) if not line.split()[3].startswith("127.")})
        assert outside == ([f"{fleet.hub.address}:{FLEET_PORT}"] if host is fleet.hub else []), (host.index, outside)
    # the hub's one outside port speaks TLS first and asks for a certificate of the fleet's CA
    ca = fleet.hub.home / "fleet" / "ca.crt"
    assert isinstance(without_certificate(fleet.hub.address, FLEET_PORT, ca), ssl.SSLError | ConnectionError)
    answer = in_plain_text(fleet.hub.address, FLEET_PORT)
    assert b"INFO" not in answer, answer
    assert b"PONG" not in answer, answer


def without_certificate(address: str, port: int, ca: Path) -> bytes | OSError:
    """What a TLS client that trusts the fleet's CA but shows no certificate of its own gets: an error, or bytes."""
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False
    try:
        with socket.create_connection((address, port), timeout=10) as raw, context.wrap_socket(raw) as tls:
            tls.sendall(b"CONNECT {}\r\nPING\r\n")
            return tls.recv(100)
    except OSError as e:  # ssl.SSLError and a reset connection are both OSErrors
        return e


def in_plain_text(address: str, port: int) -> bytes:
    with socket.create_connection((address, port), timeout=10) as plain:
        plain.sendall(b"CONNECT {}\r\nPING\r\n")
        plain.settimeout(10)
        try:
            return plain.recv(100)
        except (ConnectionResetError, TimeoutError):
            return b""


def listing(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip()]


def test_an_admin_acts_through_any_node_and_a_revocation_reaches_every_node(fleet: Fleet) -> None:
    ops_home, dave_home = fleet.root / "ops", fleet.root / "dave"
    ops, dave = AgentKey.load_or_create(ops_home, "ops"), AgentKey.load_or_create(dave_home, "dave")
    hub_home = ("--home", str(fleet.hub.home))
    fleet.hub.cli("agent", "add", "ops", "--key", ops.public_key, "-p", "*", "--role", "admin", *hub_home)
    fleet.hub.cli("agent", "add", "dave", "--key", dave.public_key, "-p", PROJECT, *hub_home)
    as_ops_on_two = ("--agent", "ops", "--home", str(ops_home), "--nats", fleet.two.status["nats_url"])

    # an admin's invite, asked through node 2, is answered by the hub
    def invited() -> str | None:  # ops reaches node 2's server once node 2 applied the enrolment (within 2 s)
        done = fleet.two.cli("fleet", "invite", "node-4", *as_ops_on_two, check=False)
        return str(json.loads(done.stdout)["token"]) if done.returncode == 0 else None

    token = eventually_sync(invited, timeout_s=30)
    assert token.startswith("epibus-join-1.")
    dave_on_three = ("--agent", "dave", "--home", str(dave_home), "--nats", fleet.three.status["nats_url"])
    claim = ("-p", PROJECT, "--text", "dave's reading", "--impact", "0.5", "--confidence", "0.5", "--subject", "x")

    def dave_publishes() -> bool:
        return fleet.three.cli("publish", "finding", *claim, *dave_on_three, check=False).returncode == 0

    eventually_sync(dave_publishes, timeout_s=30)
    # revoked through node 2: node 3's server refuses dave within seconds
    fleet.two.cli("agent", "revoke", "dave", *as_ops_on_two)
    started = time.monotonic()
    eventually_sync(lambda: not dave_publishes(), timeout_s=30)
    assert time.monotonic() - started < 30


# Publishes COUNT findings through the node under HOME, one at a time; prints each acknowledged event id
# (PubAck: in the hub's stream) and "unacked" for each one left in the home's outbox for its node to forward.
PUBLISHER = """
import asyncio, sys
from bus.client.client import connect
from bus.errors import Unavailable
home, count = sys.argv[1], int(sys.argv[2])
async def main():
    async with connect(agent="pub", home=home, publish_timeout_s=2.0) as client:
        for i in range(count):
            event = client.event("finding", {"text": f"reading {i} around the hub's death", "impact": 0.5,
                                             "confidence": 0.5, "subject": "sensors"}, project="fleet")
            try:
                receipt = await client.publish(event, timeout_s=2.0)
            except Unavailable:
                print("unacked", event.event_id, flush=True)
                continue
            print("acked" if receipt.level.value == "published" else "unacked", receipt.event_id, flush=True)
            await asyncio.sleep(0.05)
asyncio.run(main())
"""


def test_a_hub_killed_mid_publish_loses_no_acknowledged_event_on_any_store(fleet: Fleet) -> None:
    argv = [*fleet.two.net.exec_prefix(1), sys.executable, "-c", PUBLISHER, str(fleet.two.home), "120"]
    publisher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert publisher.stdout is not None
    lines: list[str] = []
    for line in publisher.stdout:
        lines.append(line.strip())
        if len(lines) == 30:
            fleet.hub.kill_group()  # kill -9 of the hub's process group (node and server) while events flow
            time.sleep(3)
            fleet.start_hub()
    publisher.wait(timeout=60)
    acked = [line.split()[1] for line in lines if line.startswith("acked")]
    assert publisher.returncode == 0, publisher.stderr.read() if publisher.stderr else ""
    assert len(lines) == 120
    assert len(acked) >= 30
    for host in (fleet.hub, fleet.two, fleet.three):
        eventually_sync(lambda host=host: set(acked) <= set(host.journaled()), timeout_s=120)  # type: ignore[misc]
    everything = [line.split()[1] for line in lines]  # the unacked ones too: forwarded from node 2's outbox
    eventually_sync(lambda: set(everything) <= set(fleet.hub.journaled()), timeout_s=120)


def test_a_removed_node_is_refused_at_once_and_returns_only_with_a_new_key(fleet: Fleet) -> None:
    fleet.hub.cli("fleet", "remove", "node-3", "--home", str(fleet.hub.home))
    started = time.monotonic()
    eventually_sync(lambda: "authorization violation" in fleet.three.server_log().lower(), timeout_s=10)
    refused_after_s = time.monotonic() - started
    assert refused_after_s < 10
    # the others keep working
    event_id = fleet.publish(fleet.two, "after node 3 left", "--home", str(fleet.two.home), "--agent", "two-user")
    eventually_sync(lambda: event_id in fleet.hub.journaled(), timeout_s=60)
    fleet.three.stop()
    done = subprocess.run(
        fleet.three.argv("up", "--json", "--home", str(fleet.three.home), "--mirror", "off"),
        capture_output=True, text=True, timeout=START_S, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode != 0
    assert "it was removed from the fleet" in done.stdout + done.stderr
    # a new invite brings the host back with a new key (a new home), never the old one
    again = Host(fleet.three.net, 2, fleet.root / "three-again")
    try:
        again.up("--join", fleet.invite("node-3", again), "--mirror", "off")
        listed = json.loads(fleet.hub.cli("fleet", "list", "--home", str(fleet.hub.home)).stdout)
        node_3 = next(row for row in listed if row["name"] == "node-3")
        assert node_3["removed_at"] is None
        old_key = AgentKey.load_or_create_at(fleet.three.home / "node.nk", "node").public_key
        assert node_3["public_key"] != old_key
    finally:
        again.stop()
