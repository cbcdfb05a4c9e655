"""The workload of `epibus chaos`: several publishers, each an enrolled agent with its own outbox, publishing
findings on several projects at a set rate, every attempt recorded with the level its receipt reached."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from pathlib import Path

import nats

from bus.client import enrol
from bus.client.client import EpibusClient
from bus.errors import EpibusError, error_summary
from bus.identity.signing import AgentKey
from bus.model.event import Envelope, event_digest
from bus.model.requests import EnrolRequest, build_request
from bus.model.vocab import Role
from epibus.chaos.ledger import Attempt

log = logging.getLogger(__name__)
PUBLISH_TIMEOUT_S = 2.0  # past it a receipt says `outboxed`: the event is durable, the forwarder sends it
DRAIN_POLL_S = 0.25


class Workload:
    """`publishers` agents under run_dir/publishers, publishing round-robin over `projects` at `rate` events
    per second in all, until `stop` is set or `max_events` were attempted."""

    def __init__(
        self, run_dir: Path, servers: Sequence[str], *, publishers: int, projects: Sequence[str], rate: float
    ) -> None:
        self.root = run_dir / "publishers"
        self.servers = list(servers)
        self.projects = list(projects)
        self.rate = rate
        self.keys = [AgentKey.load_or_create(self.root / f"p{i}", f"chaos-p{i}") for i in range(publishers)]
        self.clients: list[EpibusClient] = []
        self.attempts: list[Attempt] = []
        self._attempted = asyncio.Condition()

    async def enrol(self, admin: AgentKey) -> None:
        """Enrol every publisher in the chaos projects, signed by the nodes' key."""
        nc = await nats.connect(self.servers, connect_timeout=5, **admin.nats_credentials)
        try:
            for key in self.keys:
                request = build_request(
                    EnrolRequest, agent_id=key.agent_id, public_key=key.public_key, projects=self.projects,
                    roles=[Role.agent],
                )  # fmt: skip
                await enrol.enrol(nc, admin, request)
        finally:
            await nc.close()

    async def connect(self) -> None:
        for index, key in enumerate(self.keys):
            client = EpibusClient(
                self.servers, key, outbox=self.root / f"p{index}" / "outbox.db", publish_timeout_s=PUBLISH_TIMEOUT_S
            )
            await client.start()
            self.clients.append(client)

    async def run(self, stop: asyncio.Event, max_events: int) -> None:
        """Publish until stop is set or max_events were attempted, each publisher at rate/publishers."""
        per_publisher = max(1, max_events // len(self.clients))
        async with asyncio.TaskGroup() as group:
            for index, client in enumerate(self.clients):
                group.create_task(self._publish(index, client, stop, per_publisher))

    async def attempted(self, count: int) -> None:
        """Return once `count` publishes were attempted (waits forever if the run stops short of it)."""
        async with self._attempted:
            await self._attempted.wait_for(lambda: len(self.attempts) >= count)

    async def _publish(self, index: int, client: EpibusClient, stop: asyncio.Event, count: int) -> None:
        loop = asyncio.get_running_loop()
        interval_s = len(self.clients) / self.rate
        next_at = loop.time()
        for n in range(count):
            if stop.is_set():
                return
            project = self.projects[(index + n) % len(self.projects)]
            event = client.event(
                "finding",
                {"text": f"chaos finding {n} of publisher {index}: {uuid.uuid4().hex}", "impact": 0.5,
                 "confidence": 0.5, "subject": "chaos"},
                project=project,
            )  # fmt: skip
            self.attempts.append(await self._attempt(client, event, index, project))
            async with self._attempted:
                self._attempted.notify_all()
            next_at += interval_s
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            next_at = max(next_at, loop.time() - interval_s)  # after an outage, go on at the rate, no burst

    async def _attempt(self, client: EpibusClient, event: Envelope, index: int, project: str) -> Attempt:
        publisher, digest, event_id = f"p{index}", event_digest(event), str(event.event_id)
        try:
            receipt = await client.publish(event, timeout_s=PUBLISH_TIMEOUT_S)
        except EpibusError as e:  # refused or unavailable: not acknowledged, and said why
            return Attempt(event_id, digest, publisher, project, "error", str(e))
        return Attempt(event_id, digest, publisher, project, receipt.level.value, seq=receipt.stream_seq)

    async def drain(self, timeout_s: float) -> int:
        """Wait until every outbox is empty (bounded). Returns the events still waiting in them."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            waiting = sum([await client.outbox_depth() for client in self.clients])
            if waiting == 0 or asyncio.get_running_loop().time() > deadline:
                return waiting
            await asyncio.sleep(DRAIN_POLL_S)

    async def close(self) -> None:
        for client in self.clients:
            try:
                await client.close()
            except EpibusError as e:  # closing one must not leave the others open
                log.error("closing publisher %s: %s", client.key.agent_id, error_summary(e))
