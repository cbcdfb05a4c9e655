"""Pull consumers an agent reads through. On a node with authentication an agent may not create consumers: it
asks a node (`epibus.consumer.open`, signed), which checks the filter against the agent's projects and creates
a pull consumer named for the agent in one of its slots; the broker lets the agent pull from, inspect and
delete exactly those names. So no agent reads another project's consumer, none creates a push consumer that
delivers where it likes, and none holds more than its slots. Elsewhere (the node's own connection, a server
without authentication) consumers are created directly.

`pull_consumer` is the one way a reader opens an ephemeral consumer, `drop_consumer` the one way it lets go."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bus.ask import ask_one
from bus.auth import DEFAULT_CONSUMER_SLOTS
from bus.confinement import confined_key
from bus.errors import Forbidden, LimitReached, Unavailable
from bus.nats_errors import JS_TIMEOUT_S, RETRYABLE, nats_call
from bus.requests import ConsumerOpenReply, ConsumerOpenRequest, build_request
from bus.responder import Service
from bus.service_rules import consumer_rule
from bus.subjects import CONSUMER_OPEN, CONSUMER_QUEUE, agent_consumer_name, js_api

log = logging.getLogger(__name__)
# Dropping a consumer meets these when the connection went with it, or the consumer idled out already.
DROP_ERRORS: tuple[type[BaseException], ...] = (*RETRYABLE, nats.js.errors.NotFoundError)

OPEN_TIMEOUT_S = 10.0


def agent_consumer_names(public_key: str, slots: int) -> list[str]:
    return [agent_consumer_name(public_key, slot) for slot in range(slots)]


async def pull_consumer(js: JetStreamContext, stream: str, config: ConsumerConfig) -> JetStreamContext.PullSubscription:
    """A pull subscription on a new ephemeral consumer with `config` (ack policy none, a filter, a start).
    Raises Forbidden (the node refused: not a member, not a filter of one project), LimitReached (every slot
    of the agent is in use), Unavailable, or the nats error of a direct create."""
    key = confined_key(js)
    if key is None:
        async with asyncio.timeout(JS_TIMEOUT_S):
            return await js.pull_subscribe(config.filter_subject or ">", stream=stream, config=config)
    if config.filter_subject is None:
        rule = "an agent reads one project at a time through a consumer a node opens: name the project"
        raise Forbidden(key.agent_id, "read", f"every subject of {stream}", rule)
    request = build_request(
        ConsumerOpenRequest,
        owner_key=key.public_key,
        stream=stream,
        filter_subject=config.filter_subject,
        start_seq=config.opt_start_seq,
        last_per_subject=config.deliver_policy == DeliverPolicy.LAST_PER_SUBJECT,
        idle_s=min(config.inactive_threshold or 30.0, 60.0),
    )
    reply = await ask_one(js._nc, CONSUMER_OPEN, request, ConsumerOpenReply, signer=key, timeout_s=OPEN_TIMEOUT_S)
    if reply.name is None:
        raise LimitReached(
            "agent consumers",
            reply.slots,
            f"agent {key.agent_id!r} holds {len(reply.open)} consumers on {stream} ({', '.join(reply.open)})",
            "close a reader (tail, a watcher), wait for idle ones to close (60 s at most), "
            "or ask the operator to raise `epibus up --agent-consumers`",
        )
    async with nats_call(f"binding consumer {reply.name} on {stream}"):
        return await js.pull_subscribe_bind(reply.name, stream=stream)


async def drop_consumer(js: JetStreamContext, subscription: JetStreamContext.PullSubscription) -> None:
    """Stop pulling; an agent's consumer is deleted too, so its slot is free at once (others idle out)."""
    try:
        await subscription.unsubscribe()
        if confined_key(js) is not None and subscription._consumer:  # nats-py keeps the names there
            async with asyncio.timeout(JS_TIMEOUT_S):
                await js.delete_consumer(subscription._stream, subscription._consumer)
    except DROP_ERRORS as e:  # gone with the connection, or idled out already
        log.info("dropping a consumer: %s %s", type(e).__name__, e)


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

    def service(self) -> Service[ConsumerOpenRequest]:
        return Service(
            CONSUMER_OPEN, ConsumerOpenRequest, ConsumerOpenReply, self.open, consumer_rule, queue=CONSUMER_QUEUE
        )

    async def open(self, request: ConsumerOpenRequest) -> dict[str, Any]:
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
                return {"name": name, "slots": self.slots, "open": sorted(taken)}
            taken.add(name)  # another node filled the slot meanwhile with another reader's consumer
        self.counts.full += 1
        log.warning("agent %s: all %d consumer slots on %s in use", request.owner_key, self.slots, request.stream)
        return {"name": None, "slots": self.slots, "open": sorted(taken)}

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
