"""Who may change whose claims, against the configuration `epibus up` runs (the embedded server with
authentication, an edge mirror): agents enrolled with explicit owners, roles and projects try what the authority
policy forbids (bus/model/authority.py), once through the client (refused before publishing, `Forbidden` naming the
rule) and once as a raw event signed with their own key (it reaches the stream; every store records it
rejected with the reason and nothing changes), and do what it allows."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsClient

from bus.client import enrol
from bus.client.client import EpibusClient, connect
from bus.client.project_view import load_project
from bus.errors import Forbidden
from bus.identity.signing import AgentKey, node_key
from bus.intake.reader import replay
from bus.model.event import Envelope, encode_event
from bus.model.requests import EnrolRequest, build_request
from bus.model.state import ArtifactState, Verification
from bus.model.vocab import ReceiptLevel, Role, Trust
from bus.outbox.outbox import Outbox
from bus.outbox.outbox_file import OutboxRow
from bus.subjects import POLICY_PROJECT, STREAM, event_subject
from epibus.node.node import Node, NodeConfig
from observers.journal import Journal, JournalObserver
from observers.mirror.store import Filter
from observers.reads import snapshot
from observers.verify import verify
from tests.conftest import finding
from tests.support import eventually, identity_for, operator_credentials

CLAIM = "the nightly backup skips the audit volume"


@dataclass
class Fleet:
    node: Node
    home: Path
    project: str
    keys: dict[str, AgentKey]
    clients: dict[str, EpibusClient]
    operator: NatsClient  # the node's own key: reads what agents may not


ENROLLED: dict[str, tuple[str, list[Role]]] = {  # agent -> (owner, roles); each a member of the test's project only
    "alice": ("alice@example.org", [Role.agent]),
    "alice2": ("alice@example.org", [Role.agent]),  # a second identity of alice's
    "bob": ("bob@example.org", [Role.agent]),
    "rita": ("rita@example.org", [Role.reviewer]),
    "root": ("ops@example.org", [Role.admin]),
}


async def _enrol(node: Node, home: Path, key: AgentKey, owner: str, roles: list[Role], projects: list[str]) -> None:
    admin = node_key(home)
    nc = await nats.connect(node.nats_url, **admin.nats_credentials)
    try:
        request = build_request(
            EnrolRequest,
            agent_id=key.agent_id,
            public_key=key.public_key,
            owner=owner,
            roles=roles,
            projects=projects,
            identity=identity_for(roles),
        )
        await enrol.enrol(nc, admin, request)
    finally:
        await nc.close()


@pytest.fixture
async def fleet(tmp_path: Path, project: str) -> AsyncIterator[Fleet]:
    home = tmp_path / "home"
    async with Node(NodeConfig(home=home, name="node-a")) as node:
        assert node.authenticated
        # A person's key is never among the node home's agent keys (the node would enrol it as an agent).
        where = {name: tmp_path / "people" if Role.reviewer in roles else home for name, (_, roles) in ENROLLED.items()}
        keys = {name: AgentKey.load_or_create(where[name], name) for name in ENROLLED}
        for name, (owner, roles) in ENROLLED.items():
            await _enrol(node, home, keys[name], owner, roles, [project])
        clients = {name: await connect(node.nats_url, key=keys[name], home=home, outbox=False) for name in ENROLLED}
        operator = await nats.connect(node.nats_url, **operator_credentials(home))
        try:
            yield Fleet(node, home, project, keys, clients, operator)
        finally:
            await operator.close()
            for client in clients.values():
                await client.close()


async def alices_claim(fleet: Fleet) -> str:
    """A claim by alice, journaled and mirrored."""
    alice, mirror = fleet.clients["alice"], fleet.node.mirror
    assert mirror is not None
    indexed = mirror.indexed
    event = alice.event("finding", finding(text=CLAIM), project=fleet.project)
    await alice.publish(event, wait_for=ReceiptLevel.journaled, timeout_s=30)
    await eventually(lambda: mirror.indexed > indexed, timeout_s=60)
    return event.artifact_id


async def stored(fleet: Fleet, artifact_id: str) -> tuple[ArtifactState, list[Mapping[str, Any]]]:
    """The claim as the journal's projection and the mirror's points hold it."""
    node = fleet.node
    assert node.journal is not None
    assert node.store is not None
    state = snapshot(node.journal, fleet.project).states[artifact_id]
    where = Filter(equals={"project": fleet.project, "artifact_id": artifact_id})
    points = await node.store.retrieve(await node.store.point_ids(where))
    return state, [p.payload for p in points]


async def published_raw(fleet: Fleet, key: AgentKey, event: Envelope) -> dict[str, Any]:
    """Publish a signed event past every client check, with plain nats-py as its agent; returns what the journal's
    projection made of it once the mirror has handled it too."""
    node, mirror = fleet.node, fleet.node.mirror
    assert node.journal is not None
    assert mirror is not None
    handled = mirror.illegal + mirror.transitions
    nc = await nats.connect(node.nats_url, **key.nats_credentials)
    try:
        subject = event_subject(event.project, event.kind, event.artifact_id)
        await nc.jetstream().publish(subject, encode_event(event), headers=OutboxRow.of(event).headers())
    finally:
        await nc.close()
    journal = node.journal
    outcome = await eventually(lambda: journal.outcomes([str(event.event_id)]).get(str(event.event_id)), timeout_s=30)
    await eventually(lambda: mirror.illegal + mirror.transitions > handled, timeout_s=30)
    return outcome


async def safely_recalled(fleet: Fleet, artifact_id: str) -> bool:
    answer = await fleet.clients["alice"].recall(CLAIM, fleet.project, timeout_s=10)
    return artifact_id in [hit["artifact_id"] for hit in answer.hits]


ATTEMPTS = {
    "retract": ("resolved", {"resolution": "retracted"}),
    "roll back": ("rolled_back", {"reason": "I think it is wrong"}),
    "forget": ("forgotten", {"reason": "I would rather nobody saw it"}),
}


@pytest.mark.parametrize("action", list(ATTEMPTS))
async def test_bob_may_not_retract_roll_back_or_forget_alices_claim_by_client_or_raw_event(
    fleet: Fleet, action: str
) -> None:
    aid = await alices_claim(fleet)
    before = await stored(fleet, aid)
    messages_before = (await fleet.operator.jetstream().stream_info(STREAM)).state.messages
    bob = fleet.clients["bob"]
    kind, body = ATTEMPTS[action]
    rule = f"agent 'bob' may not {action} alice's claim {aid} in project {fleet.project}: rule author-or-admin"
    attempt = (  # the client's forget checks through the same transition before it erases anything
        bob.forget(fleet.project, aid, reason=body["reason"])
        if kind == "forgotten"
        else bob.transition(kind, body, project=fleet.project, artifact_id=aid)
    )
    with pytest.raises(Forbidden, match=rule):
        await attempt
    assert (await fleet.operator.jetstream().stream_info(STREAM)).state.messages == messages_before

    outcome = await published_raw(
        fleet, fleet.keys["bob"], bob.event(kind, body, project=fleet.project, artifact_id=aid)
    )
    assert outcome["status"] == "rejected"
    assert outcome["reason"].startswith(rule)
    assert "only the author's identities (owner alice@example.org) or an admin" in outcome["reason"]
    assert await stored(fleet, aid) == before
    assert before[0].trust is Trust.unverified
    assert len(before[1]) == 1
    assert await safely_recalled(fleet, aid)


async def test_a_second_identity_of_the_author_may_not_verify_and_another_owner_may(fleet: Fleet) -> None:
    aid = await alices_claim(fleet)
    before = await stored(fleet, aid)
    alice2 = fleet.clients["alice2"]
    one_owner = "rule one-owner: it and the author alice have one owner (alice@example.org); another owner must verify"
    with pytest.raises(Forbidden, match=one_owner.replace("(", r"\(").replace(")", r"\)")):
        await alice2.transition("verified", {"note": "looks right to me"}, project=fleet.project, artifact_id=aid)
    raw = alice2.event("verified", {"note": "looks right to me"}, project=fleet.project, artifact_id=aid)
    outcome = await published_raw(fleet, fleet.keys["alice2"], raw)
    assert outcome["status"] == "rejected"
    assert one_owner in outcome["reason"]
    assert await stored(fleet, aid) == before

    await fleet.clients["bob"].transition("verified", {"note": "restored it"}, project=fleet.project, artifact_id=aid)
    await fleet.clients["rita"].transition(
        "verified", {"note": "read the logs"}, project=fleet.project, artifact_id=aid
    )
    node = fleet.node
    assert node.journal is not None
    journal, project = node.journal, fleet.project

    def two_verifications() -> tuple[Verification, ...] | None:
        found = snapshot(journal, project).verifications
        return found if len(found) == 2 else None

    log = await eventually(two_verifications)
    assert [(v.verifier, v.human_review) for v in log] == [("bob", False), ("rita", True)]  # rita reviews: a person
    state, payloads = await eventually(lambda: _trust_mirrored(fleet, aid, Trust.verified), timeout_s=30)
    assert state.trust is Trust.verified
    assert payloads[0]["trust"] == "verified"


async def _trust_mirrored(fleet: Fleet, aid: str, trust: Trust) -> tuple[ArtifactState, list[Mapping[str, Any]]] | None:
    found = await stored(fleet, aid)
    return found if found[0].trust is trust and all(p["trust"] == trust.value for p in found[1]) else None


async def test_an_admin_rolls_back_alices_claim_and_every_store_applies_it(fleet: Fleet) -> None:
    aid = await alices_claim(fleet)
    assert await safely_recalled(fleet, aid)
    await fleet.clients["root"].transition(
        "rolled_back", {"reason": "built on a bad dump"}, project=fleet.project, artifact_id=aid
    )
    state, payloads = await eventually(lambda: _trust_mirrored(fleet, aid, Trust.rolled_back), timeout_s=30)
    assert state.trust is Trust.rolled_back
    assert payloads[0]["trust"] == "rolled_back"
    assert not await safely_recalled(fleet, aid)


async def test_an_event_in_a_project_its_actor_is_not_a_member_of_is_refused_on_every_path(
    fleet: Fleet, tmp_path: Path
) -> None:
    """bob is a member of the test's project only, so the broker refuses his publishes anywhere else. An event he
    signed for another project still reaches the stream through a node's outbox (signed offline under the node's
    home, forwarded by the node): the live journal and mirror, the client's fold, a replay, a repair, a second
    node catching up and a reindex all refuse it, naming the membership rule."""
    elsewhere = f"{fleet.project}-x"
    bob, node = fleet.clients["bob"], fleet.node
    assert node.journal is not None
    assert node.store is not None
    event = bob.event("finding", finding(text="a claim where bob has no say"), project=elsewhere)
    event_id = str(event.event_id)
    rule = f"agent 'bob' may not publish finding in project {elsewhere}: rule membership"
    outbox = await Outbox(fleet.home / "outbox.db").open()
    try:
        await outbox.add([OutboxRow.of(event)])
    finally:
        await outbox.close()
    assert node.forwarder is not None
    node.forwarder.wake()
    journal, mirror = node.journal, node.mirror
    assert mirror is not None
    refused_by_mirror = mirror.illegal
    live = await eventually(lambda: journal.outcomes([event_id]).get(event_id), timeout_s=30)
    assert live["status"] == "rejected"
    assert live["reason"].startswith(rule)
    await eventually(lambda: mirror.illegal > refused_by_mirror, timeout_s=30)
    assert await node.store.point_ids(Filter(equals={"project": elsewhere})) == []

    js = fleet.operator.jetstream()
    outcomes: dict[str, dict[str, Any]] = {"live journal": live}
    fold = (await load_project(js, elsewhere)).fold
    assert fold.rejected[event_id].startswith(rule)
    assert fold.artifacts == {}

    replayed = Journal(f"sqlite:///{tmp_path / 'replayed.db'}")
    replayed.migrate()
    await replay(js, JournalObserver(replayed, name="replayed"))
    outcomes["replayed journal"] = replayed.outcomes([event_id])[event_id]
    repaired = Journal(f"sqlite:///{tmp_path / 'repaired.db'}")
    repaired.migrate()
    await verify(js, repaired, None, project=elsewhere, repair=True)
    outcomes["repaired journal"] = repaired.outcomes([event_id])[event_id]

    second_home = tmp_path / "second"
    second_home.mkdir(mode=0o700)
    shutil.copy2(fleet.home / "node.nk", second_home / "node.nk")  # the same operator's second node
    config = NodeConfig(home=second_home, name="node-b", nats_url=node.nats_url, mirror="off")
    async with Node(config) as second:
        assert second.journal is not None
        caught_up = second.journal
        outcomes["second node's journal"] = await eventually(
            lambda: caught_up.outcomes([event_id]).get(event_id), timeout_s=60
        )
    await node.reindex_mirror()
    for path, outcome in outcomes.items():
        assert outcome["status"] == "rejected", path
        assert outcome["reason"] == live["reason"], path
    assert snapshot(journal, elsewhere).states == {}
    assert snapshot(repaired, elsewhere).states == {}
    assert await node.store.point_ids(Filter(equals={"project": elsewhere})) == []  # reindexed from the stream
    replayed.close()
    repaired.close()


async def test_no_agent_publishes_in_the_project_that_holds_the_enrolment_records(fleet: Fleet) -> None:
    alice = fleet.clients["alice"]
    before = (await fleet.operator.jetstream().stream_info(STREAM)).state.messages
    forged = alice.event("finding", finding(text="alice is an admin now"), project=POLICY_PROJECT)
    with pytest.raises(Forbidden, match="rule enrolment-records: project epibus holds only enrolment records"):
        await alice.publish(forged)
    assert (await fleet.operator.jetstream().stream_info(STREAM)).state.messages == before
