"""Asking the nodes: one request, signed by the asker's key, answered on an inbox of that key; every node's
answer (`fan_out`) or one node's (`ask_one`, for services a queue group answers). The one way a client asks a
node anything."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from pydantic import BaseModel

from bus.broker.nats_errors import NATS_UNAVAILABLE
from bus.broker.presence import LiveNodes, live_nodes
from bus.errors import ConfigError, EpibusError, Forbidden, Unavailable
from bus.identity.signing import AgentKey
from bus.model.auth import inbox_prefix
from bus.model.requests import ErrorReply, Malformed, read_reply

R = TypeVar("R", bound=BaseModel)


class Refused(EpibusError):
    """A node answered a request with an error."""

    def __init__(self, node: str, error: str) -> None:
        self.node = node
        self.error = error
        super().__init__(f"node {node} refused: {error}")


@dataclass
class Replies(Generic[R]):
    """What came back from a fan-out: each node's answer (its reply, or the error it answered with), and the
    replies that were neither, by who sent them (the node they name, else their arrival order) with why."""

    answers: list[R | ErrorReply] = field(default_factory=list)
    malformed: dict[str, str] = field(default_factory=dict)
    # Live nodes serving the subject that had not answered when the time was up, and why the live set is
    # unknown when it is (then the fan-out collected until its timeout).
    missing: list[str] = field(default_factory=list)
    live: LiveNodes | None = None

    @property
    def partial(self) -> bool:
        return bool(self.missing)

    def add_malformed(self, reply: Malformed, arrived: int) -> None:
        origin = reply.origin or f"reply {arrived}"
        while origin in self.malformed:  # two bad replies naming one node: keep both
            origin += "'"
        self.malformed[origin] = f"malformed reply: {reply.reason}"


async def fan_out(
    nc: NatsClient,
    subject: str,
    request: BaseModel,
    reply_model: type[R],
    *,
    signer: AgentKey,
    timeout_s: float,
    one: bool = False,
    expect: Collection[str] | None = None,
) -> Replies[R]:
    """Publish one request, signed by `signer`, that every node answers; collect the answers until every live
    node serving `subject` (bus.broker.presence) has answered, else until timeout_s, and name the live nodes that did
    not (`missing`). When no live set can be read (no node announces itself), collect until timeout_s. Replies
    that arrived meanwhile and are no node's answer (not JSON, the wrong shape, too big) are recorded as
    malformed, never taken as an answer. `one`: stop at the first answer (a service answered by one node of a
    queue group). `expect`: the names of the nodes to wait for instead of the live set (an auditor knows which
    nodes it asks, and a node just restarted may not be announced yet).

    The connection must receive on the signer's inboxes (`AgentKey.nats_credentials`): nodes answer only there.
    Raises ConfigError when it does not, Unavailable when NATS does."""
    inbox = nc.new_inbox()
    if not inbox.startswith(inbox_prefix(signer.public_key) + "."):
        raise ConfigError(
            "signer",
            f"this connection receives on {inbox.rsplit('.', 1)[0]}, not on the inboxes of {signer.agent_id}'s key; "
            "connect with that key (AgentKey.nats_credentials)",
        )
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def collect(msg: Msg) -> None:
        await queue.put(msg)

    subscription = await nc.subscribe(inbox, cb=collect)
    replies: Replies[R] = Replies()
    answered: set[str] = set()
    expected: set[str] | None = set(expect) if expect is not None else None  # the live nodes serving `subject`
    reading: asyncio.Future[LiveNodes] | None = None
    getting: asyncio.Future[Msg] | None = None
    try:
        data = request.model_dump_json().encode()
        headers = signer.sign_request(subject, inbox, data, signed_at=datetime.now(UTC))
        await nc.publish(subject, data, reply=inbox, headers=headers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if not one and expect is None:  # read who is live while the nodes work on the request
            reading = asyncio.ensure_future(live_nodes(nc.jetstream(), timeout_s=timeout_s))
        while loop.time() < deadline:
            if reading is not None and reading.done():
                replies.live = reading.result()
                reading = None
                if replies.live.known:
                    expected = replies.live.answering(subject)
            if expected is not None and expected <= answered:
                break
            if getting is None:
                getting = asyncio.ensure_future(queue.get())
            waiting: set[asyncio.Future[Any]] = {getting} if reading is None else {getting, reading}
            done, _ = await asyncio.wait(waiting, timeout=max(0.0, deadline - loop.time()))
            if getting not in done:
                continue
            msg, getting = getting.result(), None
            no_one = _read(msg, reply_model, nc.max_payload, replies, answered) == _NO_ONE
            got = bool(replies.answers or replies.malformed)
            if (no_one and not got) or (one and got):  # nobody listens on the subject, or one answer is enough
                break
        # Replies that came in with the last answer are listed too, never dropped unseen.
        while not one and not queue.empty():
            _read(queue.get_nowait(), reply_model, nc.max_payload, replies, answered)
    except NATS_UNAVAILABLE as e:
        raise Unavailable("nats", f"request on {subject}: {type(e).__name__} {e}") from e
    finally:
        leftover = [f for f in (getting, reading) if f is not None and not f.done()]
        for future in leftover:
            future.cancel()
        if leftover:
            await asyncio.wait(leftover)
        await subscription.unsubscribe()
    if expected is not None:
        replies.missing = sorted(expected - answered)
    return replies


_NO_ONE = "no responders"


def _read(msg: Msg, reply_model: type[R], max_bytes: int, replies: Replies[R], answered: set[str]) -> str:
    """Add one message to `replies` (an answer, or a malformed reply) and its node to `answered`. Returns
    _NO_ONE for the server's "no responders" status, "" for anything else."""
    if not msg.data:  # a status message (503: no responders), not an answer
        return _NO_ONE if (msg.headers or {}).get("Status") == "503" else ""
    reply = read_reply(msg.data, reply_model, max_bytes=max_bytes)
    if isinstance(reply, Malformed):
        replies.add_malformed(reply, len(replies.answers) + len(replies.malformed) + 1)
    else:
        replies.answers.append(reply)
        node = getattr(reply, "node", None)  # every reply model names its node
        if isinstance(node, str):
            answered.add(node)
    return ""


