"""Pull consumers an agent reads through. On a node with authentication an agent may not create consumers: it
asks a node (`epibus.consumer.open`, signed), which checks the filter against the agent's projects and creates
a pull consumer named for the agent in one of its slots (bus/services/consumer_slots.py). Elsewhere (the node's
own connection, a server without authentication) consumers are created directly.

`pull_consumer` is the one way a reader opens an ephemeral consumer, `drop_consumer` the one way it lets go."""

from __future__ import annotations

import asyncio
import logging

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from bus.broker.ask import ask_one
from bus.broker.nats_errors import JS_TIMEOUT_S, RETRYABLE, nats_call
from bus.errors import Forbidden, LimitReached
from bus.identity.confinement import confined_key
from bus.model.requests import ConsumerOpenReply, ConsumerOpenRequest, build_request
from bus.subjects import CONSUMER_OPEN, agent_consumer_name

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


async def drop_durable(js: JetStreamContext, stream: str, name: str) -> None:
    """Delete a durable consumer nothing reads through any more (a journal set aside). One that is gone already
    is fine; a server that does not answer is logged: the consumer then waits for an operator to remove it."""
    try:
        async with asyncio.timeout(JS_TIMEOUT_S):
            await js.delete_consumer(stream, name)
    except nats.js.errors.NotFoundError:
        return
    except RETRYABLE as e:
        log.warning("durable consumer %s on %s not deleted (%s): remove it with `nats consumer rm`", name, stream, e)
        return
    log.info("durable consumer %s on %s deleted", name, stream)
