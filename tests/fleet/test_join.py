"""A fleet joined by invites, on this machine's loopback: a hub listening for joining nodes (mutual TLS, each
node its own nkey), a node that joins with a one-time token, events crossing both ways, the token refused when
used again, forged or expired, and a removed node shut out at once. The same across network namespaces is in
test_hosts.py."""

from __future__ import annotations

import contextlib
import functools
import shutil
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats
import pytest

from bus.broker.ask import ask_one
from bus.client.client import connect
from bus.errors import ConfigError, Forbidden
from bus.host.ports import free_ports
from bus.identity.signing import NODE_KEY_FILE, AgentKey, node_key
from bus.model.requests import FleetInviteReply, FleetInviteRequest, FleetRemoveRequest, FleetReply
from bus.model.vocab import ReceiptLevel, Role
from bus.subjects import FLEET_INVITE, FLEET_REMOVE, STREAM
from epibus.fleet.doctor import certificate_checks, member_checks
from epibus.fleet.hub import FleetRoster
from epibus.fleet.invites import decode_token, encode_token
from epibus.monitoring.health import node_health
from epibus.node.node import Node, NodeConfig
from epibus.ops.doctor_local import Check
from observers.mirror.fleet_vectors import FleetEmbedder
from tests.conftest import finding, postgres_database
from tests.support import enrol_agent, eventually, journal_event_ids, operator_credentials


def free_port() -> int:
    return free_ports(1)[0]


@contextlib.asynccontextmanager
async def hub_node(tmp_path: Path) -> AsyncIterator[Node]:
    async with Node(NodeConfig(home=tmp_path / "hub", name="hub", mirror="off", fleet_port=free_port())) as hub:
        yield hub


async def invite(hub: Node, name: str, *, ttl_s: float = 600) -> str:
    admin = node_key(hub.config.home)
    async with await nats.connect(hub.nats_url, **admin.nats_credentials) as nc:
        request = FleetInviteRequest(name=name, ttl_s=ttl_s)
        reply = await ask_one(nc, FLEET_INVITE, request, FleetInviteReply, signer=admin, timeout_s=15)
    return reply.token


async def test_a_node_joins_by_invite_and_events_cross_both_ways(tmp_path: Path, project: str) -> None:
    async with hub_node(tmp_path) as hub:
        token = await invite(hub, "node-2")
        async with Node(NodeConfig(home=tmp_path / "n2", mirror="off", join=token)) as joined:
            assert joined.name == "node-2"
            assert joined.fleet.leaf is not None
            assert joined.fleet.leaf.state.phase == "joined"
            # an agent of the hub publishes; the joined node's journal holds it
            await enrol_agent(hub.nats_url, hub.config.home, AgentKey.load_or_create(tmp_path, "alice"),
                              roles=[Role.agent], projects=[project])  # fmt: skip
            async with connect(hub.nats_url, agent="alice", home=tmp_path, outbox=False) as alice:
                sent = await alice.publish(alice.event("finding", finding(1), project=project))
            n2_journal = joined.journal
            assert n2_journal is not None
            await eventually(lambda: str(sent.event_id) in journal_event_ids(n2_journal.url, project), timeout_s=30)
            # an agent enrolled through the joined node connects to it and publishes into the hub's stream
            bob = AgentKey.load_or_create(tmp_path, "bob")
            await enrol_agent(joined.nats_url, joined.config.home, bob, roles=[Role.agent], projects=[project])
            async with connect(joined.nats_url, agent="bob", home=tmp_path, outbox=False) as client:
                back = await client.publish(client.event("finding", finding(2), project=project))
            hub_journal = hub.journal
            assert hub_journal is not None
            await eventually(lambda: str(back.event_id) in journal_event_ids(hub_journal.url, project), timeout_s=30)
            async with await nats.connect(hub.nats_url, **operator_credentials(hub.config.home)) as operator:
                members = {m.name: m for m in await FleetRoster(operator.jetstream()).members()}
                stored = await operator.jetstream().stream_info(STREAM)
            assert members["node-2"].public_key == joined.key.public_key
            assert members["node-2"].role == "leaf"
            assert members["hub"].role == "hub"
            assert stored.state.messages >= 2