async def ask_one(
    nc: NatsClient, subject: str, request: BaseModel, reply_model: type[R], *, signer: AgentKey, timeout_s: float
) -> R:
    """The first node's answer to a signed request (see fan_out). Raises Forbidden (the node refused the signer),
    Refused (it answered with another error), Unavailable (no node answered)."""
    replies = await fan_out(nc, subject, request, reply_model, signer=signer, timeout_s=timeout_s, one=True)
    if not replies.answers:
        why = "; ".join(f"{n}: {e}" for n, e in replies.malformed.items()) or "no node answered"
        raise Unavailable("epibus node", f"{subject}: {why}; is `epibus up` running?")
    reply = replies.answers[0]
    if isinstance(reply, ErrorReply):
        raise refusal(reply, signer, subject)
    return reply


def refusal(reply: ErrorReply, signer: AgentKey, subject: str) -> Forbidden | Refused:
    """A node's error answer as the error to raise: Forbidden when it refused the signer (its rule named once),
    else Refused."""
    prefix = str(Forbidden(signer.agent_id, "ask", subject, ""))
    if reply.error.startswith(prefix):
        rule = reply.error.removeprefix(prefix).strip()
        return Forbidden(signer.agent_id, "ask", subject, f"{rule} (node {reply.node})")
    return Refused(reply.node, reply.error)


def refused_by_all(replies: Replies[R], signer: AgentKey, subject: str) -> Forbidden | None:
    """The refusal to raise when every node that answered refused the signer, else None."""
    errors = [refusal(a, signer, subject) if isinstance(a, ErrorReply) else None for a in replies.answers]
    refusals = [e for e in errors if isinstance(e, Forbidden)]
    return refusals[0] if refusals and len(refusals) == len(errors) else None
