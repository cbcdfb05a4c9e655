"""Receipts beyond a PubAck: acknowledgements another process's forwarder recorded in the shared outbox, the
journal's confirmation (`journaled`) with what the state projection made of each event, and a mirror's
(`indexed`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js.api import PubAck

from bus.broker.ask import fan_out, refusal
from bus.errors import ConfigError, Forbidden, Unavailable
from bus.identity.signing import AgentKey
from bus.model.requests import LOOKUP_CHUNK, ErrorReply, IndexedReply, LookupReply, LookupRequest
from bus.model.vocab import ReceiptLevel
from bus.outbox.outbox import Outbox
from bus.outbox.publish import Receipt
from bus.subjects import JOURNAL_LOOKUP, MIRROR_LOOKUP

LOOKUP_TIMEOUT_S = 2.0  # one lookup; wait_journaled asks again until its own timeout


async def await_acks(
    futures: dict[str, asyncio.Future[PubAck]], outbox: Outbox, timeout_s: float
) -> dict[str, tuple[int, bool]]:
    """PubAcks (stream seq, duplicate) from this process's forwarder, or recorded in the shared outbox by
    another process's forwarder (a node draining the same outbox), until timeout_s. Refusals are raised."""
    acks: dict[str, tuple[int, bool]] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    poll_s = 0.02
    while len(acks) < len(futures) and loop.time() < deadline:
        waiting = [f for event_id, f in futures.items() if event_id not in acks]
        await asyncio.wait(waiting, timeout=min(poll_s, max(0.0, deadline - loop.time())))
        for event_id, future in futures.items():
            if event_id in acks or not future.done():
                continue
            error = future.exception()
            if error is not None:
                raise error
            acks[event_id] = (future.result().seq, bool(future.result().duplicate))
        missing = [event_id for event_id in futures if event_id not in acks]
        if missing:
            acks |= await outbox.sent(missing)
        poll_s = min(0.25, poll_s * 2)
    return acks


async def wait_journaled(
    connection: Callable[[], NatsClient | None],
    event_ids: Sequence[uuid.UUID],
    *,
    signer: AgentKey,
    timeout_s: float,
) -> dict[str, dict[str, Any]]:
    """Ask the journal observers (JOURNAL_LOOKUP, signed by `signer`: the connection receives on its inboxes)
    until every event id is confirmed. Returns each one's outcome (status, reason, flags). Raises Unavailable
    naming how many are missing and why, Forbidden when a journal refuses the signer."""
    missing = {str(e) for e in event_ids}
    outcomes: dict[str, dict[str, Any]] = {}
    delay_s = 0.01
    last_problem = "no journal observer answered"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while missing and loop.time() < deadline:
        nc = connection()
        asking = sorted(missing)
        for start in range(0, len(asking) if nc is not None else 0, LOOKUP_CHUNK):  # stay under max_payload
            assert nc is not None
            chunk = LookupRequest(asking[start : start + LOOKUP_CHUNK])
            try:
                replies = await fan_out(
                    nc, JOURNAL_LOOKUP, chunk, LookupReply, signer=signer, timeout_s=LOOKUP_TIMEOUT_S, one=True
                )
            except Unavailable as e:
                last_problem = e.cause
                break
            if replies.malformed:  # not a journal's answer: ask again, and say so if none comes
                origin, why = next(iter(replies.malformed.items()))
                last_problem = f"malformed journal lookup reply from {origin}: {why.removeprefix('malformed reply: ')}"
                continue
            if not replies.answers:
                last_problem = "no journal observer answered; is `epibus up` running?"
                break
            answer = replies.answers[0]
            if isinstance(answer, ErrorReply):
                error = refusal(answer, signer, JOURNAL_LOOKUP)
                if isinstance(error, Forbidden):  # asking again cannot help
                    raise error
                last_problem = f"journal {answer.node}: {answer.error}"
                continue
            missing -= set(answer.journaled)
            outcomes |= {event_id: o.model_dump(mode="json") for event_id, o in answer.outcomes.items()}
            last_problem = "the journal has not written them yet"
        if missing:
            await asyncio.sleep(delay_s)
            delay_s = min(0.2, delay_s * 2)
    if missing:
        raise Unavailable("journal", f"{len(missing)} event(s) not journaled within {timeout_s}s: {last_problem}")
    return outcomes


def journaled_receipt(receipt: Receipt, outcome: dict[str, Any]) -> Receipt:
    """The receipt raised to `journaled`, with the projection's flags and, if it refused the event, why."""
    flags = tuple(dict.fromkeys([*receipt.flags, *outcome.get("flags", [])]))
    rejected = outcome.get("reason") if outcome.get("status") == "rejected" else None
    return replace(receipt, level=ReceiptLevel.journaled, flags=flags, rejected=rejected)


