"""A node's mesh coordinator services: one per (project, policy) pair it was started with, each deciding as the
node's agent through a client of its own."""

from __future__ import annotations

import contextlib
from pathlib import Path

from bus.client.client import EpibusClient
from bus.client.enrol import enrol_locally
from bus.identity.signing import AgentKey
from bus.intake.cursor import FileCursor
from mesh.agent import MeshAgent
from mesh.coordinator import Coordinator, parse_policy


async def start_coordinators(
    servers: list[str],
    stack: contextlib.AsyncExitStack,
    *,
    home: Path,
    agent: str,
    coordinate: tuple[tuple[str, str], ...],
    replicas: int,
) -> list[Coordinator]:
    """The coordinators, checked and ready to run (their client closes with `stack`). A policy that does not
    exist or an agent that is not a coordinator of the project is a start-up error."""
    policies = [(project, parse_policy(spec)) for project, spec in coordinate]
    key = AgentKey.load_or_create(home, agent)
    client = EpibusClient(servers, key, outbox=None, replicas=replicas, enrol=lambda: enrol_locally(servers, home, key))
    await client.start()
    stack.push_async_callback(client.close)
    mesh = MeshAgent(client)
    coordinators: list[Coordinator] = []
    for project, policy in policies:
        cursor = FileCursor(home / "mesh" / f"coordinator-{agent}-{project}.cursor")
        service = Coordinator(mesh, project, policy, cursor=cursor)
        await service.check()
        coordinators.append(service)
    return coordinators
