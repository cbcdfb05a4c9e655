"""Asking a node to enrol, revoke or list agents: requests signed by an admin's key (an agent with the admin
role, or the node's own key, which whoever can read the node's home holds). The node checks the signature and
the role; the broker lets nobody else write the registry."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from nats.aio.client import Client as NatsClient
from pydantic import BaseModel

from bus.broker.ask import ask_one
from bus.client.connection import open_nats
from bus.errors import ConfigError, Unavailable
from bus.identity.signing import NODE_KEY_FILE, AgentKey, node_key
from bus.model.auth import ANY_PROJECT
from bus.model.requests import (
    AgentListReply,
    AgentListRequest,
    EnrolmentReply,
    EnrolRequest,
    PolicyReply,
    PolicySetRequest,
    PolicyShowRequest,
    RevokeRequest,
    build_request,
)
from bus.subjects import ENROL, LIST_AGENTS, POLICY_SET, POLICY_SHOW, REVOKE

log = logging.getLogger(__name__)
ADMIN_TIMEOUT_S = 10.0
R = TypeVar("R", bound=BaseModel)


async def _ask(nc: NatsClient, admin: AgentKey, subject: str, request: BaseModel, reply_model: type[R]) -> R:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ADMIN_TIMEOUT_S
    while True:  # a node that is reconnecting (its server just restarted) answers a moment later: ask again
        try:
            return await ask_one(
                nc, subject, request, reply_model, signer=admin, timeout_s=max(0.1, deadline - loop.time())
            )
        except Unavailable:
            if loop.time() >= deadline:
                raise
        await asyncio.sleep(0.25)


async def enrol(nc: NatsClient, admin: AgentKey, request: EnrolRequest) -> dict[str, Any]:
    """The enrolment the node wrote. Raises Forbidden (not an admin), Refused, Unavailable."""
    return (await _ask(nc, admin, ENROL, request, EnrolmentReply)).enrolment


async def revoke(nc: NatsClient, admin: AgentKey, agent_id: str) -> dict[str, Any]:
    return (await _ask(nc, admin, REVOKE, RevokeRequest(agent_id=agent_id), EnrolmentReply)).enrolment


async def set_policy(nc: NatsClient, admin: AgentKey, request: PolicySetRequest) -> PolicyReply:
    """The review policy the node recorded. Raises Forbidden (not an admin of the project), Refused, Unavailable."""
    return await _ask(nc, admin, POLICY_SET, request, PolicyReply)


async def show_policy(nc: NatsClient, signer: AgentKey, project: str) -> PolicyReply:
    """The project's review policy as a node holds it. Raises Forbidden (not a member), Unavailable."""
    return await _ask(nc, signer, POLICY_SHOW, PolicyShowRequest(project=project), PolicyReply)


async def list_agents(nc: NatsClient, admin: AgentKey) -> list[dict[str, Any]]:
    return (await _ask(nc, admin, LIST_AGENTS, AgentListRequest(), AgentListReply)).agents


async def enrol_locally(servers: Sequence[str], home: Path, key: AgentKey) -> dict[str, Any]:
    """Enrol an agent whose key lives under a node's home, signed with that node's key: an agent of every
    project, its own owner. Only a process that can read the home (0700) holds the node's key. Raises
    ConfigError when the home holds no node key, Forbidden, Refused, Unavailable."""
    path = home / NODE_KEY_FILE
    if not path.exists():
        raise ConfigError("agent", f"{key.agent_id} is not enrolled and {path} does not exist; ask an admin")
    admin = node_key(home)
    nc = await open_nats(servers, name=f"epibus-enrol:{key.agent_id}", timeout_s=ADMIN_TIMEOUT_S, key=admin)
    try:
        request = build_request(
            EnrolRequest, agent_id=key.agent_id, public_key=key.public_key, projects=[ANY_PROJECT], if_absent=True
        )
        enrolment = await enrol(nc, admin, request)
    finally:
        await nc.close()
    log.info("enrolled agent %s with the local node's key", key.agent_id)
    return enrolment
