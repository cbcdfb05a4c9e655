"""The one way a process answers a core NATS request: find who signed it (with an authorizer), decode the body,
validate it with the service's request model, apply the service's rule to the signer and the request, call the
handler, reply. Every request with a reply subject gets a reply: the answer, or an error line naming the refused
field, the rule that refused the asker, or the handler's exception. An asker can then tell a refusal from a node
that is not there. A process states its services as `Service` values and starts them with `serve_services`: no
handler checks a signature, a role or a reply subject itself."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import MaxPayloadError
from pydantic import BaseModel, ValidationError

from bus.broker.nats_errors import NATS_UNAVAILABLE
from bus.broker.tally import LatencyHistogram
from bus.enrolment.service_rules import Authorizer, Rule, ServiceGuard, answering
from bus.errors import ConfigError, Forbidden, error_summary
from bus.model.requests import MAX_ERROR_CHARS, ErrorReply, describe_invalid, describe_undecodable, refusal

log = logging.getLogger(__name__)
# What publishing a reply can run into: the connection is gone, or the server lowered max_payload since the check.
REPLY_NOT_SENT: tuple[type[BaseException], ...] = (*NATS_UNAVAILABLE, MaxPayloadError)

Req = TypeVar("Req", bound=BaseModel)
Rep = TypeVar("Rep", bound=BaseModel)
Handler = Callable[[Req], Awaitable[Rep]]


@dataclass
class ServiceCounts:
    """What one service did with the requests it got."""

    answered: int = 0  # replied with the handler's answer
    refused: int = 0  # the request did not fit its model: replied with the field and what is allowed
    forbidden: int = 0  # the asker may not ask this (unsigned, unknown, or lacking the role): replied with why
    failed: int = 0  # the handler (or the registry the authorizer reads) raised: replied with the exception
    unanswerable: int = 0  # no reply subject, or one the node may not publish on (not an inbox): ignored
    unsent: int = 0  # the reply could not be published (connection lost)


class Responder(Generic[Req, Rep]):
    """Answers one request subject as `node`: `handle` gets a validated request and returns its reply, a
    `reply_model` naming this node; the reply is checked as the asker will check it before it is sent."""

    def __init__(
        self,
        nc: NatsClient,
        subject: str,
        request_model: type[Req],
        reply_model: type[Rep],
        handle: Handler[Req, Rep],
        *,
        node: str,
        authorize: Authorizer[Req] | None = None,
        queue: str = "",
        concurrency: int = 1,
    ) -> None:
        if concurrency < 1:
            raise ConfigError("concurrency", f"{concurrency} is not a number of requests; at least 1")
        self.nc = nc
        self.authorize = authorize
        self.queue = queue
        self.subject = subject
        self.request_model = request_model
        self.reply_model = reply_model
        self.handle = handle
        try:  # every reply names the node, so a name no reply could carry is refused now, not at the first error
            ErrorReply(node=node, error="")
        except ValidationError as e:
            raise ConfigError("node", f"{node!r} cannot name a reply: {refusal(ErrorReply, e.errors()[0])}") from e
        self.node = node
        self.counts = ServiceCounts()
        self.latency = LatencyHistogram()  # seconds from a request's arrival to its reply, answered or not
        self.subscription: Subscription | None = None
        # Requests answered at once: nats-py hands a subscription's messages over one at a time, so a handler
        # that waits on the server (a write) would hold up every request behind it.
        self.concurrency = concurrency
        self._slots = asyncio.Semaphore(concurrency)
        self._answering: set[asyncio.Task[None]] = set()

    async def serve(self) -> Subscription:
        """Subscribe (no queue group: every process answering this subject answers every request)."""
        cb = self.answer if self.concurrency == 1 else self._answer_concurrently
        self.subscription = await self.nc.subscribe(self.subject, queue=self.queue, cb=cb)
        return self.subscription

    async def _answer_concurrently(self, msg: Msg) -> None:
        """Answer in a task of its own, at most `concurrency` at a time (the next message waits for a slot)."""
        await self._slots.acquire()
        task = asyncio.create_task(self.answer(msg), name=f"answer {self.subject}")
        self._answering.add(task)
        task.add_done_callback(self._answered)

    def _answered(self, task: asyncio.Task[None]) -> None:
        self._answering.discard(task)
        self._slots.release()
        if not task.cancelled() and (error := task.exception()) is not None:  # answer() replies to every error
            self.counts.failed += 1
            log.error("%s request failed outside its handler: %s", self.subject, error_summary(error))

    async def answer(self, msg: Msg) -> None:
        if not msg.reply:
            self.counts.unanswerable += 1
            log.warning("%s request without a reply subject ignored (%d)", self.subject, self.counts.unanswerable)
            return
        if self.authorize is not None and not self.authorize.replies_to(msg.reply):
            self.counts.unanswerable += 1
            log.warning(
                "%s request ignored (%d): its reply subject %r is no inbox, and this node publishes only on inboxes",
                self.subject,
                self.counts.unanswerable,
                msg.reply[:200],
            )
            return
        started = time.perf_counter()
        reply = await self._reply_to(msg)
        self.latency.observe(time.perf_counter() - started)
        await self._send(msg.reply, reply)

    async def _reply_to(self, msg: Msg) -> bytes:
        try:  # who signed it, before anything of the body is read
            asker = await self.authorize.identify(msg) if self.authorize is not None else None
        except Forbidden as e:
            return self._forbidden(e)
        except Exception as e:  # noqa: BLE001 - the registry did not answer (or a bug): answered, never silent
            return self._failed(f"{type(e).__name__}: {e}", e)
        request = self._request(msg.data)
        if isinstance(request, bytes):
            return request
        if asker is not None and self.authorize is not None:
            try:
                self.authorize.rule(asker, request)
            except Forbidden as e:
                return self._forbidden(e)
        try:
            with answering(asker):
                answer = await self.handle(request)
            reply = answer.model_dump_json().encode()
        except Exception as e:  # noqa: BLE001 - answered, counted and logged: a silent node looks absent
            return self._failed(f"{type(e).__name__}: {e}", e)
        if not isinstance(answer, self.reply_model) or getattr(answer, "node", None) != self.node:
            wrong = f"the handler answered a {type(answer).__name__}, not a {self.reply_model.__name__} of this node"
            return self._failed(wrong, None)
        problem = _reply_problem(self.reply_model, reply, max_bytes=self.nc.max_payload)
        if problem is not None:
            return self._failed(problem, None)
        self.counts.answered += 1
        return reply

    def _request(self, data: bytes) -> Req | bytes:
        """The validated request, or the error reply refusing it."""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            self.counts.refused += 1
            return self._error(describe_undecodable(self.request_model, data, e))
        try:
            return self.request_model.model_validate_json(text)
        except ValidationError as e:
            self.counts.refused += 1
            return self._error(describe_invalid(self.request_model, e))

    def _forbidden(self, error: Forbidden) -> bytes:
        self.counts.forbidden += 1
        log.warning("%s request refused (%d so far): %s", self.subject, self.counts.forbidden, error)
        return self._error(str(error))

    def _failed(self, error: str, cause: Exception | None) -> bytes:
        self.counts.failed += 1
        summary = error_summary(cause, limit=MAX_ERROR_CHARS) if cause is not None else _one_line(error)
        log.error("%s request failed (%d so far): %s", self.subject, self.counts.failed, summary)
        return self._error(error)

    def _error(self, error: str) -> bytes:
        return ErrorReply(node=self.node, error=_one_line(error)).model_dump_json().encode()

    async def _send(self, reply_subject: str, data: bytes) -> None:
        try:
            await self.nc.publish(reply_subject, data)
        except REPLY_NOT_SENT as e:
            self.counts.unsent += 1
            log.warning("%s reply not sent: %s %s", self.subject, type(e).__name__, e)


def _one_line(error: str) -> str:
    """An error as one line, cut to MAX_ERROR_CHARS so that the reply fits any server's max_payload."""
    line = " ".join(error.split())
    if len(line) > MAX_ERROR_CHARS:
        line = line[: MAX_ERROR_CHARS - 20] + f"...({len(line)} chars)"
    return line


