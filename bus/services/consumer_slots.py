"""The node's side of agents' consumers (`epibus.consumer.open`): it checks the filter against the agent's
projects and creates a pull consumer named for the agent in one of its slots; the broker lets the agent pull
from, inspect and delete exactly those names. So no agent reads another project's consumer, none creates a push
consumer that delivers where it likes, and none holds more than its slots."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bus.broker.nats_errors import JS_TIMEOUT_S, nats_call
from bus.enrolment.service_rules import consumer_rule
from bus.errors import Unavailable
from bus.intake.consumers import agent_consumer_names
from bus.model.auth import DEFAULT_CONSUMER_SLOTS
from bus.model.requests import ConsumerOpenReply, ConsumerOpenRequest
from bus.services.responder import Service
from bus.subjects import CONSUMER_OPEN, CONSUMER_QUEUE, js_api

log = logging.getLogger(__name__)


@dataclass
class SlotCounts:
    opened: int = 0
    full: int = 0  # refused: every slot of the agent was in use


class ConsumerSlots:
    """The node's side: opens agents' consumers in their slots. `slots` per agent and stream."""

    def __init__(self, nc: NatsClient, js: JetStreamContext, *, slots: int = DEFAULT_CONSUMER_SLOTS) -> None:
        self.nc = nc
        self.js = js
        self.slots = slots
        self.counts = SlotCounts()

    def service(self, *, node: str) -> Service[ConsumerOpenRequest]:
        async def answer(request: ConsumerOpenRequest) -> ConsumerOpenReply:
            name, taken = await self.open(request)
            return ConsumerOpenReply(node=node, name=name, slots=self.slots, open=taken)

        return Service(
            CONSUMER_OPEN, ConsumerOpenRequest, ConsumerOpenReply, answer, consumer_rule, queue=CONSUMER_QUEUE
        )

    async def open(self, request: ConsumerOpenRequest) -> tuple[str | None, list[str]]:
        """Open the agent's consumer in a free slot: its name (None when every slot is in use) and the slots'
        consumers that were open already."""
        names = agent_consumer_names(request.owner_key, self.slots)
        taken = await self._existing(request.stream, set(names))
        for name in names:
            if name in taken:
                continue
            config = _agent_config(name, request)
            async with nats_call(f"creating consumer {name} on {request.stream}"):
                info = await self.js.add_consumer(request.stream, config)
            made = info.config
            if made.opt_start_seq == config.opt_start_seq and made.filter_subject == config.filter_subject:
                self.counts.opened += 1
                return name, sorted(taken)
            taken.add(name)  # another node filled the slot meanwhile with another reader's consumer
        self.counts.full += 1
        log.warning("agent %s: all %d consumer slots on %s in use", request.owner_key, self.slots, request.stream)
        return None, sorted(taken)

    async def _existing(self, stream: str, wanted: set[str]) -> set[str]:
        found: set[str] = set()
        offset = 0
        while True:
            async with nats_call(f"consumer names of {stream}"):
                msg = await self.nc.request(
                    js_api("CONSUMER.NAMES", stream), json.dumps({"offset": offset}).encode(), timeout=JS_TIMEOUT_S
                )
            page = json.loads(msg.data)
            if "error" in page:
                raise Unavailable("nats", f"consumer names of {stream}: {page['error'].get('description')}")
            names = page.get("consumers") or []
            found |= wanted & set(names)
            offset += len(names)
            if not names or offset >= int(page.get("total", 0)):
                return found


def _agent_config(name: str, request: ConsumerOpenRequest) -> ConsumerConfig:
    """What a node creates for an agent: pull only (no deliver subject), nothing to ack, in memory, gone when
    idle. Whatever else the agent might want is not asked, so it cannot be chosen."""
    return ConsumerConfig(
        name=name,
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT if request.last_per_subject else DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=None if request.last_per_subject else (request.start_seq or 1),
        filter_subject=request.filter_subject,
        inactive_threshold=request.idle_s,
        mem_storage=True,
        max_waiting=4,
    )
