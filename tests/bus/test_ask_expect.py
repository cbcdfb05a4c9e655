"""A fan-out told which nodes to wait for waits for exactly those, whatever the live set says: an auditor asks
nodes it knows, one of them just restarted and not announced yet."""

from __future__ import annotations

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from bus.broker.ask import fan_out
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey
from bus.model.requests import IndexedReply, LookupRequest

SUBJECT = "epibus.test.lookup"


async def answer_as(nc: NatsClient, node: str) -> None:
    async def reply(msg: Msg) -> None:
        await msg.respond(IndexedReply(node=node, mirror=True, indexed=[]).model_dump_json().encode())

    await nc.subscribe(SUBJECT, cb=reply)


async def test_a_fan_out_waits_for_the_named_nodes_and_names_the_one_that_did_not_answer(
    nats_server: NatsServer,
) -> None:
    asker = AgentKey.generate("auditor")
    nc = await nats.connect(nats_server.url, **asker.nats_credentials)
    node = await nats.connect(nats_server.url)
    try:
        await answer_as(node, "node-1")
        await node.flush()
        request = LookupRequest([])
        # node-2 never answers, so this waits the whole timeout: long enough for node-1 on a loaded machine.
        both = await fan_out(nc, SUBJECT, request, IndexedReply, signer=asker, timeout_s=8, expect=["node-1", "node-2"])
        assert [a.node for a in both.answers if isinstance(a, IndexedReply)] == ["node-1"], both
        assert both.missing == ["node-2"]
        one = await fan_out(nc, SUBJECT, request, IndexedReply, signer=asker, timeout_s=30, expect=["node-1"])
        assert [a.node for a in one.answers if isinstance(a, IndexedReply)] == ["node-1"]
        assert one.missing == []
    finally:
        await node.close()
        await nc.close()