def wanted_level(wait_for: ReceiptLevel | str, *, outbox: bool, offline: bool) -> ReceiptLevel:
    """The level `wait_for` names, if a client with (or without) an outbox, offline or not, can reach it.
    Raises ConfigError."""
    allowed = [level.value for level in ReceiptLevel]
    try:
        level = ReceiptLevel(wait_for)
    except ValueError:
        raise ConfigError("wait_for", f"{wait_for!r} is not a receipt level", allowed=allowed) from None
    if level is ReceiptLevel.outboxed and not outbox:
        raise ConfigError("wait_for", "'outboxed' needs the outbox; connect with outbox=True", allowed=allowed)
    if level in (ReceiptLevel.journaled, ReceiptLevel.indexed) and offline:
        raise ConfigError(
            "wait_for",
            f"'{level.value}' needs a running node and none runs (this client only outboxes); "
            "start one with `epibus up`, or wait for 'published' and get an `outboxed` receipt",
        )
    return level


async def confirmed(
    receipts: list[Receipt],
    level: ReceiptLevel,
    connection: Callable[[], NatsClient | None],
    *,
    signer: AgentKey,
    deadline_s: float,
) -> list[Receipt]:
    """The receipts raised to `level` when it is `journaled` or `indexed`, both within one deadline: the
    journals' confirmation first, then the mirrors' with what is left of it. Raises Unavailable, ConfigError."""
    if level not in (ReceiptLevel.journaled, ReceiptLevel.indexed):
        return receipts
    started = asyncio.get_running_loop().time()
    ids = [r.event_id for r in receipts]
    outcomes = await wait_journaled(connection, ids, signer=signer, timeout_s=deadline_s)
    receipts = [journaled_receipt(r, outcomes.get(str(r.event_id), {})) for r in receipts]
    if level is ReceiptLevel.indexed:  # the rest of the same deadline
        left_s = max(0.1, deadline_s - (asyncio.get_running_loop().time() - started))
        await wait_indexed(connection, ids, signer=signer, timeout_s=left_s)
        receipts = [replace(r, level=ReceiptLevel.indexed) for r in receipts]
    return receipts


async def wait_indexed(
    connection: Callable[[], NatsClient | None],
    event_ids: Sequence[uuid.UUID],
    *,
    signer: AgentKey,
    timeout_s: float,
) -> None:
    """Ask every node's mirror (MIRROR_LOOKUP, signed by `signer`) until one has indexed each event. Raises
    ConfigError at once when the nodes that answer run no mirror (waiting could never end), Unavailable naming
    how many are missing and why after timeout_s, Forbidden when a node refuses the signer."""
    missing = {str(e) for e in event_ids}
    delay_s = 0.01
    last_problem = "no node answered"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while missing and loop.time() < deadline:
        nc = connection()
        asking = sorted(missing)
        for start in range(0, len(asking) if nc is not None else 0, LOOKUP_CHUNK):
            assert nc is not None
            chunk = LookupRequest(asking[start : start + LOOKUP_CHUNK])
            try:
                replies = await fan_out(
                    nc, MIRROR_LOOKUP, chunk, IndexedReply, signer=signer, timeout_s=LOOKUP_TIMEOUT_S
                )
            except Unavailable as e:
                last_problem = e.cause
                break
            indexed, last_problem = _indexed_by_mirrors(replies.answers, signer, asking)
            missing -= indexed
        if missing:
            await asyncio.sleep(delay_s)
            delay_s = min(0.2, delay_s * 2)
    if missing:
        raise Unavailable("mirror", f"{len(missing)} event(s) not indexed within {timeout_s}s: {last_problem}")


def _indexed_by_mirrors(
    answers: Sequence[IndexedReply | ErrorReply], signer: AgentKey, asking: Sequence[str]
) -> tuple[set[str], str]:
    """What the answering mirrors have indexed, and what to say if something is still missing."""
    indexed: set[str] = set()
    problems: list[str] = []
    without = [a.node for a in answers if isinstance(a, IndexedReply) and not a.mirror]
    for answer in answers:
        if isinstance(answer, ErrorReply):
            error = refusal(answer, signer, MIRROR_LOOKUP)
            if isinstance(error, Forbidden):
                raise error
            problems.append(f"node {answer.node}: {answer.error}")
        elif answer.mirror:
            indexed |= set(answer.indexed)
    if without and len(without) == len(answers):
        published = f"event {asking[0]} is" if len(asking) == 1 else f"{len(asking)} events are"
        raise ConfigError(
            "wait_for",
            f"not indexed: this node has no mirror ({', '.join(sorted(without))} runs with --mirror off); "
            f"{published} published and journaled: wait for 'journaled', or run a node with a mirror",
        )
    if not answers:
        return indexed, "no node answered; is `epibus up` running?"
    return indexed, "; ".join(problems) or "the mirror has not indexed them yet"
