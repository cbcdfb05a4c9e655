"""An enrolled agent that floods: bounded by its publish budget at the broker, counted and reported, while the
node stays healthy and an honest agent's events are journaled. And the monitoring port a local user without
credentials could read: a node with authentication serves none."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import psutil
import pytest

from bus.broker.streams import MIB
from bus.client.client import connect
from bus.identity.signing import AgentKey
from bus.model.vocab import Role
from bus.subjects import STREAM
from epibus.dashboard.snapshot import node_snapshot
from epibus.node.budget import BudgetWatch, PublishBudget
from epibus.node.node import Node, NodeConfig
from tests.conftest import finding
from tests.security.test_broker import Violations
from tests.support import enrol_agent, eventually, journal_event_ids, operator_credentials

WINDOW_S = 4.0
BUDGET = PublishBudget(msgs_per_window=400, bytes_per_window=4 * MIB, window_s=WINDOW_S)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    async with Node(NodeConfig(home=tmp_path / "home", mirror="off", budget=BUDGET)) as running:
        assert running.authenticated
        yield running


async def stored_on(node: Node, subject_filter: str) -> int:
    async with await nats.connect(node.nats_url, **operator_credentials(node.config.home)) as operator:
        info = await operator.jetstream().stream_info(STREAM, subjects_filter=subject_filter)
    return sum((info.state.subjects or {}).values())


async def test_a_flood_is_cut_off_at_the_broker_counted_and_an_honest_agent_is_journaled(
    node: Node, project: str
) -> None:
    home = node.config.home
    mallory = AgentKey.generate("mallory")
    await enrol_agent(node.nats_url, home, mallory, roles=[Role.agent], projects=[project])
    violations = Violations()
    nc = await nats.connect(node.nats_url, error_cb=violations.record, **mallory.nats_credentials)
    sent, deadline = 0, asyncio.get_running_loop().time() + 20
    while not violations.about(f"epi.{project}.finding.") and asyncio.get_running_loop().time() < deadline:
        for _ in range(100):
            await nc.publish(f"epi.{project}.finding.flood{sent}", b"x" * 2048)
            sent += 1
        await nc.flush()
        await asyncio.sleep(0.01)
    assert violations.about(f"epi.{project}.finding."), f"{sent} messages sent and never refused"
    assert node.budget is not None
    report = node.budget.report()["agents"]["mallory"]
    assert report["suspended"]
    assert report["suspensions"] == 1
    shown = (await node_snapshot(node))["budgets"]["agents"]["mallory"]  # what the dashboard's page gets
    assert (shown["suspended"], shown["suspensions"]) == (True, 1)
    landed = await stored_on(node, f"epi.{project}.finding.*")
    print(f"flood: sent {sent} x 2 KiB, stored {landed} before the broker cut it off (budget {BUDGET})")  # -s
    assert landed < sent  # what it sent while suspended never reached the stream
    async with connect(node.nats_url, agent="alice", home=home, outbox=False) as alice:
        honest = [await alice.publish(alice.event("finding", finding(i), project=project)) for i in range(5)]
        assert node.journal is not None
        url = node.journal.url
        wanted = {str(r.event_id) for r in honest}
        await eventually(lambda: wanted <= set(journal_event_ids(url, project)), timeout_s=30)
    budget = node.budget
    assert budget.report()["agents"].get("alice", {}).get("suspensions", 0) == 0
    # Its window passes: it may publish again, and nothing stopped meanwhile.
    await eventually(lambda: not budget.report()["agents"]["mallory"]["suspended"], timeout_s=WINDOW_S * 4)
    before = await stored_on(node, f"epi.{project}.finding.*")

    async def published_again() -> bool:
        # The report lifts the suspension as the server reloads its permissions: a publish racing the reload is
        # refused like the flood was, so the agent tries again, as a client would.
        await nc.publish(f"epi.{project}.finding.later", b"y")
        await nc.flush()
        return await _grown(node, project, before)

    assert await eventually(published_again, timeout_s=10, interval_s=0.5)
    await nc.close()
    assert not any(task.done() for task in node._tasks), "a node service stopped"


async def test_a_flood_from_connections_that_close_between_two_readings_is_counted(node: Node, project: str) -> None:
    """Each connection sends its share and closes within a poll: the server's closed connections count too."""
    mallory = AgentKey.generate("mallory")
    await enrol_agent(node.nats_url, node.config.home, mallory, roles=[Role.agent], projects=[project])
    assert node.budget is not None
    budget = node.budget
    await eventually(lambda: mallory.public_key in budget.names, timeout_s=10)
    for _ in range(6):
        nc = await nats.connect(node.nats_url, **mallory.nats_credentials)
        for i in range(100):
            await nc.publish(f"epi.{project}.finding.burst{i}", b"z" * 64)
        await nc.close()  # flushes, then gone before the next reading
    await eventually(lambda: budget.report()["agents"].get("mallory", {}).get("suspensions") == 1, timeout_s=5)


