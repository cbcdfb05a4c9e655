"""What an enrolled agent can reach of other agents' watches on a node that authenticates: it opens a consumer
on its own notices only, never another agent's, and it can neither read nor write the watches bucket nor publish
a notice."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bus.broker.ask import ask_one
from bus.errors import Forbidden
from bus.identity.signing import AgentKey
from bus.model.requests import ConsumerOpenReply, ConsumerOpenRequest
from bus.model.vocab import Role
from bus.subjects import CONSUMER_OPEN, WATCHES_BUCKET, js_api, kv_stream, kv_subject, notices_filter
from epibus.node.node import Node, NodeConfig
from tests.security.test_broker import Violations
from tests.security.test_confinement import raw, refused
from tests.support import enrol_agent


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    async with Node(NodeConfig(home=tmp_path / "home", mirror="off")) as running:
        assert running.authenticated
        yield running


async def test_an_agent_reads_its_own_notices_only_and_never_the_watches_bucket(node: Node, project: str) -> None:
    keys = {name: AgentKey.load_or_create(node.config.home, name) for name in ("alice", "mallory")}
    for key in keys.values():
        await enrol_agent(node.nats_url, node.config.home, key, roles=[Role.agent], projects=[project])
    alice, mallory = keys["alice"], keys["mallory"]
    violations = Violations()
    nc = await raw(node, mallory, violations)
    try:

        async def open_on(filter_subject: str) -> ConsumerOpenReply:
            request = ConsumerOpenRequest(
                owner_key=mallory.public_key, stream="EPI_WATCH", filter_subject=filter_subject
            )
            return await ask_one(nc, CONSUMER_OPEN, request, ConsumerOpenReply, signer=mallory, timeout_s=10)

        assert (await open_on(notices_filter(mallory.public_key))).name is not None  # its own
        for theirs in (notices_filter(alice.public_key), "epiwatch.>", f"epiwatch.*.*.{project}.*"):
            with pytest.raises(Forbidden, match="reads the notices pushed to it only"):
                await open_on(theirs)
        info = js_api("STREAM.INFO", kv_stream(WATCHES_BUCKET))
        await refused(violations, info, nc.request(info, b"{}", timeout=2))
        get = js_api("DIRECT.GET", kv_stream(WATCHES_BUCKET), kv_subject(WATCHES_BUCKET, f"{alice.public_key}.*"))
        await refused(violations, get, nc.request(get, b"", timeout=2))
        put = kv_subject(WATCHES_BUCKET, f"{mallory.public_key}.{'0' * 32}")
        await refused(violations, put, nc.publish(put, b"{}"))
        forged = f"epiwatch.{alice.public_key}.{'0' * 32}.{project}.a1"
        await refused(violations, forged, nc.publish(forged, b"{}"))
    finally:
        await nc.close()