def _reply_problem(model: type[BaseModel], reply: bytes, *, max_bytes: int) -> str | None:
    """Why this process's own answer would be refused by its askers (a bug here, or an answer too big for one
    message), or None."""
    if len(reply) > max_bytes:
        return f"the reply is {len(reply)} bytes, over the server's max_payload {max_bytes}; ask for less"
    try:
        model.model_validate_json(reply)
    except ValidationError as e:
        return f"the reply does not fit {model.__name__}: {refusal(model, e.errors()[0])}"
    return None


async def serve(
    nc: NatsClient,
    subject: str,
    request_model: type[Req],
    reply_model: type[Rep],
    handle: Handler[Req, Rep],
    *,
    node: str,
    authorize: Authorizer[Req] | None = None,
    queue: str = "",
    concurrency: int = 1,
) -> Responder[Req, Rep]:
    """Answer `subject` with `handle` from now on (with `queue`, one process of the group answers each request;
    with `concurrency`, up to that many at once); the returned responder holds the service's counts."""
    responder = Responder(
        nc,
        subject,
        request_model,
        reply_model,
        handle,
        node=node,
        authorize=authorize,
        queue=queue,
        concurrency=concurrency,
    )
    await responder.serve()
    return responder


@dataclass(frozen=True)
class Service(Generic[Req]):
    """One request service as its owner states it: the subject, the request and reply models, the handler and
    who may ask (its rule, bus/enrolment/service_rules.py). `queue`: one process of the group answers each request."""

    subject: str
    request_model: type[Req]
    reply_model: type[BaseModel]
    handle: Handler[Req, BaseModel]
    rule: Rule[Req]
    queue: str = ""
    always: bool = False  # apply the rule on a node without authentication too (its signer is needed)


async def serve_services(
    nc: NatsClient, services: Sequence[Service[Any]], *, node: str, guard: ServiceGuard
) -> dict[str, Responder[Any, Any]]:
    """Answer every service from now on as `node`, each through the one responder with the guard's authorizer
    for its rule. Returns each subject's responder (it holds the service's counts)."""
    responders: dict[str, Responder[Any, Any]] = {}
    for service in services:
        responders[service.subject] = await serve(
            nc,
            service.subject,
            service.request_model,
            service.reply_model,
            service.handle,
            node=node,
            authorize=guard.authorizer(service.rule, always=service.always),
            queue=service.queue,
        )
    return responders