async def _grown(node: Node, project: str, before: int) -> bool:
    return await stored_on(node, f"epi.{project}.finding.*") > before


class Recorder:
    def __init__(self) -> None:
        self.applied: list[frozenset[str]] = []

    async def apply(self, keys: frozenset[str]) -> None:
        self.applied.append(keys)


async def test_a_window_sums_each_keys_growth_suspends_over_budget_and_lifts_when_it_slides() -> None:
    recorder = Recorder()

    async def agents() -> dict[str, str]:
        return {"UA": "a", "UB": "b"}

    budget = PublishBudget(msgs_per_window=100, bytes_per_window=1000, window_s=10.0)
    watch = BudgetWatch(None, budget, agents=agents, apply=recorder.apply)  # type: ignore[arg-type]
    watch.names = await agents()
    await watch._judge({"UA": (60, 100), "UB": (10, 10)}, now=0.0)
    await watch._judge({"UA": (50, 100)}, now=5.0)  # 110 messages in 10 s: over
    await watch._judge({"UB": (0, 995)}, now=6.0)  # 1005 bytes: over
    await watch._judge({"UB": (0, 10)}, now=10.5)  # the first samples slid out: a is at 50, b at 1005
    assert recorder.applied == [frozenset({"UA"}), frozenset({"UA", "UB"}), frozenset({"UB"})]
    report = watch.report()["agents"]
    assert report["a"] == {"msgs": 50, "bytes": 100, "suspended": False, "suspensions": 1}
    assert report["b"] == {"msgs": 0, "bytes": 1005, "suspended": True, "suspensions": 1}


async def test_a_node_with_authentication_listens_on_its_client_port_only(node: Node) -> None:
    """No monitoring endpoint to read keys, subscriptions and consumers from: only the client port, whose
    every connection must authenticate; and a local user without credentials (nobody) is refused there."""
    assert node.info is not None
    assert node.info.monitor_url is None
    assert node.server is not None
    server_pid = node.server.pid
    listening = _listening_ports(server_pid)
    assert listening == {node.server.port}
    if os.geteuid() == 0:
        probe = subprocess.run(  # noqa: ASYNC221 - a separate uid; the node's loop is not needed to refuse it
            [
                "setpriv",
                "--reuid=nobody",
                "--regid=nogroup",
                "--clear-groups",
                sys.executable,
                "-c",
                _NOBODY,
                node.nats_url,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert probe.stdout.strip() == "refused", probe.stdout + probe.stderr


AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
_NOBODY = """
import asyncio, sys
import nats
import nats.errors
async def main():
    try:
        await nats.connect(sys.argv[1], allow_reconnect=False, connect_timeout=2)
    except (nats.errors.Error, OSError, TimeoutError) as e:  # printed: the test reads what happened
        print("refused" if "Authorization" in str(e) else f"other: {e}")
    else:
        print("connected")
asyncio.run(main())
"""


def _listening_ports(pid: int | None) -> set[int]:
    """The TCP ports a process listens on."""
    assert pid is not None
    connections = psutil.Process(pid).net_connections(kind="tcp")
    return {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
