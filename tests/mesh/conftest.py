"""Mesh fixtures: agents on their own connections to the test's nats-server, and the mesh service that writes
what they ask (on a node it is part of `epibus up`; here it runs alone, on a connection of its own)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from datetime import datetime
from pathlib import Path

import pytest

from bus.client.client import connect
from bus.client.connection import open_nats
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey
from mesh.agent import MeshAgent
from mesh.service import MeshService

MeshFactory = Callable[..., Awaitable[MeshAgent]]


@pytest.fixture
async def mesh_service(nats_server: NatsServer) -> AsyncIterator[MeshService]:
    """The mesh's writer, as a node runs it, with a node key of its own."""
    key = AgentKey.generate("node")
    nc = await open_nats([nats_server.url], name="mesh-writer", timeout_s=5, key=key)  # reconnects as a node does
    try:
        service = MeshService(nc.jetstream(), key, node="mesh-writer")
        await service.serve(nc)
        yield service
    finally:
        await nc.close()


@pytest.fixture
async def mesh_as(nats_server: NatsServer, home: Path, mesh_service: MeshService) -> AsyncIterator[MeshFactory]:
    """`await mesh_as("alice")`: a MeshAgent on its own connection, closed at the end of the test. An injected
    clock is the mesh service's clock too: the node judges deadlines and signed times by its own clock."""
    async with AsyncExitStack() as stack:

        async def make(agent: str, clock: Callable[[], datetime] | None = None) -> MeshAgent:
            client = await stack.enter_async_context(connect(nats_server.url, agent=agent, home=home, outbox=False))
            if clock is None:
                return MeshAgent(client)
            mesh_service.clock = clock
            return MeshAgent(client, clock=clock)

        yield make
