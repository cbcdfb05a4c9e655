"""A fleet on a real node with authentication for the mesh's security tests: enrolled agents (alice proposes,
coord coordinates, bob works, mallory attacks), what the bucket and the journal hold (read back through the
operator's connection and plain SQL), and writes around the node as a compromised writer would make them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
from nats.aio.client import Client as NatsClient

from bus.client import enrol
from bus.client.client import connect
from bus.identity.signing import AgentKey, node_key
from bus.model.requests import EnrolRequest, build_request
from bus.model.vocab import Role
from bus.subjects import MESH_BUCKET, MESH_STREAM
from epibus.cli.mesh_roster import seat_as_operator
from epibus.node.node import Node, NodeConfig
from mesh.agent import MeshAgent
from mesh.watch import TaskWatcher
from tests.support import eventually, identity_for, journal_rows_of_kind, operator_credentials

SHA = "0123456789abcdef0123456789abcdef01234567"
ROLES = {
    "alice": [Role.agent],
    "bob": [Role.agent],
    "coord": [Role.agent, Role.coordinator],
    "mallory": [Role.agent],
}


@dataclass
class Fleet:
    node: Node
    home: Path
    project: str
    mesh: dict[str, MeshAgent]
    keys: dict[str, AgentKey]

    @property
    def url(self) -> str:
        return self.node.nats_url

    @property
    def journal_url(self) -> str:
        assert self.node.journal is not None
        return self.node.journal.url

    async def bucket(self) -> dict[str, Any]:
        """Every key of the mesh bucket with its revision and value, and the bucket's last revision."""
        nc = await self.operator()
        try:
            js = nc.jetstream()
            kv = await js.key_value(MESH_BUCKET)
            try:
                keys = sorted(await kv.keys())
            except nats.js.errors.NoKeysError:
                keys = []
            entries = {k: ((e := await kv.get(k)).revision, e.value) for k in keys}
            return {"last": (await js.stream_info(MESH_STREAM)).state.last_seq, "keys": entries}
        finally:
            await nc.close()

    async def raw_record(self, key: str) -> tuple[dict[str, Any], int]:
        nc = await self.operator()
        try:
            entry = await (await nc.jetstream().key_value(MESH_BUCKET)).get(key)
            assert entry.value is not None
            assert entry.revision is not None
            return json.loads(entry.value), entry.revision
        finally:
            await nc.close()

    async def write_around_the_node(self, key: str, value: dict[str, Any], *, last: int) -> int:
        """What a compromised writer (the operator's connection) can put in the bucket, past every check."""
        nc = await self.operator()
        try:
            kv = await nc.jetstream().key_value(MESH_BUCKET)
            return int(await kv.update(key, json.dumps(value).encode(), last=last))
        finally:
            await nc.close()

    async def operator(self) -> NatsClient:
        return await nats.connect(self.url, **operator_credentials(self.home))

    def journal(self, kind: str) -> list[tuple[str, dict[str, Any], str, str]]:
        return journal_rows_of_kind(self.journal_url, self.project, kind)

    async def journaled(self, kind: str, count: int) -> list[tuple[str, dict[str, Any], str, str]]:
        """The project's journal rows of a kind, once it holds `count` of them."""

        def counted() -> list[tuple[str, dict[str, Any], str, str]] | None:
            rows = self.journal(kind)
            return rows if len(rows) == count else None

        return await eventually(counted, timeout_s=15)


async def _enrol(nc: NatsClient, admin: AgentKey, key: AgentKey, project: str) -> None:
    projects = [project, f"{project}-b"]
    request = build_request(
        EnrolRequest,
        agent_id=key.agent_id,
        public_key=key.public_key,
        projects=projects,
        roles=ROLES[key.agent_id],
        identity=identity_for(list(ROLES[key.agent_id])),
    )
    await enrol.enrol(nc, admin, request)


@asynccontextmanager
async def fleet_on_a_node(tmp_path: Path, project: str) -> AsyncIterator[Fleet]:
    """A node as `epibus up` runs it (authentication on), each agent enrolled in `project` and `<project>-b`
    only, coord seated in `project` by the node's operator."""
    home = tmp_path / "home"
    async with Node(NodeConfig(home=home, mirror="off")) as node, AsyncExitStack() as stack:
        assert node.authenticated
        keys = {name: AgentKey.load_or_create(home, name) for name in ROLES}
        admin = node_key(home)
        nc = await nats.connect(node.nats_url, **admin.nats_credentials)
        try:
            for key in keys.values():
                await _enrol(nc, admin, key, project)
        finally:
            await nc.close()
        await seat_as_operator([node.nats_url], home, project, "coord")
        mesh = {
            name: MeshAgent(
                await stack.enter_async_context(connect(node.nats_url, agent=name, home=home, outbox=False))
            )
            for name in ROLES
        }
        fleet = Fleet(node, home, project, mesh, keys)
        # the seat is journaled before a test takes its "nothing changed" snapshot
        await fleet.journaled("coordinators", 1)
        yield fleet


async def watch_until(watcher: TaskWatcher, revision: int) -> None:
    """Step a watcher until it has handled (or quarantined) everything up to `revision`."""

    async def caught_up() -> bool:
        await watcher.step()
        return watcher.last_seen >= revision

    await eventually(caught_up, timeout_s=15)


async def recorder_past(node: Node, revision: int) -> None:
    """Wait until the node's mesh recorder has handled (or quarantined) every revision up to `revision`."""
    await eventually(lambda: node.recorder is not None and node.recorder.watcher.last_seen >= revision, timeout_s=15)
