"""A Node.js agent (tests/interop/client.mjs: nats.js and nkeys, no epibus code) against a real authenticating
node: it verifies every event Python published with plain ed25519 over the documented bytes, and the event it
publishes itself is journaled as valid. The wire format needs nothing of Python."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import nats
import pytest
from sqlalchemy import text

from bus.broker.nats_errors import JS_TIMEOUT_S
from bus.client.client import connect
from bus.identity.signing import AgentKey, wire_message
from bus.model.event import draft_event
from bus.model.vocab import Role
from epibus.node.node import Node, NodeConfig
from observers.journal_engine import make_engine
from tests.conftest import finding
from tests.support import enrol_agent, eventually

INTEROP = Path(__file__).parent
PUBLISHED = 5  # current-format events Python publishes, each to be verified by the Node.js agent
NODE_TIMEOUT_S = 60.0


def _node_binary() -> str:
    node = shutil.which("node")
    if node is None or not (INTEROP / "node_modules" / "nats").is_dir():
        pytest.fail(
            "the Node.js interop test needs `node` (Node.js 20) and tests/interop/node_modules: run tests/prepare.sh"
        )
    return node


async def _run_node_agent(node_url: str, key: AgentKey, seed: str, project: str) -> dict[str, Any]:
    env = {"EPIBUS_NATS_URL": node_url, "EPIBUS_SEED": seed, "EPIBUS_AGENT": key.agent_id, "EPIBUS_PROJECT": project}
    process = await asyncio.create_subprocess_exec(
        _node_binary(),
        str(INTEROP / "client.mjs"),
        env={"PATH": "/usr/bin:/bin", **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(NODE_TIMEOUT_S):
            out, err = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode == 0, f"client.mjs failed ({process.returncode}): {err.decode()[-2000:]}"
    report: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return report


def _journal_row(url: str, event_id: str) -> dict[str, Any] | None:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                text("SELECT status, signature_status, actor_id, kind, envelope FROM events WHERE event_id = :e"),
                {"e": event_id},
            ).first()
    finally:
        engine.dispose()
    return None if row is None else dict(row._mapping)


async def test_a_node_js_agent_verifies_every_event_and_publishes_one_the_journal_keeps(
    tmp_path: Path, project: str
) -> None:
    _node_binary()  # fail before starting anything when Node.js is missing
    home = tmp_path / "home"
    async with Node(NodeConfig(home=home, mirror="off")) as node:
        assert node.authenticated
        assert node.journal is not None
        js_agent = AgentKey.load_or_create(tmp_path / "js", "jsagent")
        await enrol_agent(node.nats_url, home, js_agent, roles=[Role.agent], projects=[project])
        async with connect(node.nats_url, agent="alice", home=home, outbox=False) as alice:
            events = [alice.event("finding", finding(i), project=project) for i in range(PUBLISHED)]
            await alice.publish_many(events)
            # One event in the legacy format, as streams written before schema_version 2 hold them.
            legacy = alice.key.sign_v1(
                draft_event("finding", finding(99), project=project, actor=alice.key.actor, session_id="s")
            )
            old = wire_message(legacy)
            assert old.headers == {}
            raw = await nats.connect(node.nats_url, **alice.key.nats_credentials)
            try:
                await raw.jetstream().publish(old.subject, old.data, timeout=JS_TIMEOUT_S)
            finally:
                await raw.close()

        seed = (tmp_path / "js" / "keys" / "jsagent.nk").read_text().strip()
        report = await _run_node_agent(node.nats_url, js_agent, seed, project)
        assert report["verified"] == PUBLISHED, report
        assert report["legacy"] == 1, report
        assert report["failed"] == 0, report

        published = report["published"]
        assert node.journal is not None
        journal_url = node.journal.url
        row = await eventually(lambda: _journal_row(journal_url, published["event_id"]), timeout_s=30)
    assert row["status"] == "applied", row
    assert row["signature_status"] == "verified"
    assert row["actor_id"] == "jsagent"
    assert row["kind"] == "finding"
    envelope = json.loads(row["envelope"])
    assert envelope["schema_version"] == 2
    assert envelope["body"]["text"] == "written by a Node.js agent"
    assert envelope["actor"]["public_key"] == js_agent.public_key
