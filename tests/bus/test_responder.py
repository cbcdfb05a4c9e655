"""The one responder every request service uses: whatever the handler does, the asker gets one reply that fits in
a message, and the service counts what happened. Real nats-server; the handlers are the test's own."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsClient
from pydantic import BaseModel

from bus.errors import ConfigError
from bus.host.server import NatsServer
from bus.model.requests import MAX_ERROR_CHARS, ErrorReply, StoreCheckReply, VerifyReply, VerifyRequest
from bus.services.responder import Responder, serve
from observers.verify import StoreReport, VerifyReport

SUBJECT = "epibus.test.service"


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NatsClient]:
    client = await nats.connect(nats_server.url)
    try:
        yield client
    finally:
        await client.close()


async def serving(nc: NatsClient, handle: Any) -> Responder[VerifyRequest, VerifyReply]:
    return await serve(nc, SUBJECT, VerifyRequest, VerifyReply, handle, node="node-t")


async def ask(nc: NatsClient, body: bytes = b"{}") -> dict[str, Any]:
    reply: dict[str, Any] = json.loads((await nc.request(SUBJECT, body, timeout=2)).data)
    return reply


async def test_a_handler_that_raises_is_answered_with_the_exception_logged_and_counted(
    nc: NatsClient, caplog: pytest.LogCaptureFixture
) -> None:
    async def handle(request: VerifyRequest) -> VerifyReply:
        raise RuntimeError(f"the store fell over while checking {request.project}")

    responder = await serving(nc, handle)
    with caplog.at_level(logging.ERROR, logger="bus.services.responder"):
        reply = await ask(nc, b'{"project": "p"}')
    assert reply == {"node": "node-t", "error": "RuntimeError: the store fell over while checking p"}
    assert (responder.counts.failed, responder.counts.answered) == (1, 0)
    (record,) = [r for r in caplog.records if r.name == "bus.services.responder"]
    assert "RuntimeError" in record.getMessage()
    assert "test_responder.py" in record.getMessage()  # where it was raised


async def test_a_huge_error_message_is_cut_so_the_reply_still_fits_in_one_message(nc: NatsClient) -> None:
    async def handle(request: VerifyRequest) -> VerifyReply:
        raise ValueError("x" * (3 << 20))

    responder = await serving(nc, handle)
    reply = ErrorReply.model_validate(await ask(nc))
    assert reply.error.startswith("ValueError: xxx")
    assert len(reply.error) <= MAX_ERROR_CHARS
    assert reply.error.endswith(f"({len('ValueError: ') + (3 << 20)} chars)")
    assert responder.counts.failed == 1


def clean_store() -> StoreCheckReply:
    return VerifyReport(0, StoreReport(), None).reply("node-t").journal


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")  # the bad value is the point
async def test_an_answer_that_does_not_fit_the_reply_model_is_answered_as_an_error(nc: NatsClient) -> None:
    async def handle(request: VerifyRequest) -> VerifyReply:  # built around validation, as a bug could
        return VerifyReply.model_construct(
            node="node-t", stream_events="many", journal=clean_store(), mirror=None, repaired=False, clean=True
        )

    responder = await serving(nc, handle)
    reply = await ask(nc)
    assert reply["error"].startswith("the reply does not fit VerifyReply: ")
    assert responder.counts.failed == 1


async def test_an_answer_of_another_model_or_node_is_answered_as_an_error(nc: NatsClient) -> None:
    answers: list[BaseModel] = [
        ErrorReply(node="node-t", error="not a verify reply"),
        VerifyReport(0, StoreReport(), None).reply("another-node"),
    ]

    async def handle(request: VerifyRequest) -> BaseModel:
        return answers.pop(0)

    responder = await serving(nc, handle)
    assert (await ask(nc))["error"] == "the handler answered a ErrorReply, not a VerifyReply of this node"
    assert (await ask(nc))["error"] == "the handler answered a VerifyReply, not a VerifyReply of this node"
    assert responder.counts.failed == 2


async def test_an_answer_over_the_servers_max_payload_is_answered_as_an_error(nc: NatsClient) -> None:
    async def handle(request: VerifyRequest) -> VerifyReply:
        huge = clean_store().model_copy(update={"sample_missing": ["x" * (nc.max_payload + 1)]})
        return VerifyReport(0, StoreReport(), None).reply("node-t").model_copy(update={"journal": huge})

    responder = await serving(nc, handle)
    reply = await ask(nc)
    assert "over the server's max_payload" in reply["error"]
    assert responder.counts.failed == 1


async def test_a_valid_request_reaches_the_handler_validated_and_its_answer_is_sent_with_the_node(
    nc: NatsClient,
) -> None:
    seen: list[VerifyRequest] = []

    async def handle(request: VerifyRequest) -> VerifyReply:
        seen.append(request)
        return VerifyReport(0, StoreReport(), None).reply("node-t")

    responder = await serving(nc, handle)
    reply = VerifyReply.model_validate(await ask(nc, b'{"project": "p", "repair": true}'))
    assert (reply.node, reply.clean) == ("node-t", True)
    assert seen == [VerifyRequest(project="p", repair=True)]
    assert (responder.counts.answered, responder.counts.refused, responder.counts.failed) == (1, 0, 0)


async def test_a_node_name_no_reply_could_carry_is_refused_at_start(nc: NatsClient) -> None:
    async def handle(request: VerifyRequest) -> VerifyReply:
        raise AssertionError("never asked")

    with pytest.raises(ConfigError, match="cannot name a reply"):
        await serve(nc, SUBJECT, VerifyRequest, VerifyReply, handle, node="")


async def _two_requests_where_the_first_waits_for_the_second(nc: NatsClient, concurrency: int) -> list[Any]:
    second_seen = asyncio.Event()

    async def handle(request: VerifyRequest) -> VerifyReply:
        if request.project == "second":
            second_seen.set()
        else:
            await asyncio.wait_for(second_seen.wait(), timeout=1.0)
        raise RuntimeError(f"answered {request.project}")

    await serve(nc, SUBJECT, VerifyRequest, VerifyReply, handle, node="node-t", concurrency=concurrency)
    first = asyncio.create_task(ask(nc, b'{"project": "first"}'))
    await asyncio.sleep(0.1)  # the first is being answered before the second is sent
    second = await ask(nc, b'{"project": "second"}')
    return [await first, second]


async def test_a_concurrent_responder_answers_a_request_while_another_waits(nc: NatsClient) -> None:
    first, second = await _two_requests_where_the_first_waits_for_the_second(nc, concurrency=2)
    assert first["error"] == "RuntimeError: answered first"
    assert second["error"] == "RuntimeError: answered second"


async def test_a_responder_answers_one_request_at_a_time_by_default(nc: NatsClient) -> None:
    first, second = await _two_requests_where_the_first_waits_for_the_second(nc, concurrency=1)
    assert first["error"].startswith("TimeoutError")  # the second waited behind it
    assert second["error"] == "RuntimeError: answered second"


def test_a_responder_needs_room_for_one_request_at_least(nc: NatsClient) -> None:
    async def never_called(_request: VerifyRequest) -> VerifyReply:
        raise AssertionError("a responder without room answers nothing")

    with pytest.raises(ConfigError, match="concurrency"):
        Responder(nc, SUBJECT, VerifyRequest, VerifyReply, never_called, node="node-t", concurrency=0)