async def test_an_invite_is_used_once_and_a_forged_or_expired_one_is_refused(tmp_path: Path) -> None:
    async with hub_node(tmp_path) as hub:
        token = await invite(hub, "node-2")
        async with Node(NodeConfig(home=tmp_path / "n2", mirror="off", join=token)):
            pass
        with pytest.raises(Forbidden, match="the hub refused the invite's key"):
            async with Node(NodeConfig(home=tmp_path / "again", mirror="off", join=token)):
                pass
        forged = decode_token(token).model_copy(
            update={"invite_seed": AgentKey.generate("x").nats_credentials["nkeys_seed_str"]}
        )
        with pytest.raises(Forbidden, match="the hub refused the invite's key"):
            async with Node(NodeConfig(home=tmp_path / "forged", mirror="off", join=encode_token(forged))):
                pass
        late = decode_token(token).model_copy(update={"expires_at": datetime.now(UTC) - timedelta(seconds=1)})
        with pytest.raises(ConfigError, match=r"expired at .* ask an admin for a new one"):
            async with Node(NodeConfig(home=tmp_path / "late", mirror="off", join=encode_token(late))):
                pass


async def test_a_removed_node_is_shut_out_at_once_and_comes_back_only_with_a_new_key(tmp_path: Path) -> None:
    async with hub_node(tmp_path) as hub:
        token = await invite(hub, "node-2")
        async with Node(NodeConfig(home=tmp_path / "n2", mirror="off", join=token)) as joined:
            admin = node_key(hub.config.home)
            async with await nats.connect(hub.nats_url, **admin.nats_credentials) as nc:
                request = FleetRemoveRequest(name="node-2")
                reply = await ask_one(nc, FLEET_REMOVE, request, FleetReply, signer=admin, timeout_s=15)
            assert isinstance(reply.member, dict)
            assert reply.member["revoked_at"] is not None
            assert hub.fleet_hub is not None
            assert hub.fleet_hub.kicked == 1
            server = joined.server
            assert server is not None

            def refused() -> bool:
                return "authorization violation" in server.log_tail(40).lower()

            await eventually(refused, timeout_s=15)
            # the node says so in its health until it is dealt with, not only as retries in its log
            link = joined.fleet_link
            assert link is not None
            await eventually(lambda: link.refused, timeout_s=15)
            assert "it was removed from the fleet" in node_health(joined)["fleet"]["refused"]
        # restarted, it is refused by the hub and told why
        with pytest.raises(Forbidden, match="the hub refuses this node's key: it was removed from the fleet"):
            async with Node(NodeConfig(home=tmp_path / "n2", mirror="off")):
                pass
        # its key cannot come back, even with a new invite (here: the key copied into a new home)
        (tmp_path / "copied").mkdir(mode=0o700)
        shutil.copy(tmp_path / "n2" / NODE_KEY_FILE, tmp_path / "copied" / NODE_KEY_FILE)
        with pytest.raises(Forbidden, match=r"removed from the fleet at .* a node rejoins with a new key"):
            async with Node(NodeConfig(home=tmp_path / "copied", mirror="off", join=await invite(hub, "node-2"))):
                pass
        async with Node(NodeConfig(home=tmp_path / "n2-new", mirror="off", join=await invite(hub, "node-2"))) as back:
            assert back.fleet.leaf is not None
            assert back.fleet.leaf.state.phase == "joined"


async def test_a_node_pointed_at_another_nodes_server_is_told_how_nodes_join(tmp_path: Path) -> None:
    async with hub_node(tmp_path) as hub:
        with pytest.raises(Forbidden, match=r"runs `epibus fleet invite NAME` on the fleet's hub.*--join TOKEN"):
            async with Node(NodeConfig(home=tmp_path / "other", nats_url=hub.nats_url, mirror="off")):
                pass


