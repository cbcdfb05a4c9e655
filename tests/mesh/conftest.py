"""Mesh fixtures: agents on their own connections to the test's nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from datetime import datetime
from pathlib import Path

import pytest

from bus.client import connect
from bus.server import NatsServer
from mesh.agent import MeshAgent

MeshFactory = Callable[..., Awaitable[MeshAgent]]


@pytest.fixture
async def mesh_as(nats_server: NatsServer, home: Path) -> AsyncIterator[MeshFactory]:
    """`await mesh_as("alice")`: a MeshAgent on its own connection (optionally with an injected clock),
    closed at the end of the test."""
    async with AsyncExitStack() as stack:

        async def make(agent: str, clock: Callable[[], datetime] | None = None) -> MeshAgent:
            client = await stack.enter_async_context(connect(nats_server.url, agent=agent, home=home, outbox=False))
            return MeshAgent(client, clock=clock) if clock is not None else MeshAgent(client)

        yield make