async def test_a_joined_node_keeps_its_journal_in_its_own_postgresql_database_and_its_mirror_on_qdrant_client(
    tmp_path: Path, project: str
) -> None:
    """One PostgreSQL database per node (the supported layout), a mirror on the Qdrant client API (its local
    mode here; a server URL elsewhere): the hub's event reaches both and is recalled by meaning."""
    with postgres_database() as hub_db, postgres_database() as joined_db:
        config = NodeConfig(home=tmp_path / "hub", name="hub", mirror="off", fleet_port=free_port(), journal_url=hub_db)
        async with Node(config) as hub:
            token = await invite(hub, "node-2")
            joined_config = NodeConfig(
                home=tmp_path / "n2", mirror="server", qdrant_url=str(tmp_path / "qdrant"), journal_url=joined_db,
                join=token,
            )  # fmt: skip
            async with Node(joined_config) as joined:
                alice = AgentKey.load_or_create(tmp_path, "alice")
                await enrol_agent(hub.nats_url, hub.config.home, alice, roles=[Role.agent], projects=[project])
                async with connect(hub.nats_url, agent="alice", home=tmp_path, outbox=False) as client:
                    text = "the night shift forgets to lock the loading dock"
                    sent = await client.publish(client.event("finding", finding(1) | {"text": text}, project=project))
                    event_id = str(sent.event_id)
                    for url in (hub_db, joined_db):
                        await eventually(functools.partial(journaled, url, project, event_id), timeout_s=30)

                    async def recalled() -> bool:
                        answer = await client.recall("who leaves the dock unlocked at night", project)
                        return event_id in [hit["event_id"] for hit in answer.hits]

                    await eventually(recalled, timeout_s=60, interval_s=0.5)
                    assert joined.name in (await client.recall("dock", project)).nodes


def journaled(url: str, project: str, event_id: str) -> bool:
    return event_id in journal_event_ids(url, project)


async def test_the_doctor_checks_a_fleet_nodes_certificates_members_and_clocks(tmp_path: Path) -> None:
    async with hub_node(tmp_path) as hub:
        token = await invite(hub, "node-2")
        async with Node(NodeConfig(home=tmp_path / "n2", mirror="off", join=token)) as joined:
            assert joined.nc is not None
            checks = {c.check: c for c in await member_checks(joined.nc.jetstream())}
            assert {checks["fleet node hub"].status, checks["fleet node node-2"].status} == {"ok"}
            skewed = {
                c.check: c
                for c in await member_checks(joined.nc.jetstream(), now=datetime.now(UTC) - timedelta(seconds=30))
            }
            assert skewed["fleet node hub"].status == "warn"
            assert "ahead of this machine's" in skewed["fleet node hub"].detail
        home = tmp_path / "n2"
        assert [c.status for c in certificate_checks(home)] == ["ok", "ok"]
        later = datetime.now(UTC) + timedelta(days=350)
        assert [c.status for c in certificate_checks(home, now=later)] == ["ok", "warn"]
        much_later = datetime.now(UTC) + timedelta(days=400)
        expired = certificate_checks(home, now=much_later)
        assert expired[1].status == "fail"
        assert "expired at" in expired[1].detail
        # a member that stopped is named unreachable by the hub's doctor
        assert hub.nc is not None
        gone = {c.check: c for c in await eventually(lambda: _unreachable(hub), timeout_s=15)}
        assert "unreachable" in gone["fleet node node-2"].detail


async def _unreachable(hub: Node) -> list[Check] | None:
    assert hub.nc is not None
    checks = await member_checks(hub.nc.jetstream())
    return checks if any(c.status == "fail" for c in checks) else None


@pytest.mark.slow  # two nodes with the embedding model
async def test_a_joined_node_takes_the_vectors_the_hub_embedded_through_the_leaf_link(
    tmp_path: Path, project: str
) -> None:
    texts = ["the cache is cold after every deploy", "dns lookups flap under load", "disks fill up at night"]
    async with Node(NodeConfig(home=tmp_path / "hub", name="hub", fleet_port=free_port())) as hub:
        await enrol_agent(hub.nats_url, hub.config.home, AgentKey.load_or_create(tmp_path, "alice"),
                          roles=[Role.agent], projects=[project])  # fmt: skip
        async with connect(hub.nats_url, agent="alice", home=tmp_path, outbox=False) as alice:
            events = [alice.event("finding", finding(text=text), project=project) for text in texts]
            await alice.publish_many(events, wait_for=ReceiptLevel.indexed)
        token = await invite(hub, "node-2")
        async with Node(NodeConfig(home=tmp_path / "n2", join=token)) as joined:
            await eventually(lambda: joined.mirror is not None and joined.mirror.indexed == len(texts), timeout_s=60)
            assert joined.embedder is not None
            fleet = joined.embedder.inner
            assert isinstance(fleet, FleetEmbedder)
            assert (fleet.stats.taken, fleet.stats.refused, fleet.stats.read_failures) == (len(texts), 0, 0)
