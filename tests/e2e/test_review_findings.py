"""Review findings on the one-truth work: places where two paths that build state still disagree,
and a message that stops a node. Each test fails on the code it was written against.

1. Forgetting an artifact undoes what other artifacts' events said with it: a contradiction `contradicted_by`
   the forgotten artifact, and a claim that `supersedes` it, are applied live but rejected by every path that
   re-reads history without the forgotten claim (the journal's `rebuild()`, which the "behind the cursor" path
   and `verify --repair` run; replay; reindex; the client's fold; a second node).
2. The runner breaks stream order: when admission of one message is Unavailable (the key registry did not
   answer), that message is nak'ed and the rest of its batch is handled and acked before it. The mirror then
   loses a transition that came before its claim, and the journal keeps a later event under a reused id.
3. A validly signed event whose text holds a NUL character makes a PostgreSQL journal's write fail with a
   DataError, which `Journal.write` reports as Unavailable: the runner holds that batch as an outage forever,
   and nothing after it is journaled (nor mirrored: the mirror waits for the journal).
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from pathlib import Path

import nats
import nkeys
import pytest
from sqlalchemy import select

from bus.broker.loops import stop_all
from bus.broker.streams import ensure_streams
from bus.client.client import connect
from bus.client.project_view import load_project
from bus.enrolment.registry import AgentRegistry
from bus.errors import Unavailable
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey
from bus.intake.reader import replay
from bus.intake.runner import ConsumerRunner
from bus.model.event import Actor, canonical_json
from bus.model.ids import point_id
from bus.model.state import ArtifactState
from bus.model.vocab import ReceiptLevel
from bus.subjects import STREAM, event_subject, events_filter
from epibus.node.node import Node, NodeConfig
from observers.journal import EventQuery, Journal, JournalObserver
from observers.mirror.edge import EdgeVectorStore
from observers.mirror.observer import MirrorObserver, payload_state
from observers.projection import row_to_state
from observers.recall import recall
from observers.schema import artifacts
from tests.conftest import finding
from tests.e2e.test_one_truth import caught_up, dlq_reasons, mirrored_node, publish_raw, signed
from tests.histories import HashEmbedder
from tests.support import eventually


def journal_states(journal: Journal, project: str) -> dict[str, ArtifactState]:
    with journal.engine.connect() as conn:
        rows = conn.execute(select(artifacts).where(artifacts.c.project == project))
        return {r.artifact_id: row_to_state(r._mapping) for r in rows}


def labels(states: dict[str, ArtifactState], names: dict[str, str]) -> dict[str, str]:
    """label → state label (or 'absent') for the named artifacts."""
    return {label: (states[aid].state_label if aid in states else "absent") for label, aid in names.items()}


# -- 1. forgetting an artifact and the links other artifacts have to it ------------------------------------


async def _history_with_links_to_a_forgotten_artifact(
    server: NatsServer, tmp_path: Path, project: str
) -> dict[str, str]:
    """alice claims `forgotten`, `contradicted` and `successor` (which supersedes `forgotten`); bob contradicts
    `contradicted` by `forgotten`; then alice forgets `forgotten` (the client's forget: publish, then a running
    node erases its messages from the stream)."""
    async with (
        connect(server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice,
        connect(server.url, agent="bob", home=tmp_path / "bob", outbox=False) as bob,
    ):
        doomed = alice.event("finding", finding(text="the staging password is hunter2"), project=project)
        await alice.publish(doomed, wait_for=ReceiptLevel.published)
        wrong = alice.event("finding", finding(text="the cache is warm after every deploy"), project=project)
        await alice.publish(wrong, wait_for=ReceiptLevel.published)
        body = finding(text="the cache warms within a minute of a deploy") | {"supersedes": doomed.artifact_id}
        successor = alice.event("finding", body, project=project)
        await alice.publish(successor, wait_for=ReceiptLevel.published)
        await bob.transition(
            "contradicted",
            {"contradicted_by": doomed.artifact_id, "reason": "measured"},
            project=project,
            artifact_id=wrong.artifact_id,
        )
        names = {"contradicted": wrong.artifact_id, "successor": successor.artifact_id}
        # The state every path must show after the forget: the contradiction and the successor stay.
        assert labels((await load_project(alice.js, project)).fold.artifacts, names) == {
            "contradicted": "contradicted/active",
            "successor": "unverified/active",
        }
        await alice.forget(project, doomed.artifact_id, reason="a secret in a claim")
        return names


EXPECTED_AFTER_FORGET = {"contradicted": "contradicted/active", "successor": "unverified/active"}


async def test_a_rebuilt_projection_keeps_what_others_said_with_a_forgotten_artifact(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    """observers/projection.py rebuild() skips the forgotten claim's rows, so the contradiction that names it
    and the claim that supersedes it are rejected (B is shown by the safe door again, C disappears). rebuild()
    runs whenever an event arrives behind the cursor and on `verify --repair` of any gap."""
    async with mirrored_node(nats_server, tmp_path / "node", "node-a") as node:
        names = await _history_with_links_to_a_forgotten_artifact(nats_server, tmp_path, project)
        await caught_up(node)
        assert node.journal is not None
        assert labels(journal_states(node.journal, project), names) == EXPECTED_AFTER_FORGET  # live: right
        await asyncio.to_thread(node.journal.rebuild_projection)
        assert labels(journal_states(node.journal, project), names) == EXPECTED_AFTER_FORGET


async def test_replay_and_the_client_fold_keep_what_others_said_with_a_forgotten_artifact(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    """After the client's forget erased the claim from the stream, replay into a fresh journal and the client's
    fold (load_project) no longer have it: the contradiction by it and the supersession of it are rejected."""
    eraser = NodeConfig(home=tmp_path / "eraser", nats_url=nats_server.url, mirror="off", name="eraser")
    async with Node(eraser):  # the node that erases the forgotten claim's messages
        names = await _history_with_links_to_a_forgotten_artifact(nats_server, tmp_path, project)
    nc = await nats.connect(nats_server.url)
    fresh = Journal(f"sqlite:///{tmp_path / 'replayed.db'}")
    fresh.migrate()
    try:
        js = nc.jetstream()
        found = {"client fold": labels((await load_project(js, project)).fold.artifacts, names)}
        await replay(js, JournalObserver(fresh, name="replayed"))
        found["replayed journal"] = labels(journal_states(fresh, project), names)
        assert found == {"client fold": EXPECTED_AFTER_FORGET, "replayed journal": EXPECTED_AFTER_FORGET}
    finally:
        fresh.close()
        await nc.close()


async def test_reindex_after_a_forget_never_shows_a_contradicted_claim(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    """The safe door of a reindexed mirror (and of a second node catching up) shows the contradicted claim
    as unverified/active, and loses the successor."""
    async with mirrored_node(nats_server, tmp_path / "node", "node-a") as node:
        names = await _history_with_links_to_a_forgotten_artifact(nats_server, tmp_path, project)
        await caught_up(node)
        assert node.store is not None
        assert node.embedder is not None

        async def mirrored() -> dict[str, str]:
            assert node.store is not None
            points = await node.store.retrieve([point_id(uuid.UUID(i)) for i in names.values()])
            states = {p.payload["artifact_id"]: payload_state(p.payload) for p in points}
            return labels(states, names)

        assert await mirrored() == EXPECTED_AFTER_FORGET  # live: right
        await node.reindex_mirror()
        after = await mirrored()
        safe = await recall(node.store, node.embedder, "cache deploy warm", project, k=10)
        assert (after, names["contradicted"] in {h.artifact_id for h in safe.hits}) == (EXPECTED_AFTER_FORGET, False)


# -- 2. the runner hands a batch over with a hole in it ------------------------------------------------------


class RegistryWithOneHiccup(AgentRegistry):
    """The agent key registry, except that the first look-up of one agent times out (a KV leader election,
    a slow server): admission raises Unavailable for that one message, as it would in production."""

    def __init__(self, js: nats.js.JetStreamContext, agent: str) -> None:
        super().__init__(js)
        self.agent = agent
        self.hiccups = 0

    async def bind(self, actor: Actor) -> None:
        if actor.agent_id == self.agent and self.hiccups == 0:
            self.hiccups += 1
            raise Unavailable("nats", "agent key registry: TimeoutError (simulated)")
        await super().bind(actor)


async def drain(runner: ConsumerRunner, timeout_s: float = 30.0) -> None:
    """Step until the durable has nothing pending and nothing in flight (a nak'ed message comes back)."""

    async def settled() -> bool:
        await runner.step()
        info = await runner.js.consumer_info(STREAM, runner.observer.name)
        return bool(info.num_pending == 0 and info.num_ack_pending == 0)

    await eventually(settled, timeout_s=timeout_s, interval_s=0.1)


async def test_a_registry_hiccup_on_a_claim_must_not_lose_its_contradiction_in_the_mirror(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    """bus/intake/runner.py process(): the claim's admission is Unavailable, so it is nak'ed; the contradiction right
    behind it in the same batch is handed to the mirror first (illegal: the claim is absent, skipped) and acked.
    The claim then arrives and is indexed unverified/active: the safe door shows a contradicted claim, while
    the journal says contradicted."""
    async with (
        connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice,
        connect(nats_server.url, agent="bob", home=tmp_path / "bob", outbox=False) as bob,
    ):
        basis = alice.event("finding", finding(text="p99 is flat across deploys"), project=project)
        await alice.publish(basis, wait_for=ReceiptLevel.published)
        claim = bob.event("finding", finding(text="p99 doubles after every deploy"), project=project)
        await bob.publish(claim, wait_for=ReceiptLevel.published)
        await alice.transition(
            "contradicted",
            {"contradicted_by": basis.artifact_id, "reason": "measured"},
            project=project,
            artifact_id=claim.artifact_id,
        )
    nc = await nats.connect(nats_server.url)
    journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}")
    journal.migrate()
    embedder = HashEmbedder()
    store = await EdgeVectorStore.open(tmp_path / "mirror", embedder.model_id, embedder.dimension)
    try:
        await drain(ConsumerRunner(nc, JournalObserver(journal, name="j"), filter_subject=events_filter(project)))
        assert journal_states(journal, project)[claim.artifact_id].state_label == "contradicted/active"
        mirror = MirrorObserver(store, embedder, name="m", journal=journal)
        runner = ConsumerRunner(
            nc,
            mirror,
            filter_subject=events_filter(project),
            registry=RegistryWithOneHiccup(nc.jetstream(), "bob"),  # bob authored the claim
            redelivery_delays_s=(0.2,),
        )
        await drain(runner)
        (point,) = await store.retrieve([point_id(claim.event_id)])
        assert payload_state(point.payload).state_label == "contradicted/active"
    finally:
        await store.close()
        journal.close()
        await nc.close()


async def test_a_registry_hiccup_must_not_make_the_journal_keep_a_later_event_under_a_reused_id(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    """The first event in stream order under an id is the one every store keeps. With the first one nak'ed
    (registry Unavailable) and the reuse behind it handled, the live journal keeps the second one and
    dead-letters the first as duplicate_id_conflict; a replay keeps the first."""
    alice = AgentKey.load_or_create(tmp_path / "alice", "alice")
    mallory = AgentKey.load_or_create(tmp_path / "mallory", "mallory")  # a registered agent, raw client
    first = signed(alice, "finding", finding(text="alice's words under this id"), project)
    reuse = signed(
        mallory, "finding", finding(text="mallory's words under alice's id"), project, event_id=first.event_id
    )
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    live = Journal(f"sqlite:///{tmp_path / 'live.db'}")
    live.migrate()
    replayed = Journal(f"sqlite:///{tmp_path / 'replayed.db'}")
    replayed.migrate()
    try:
        await ensure_streams(js)
        registry = AgentRegistry(js)
        for key in (alice, mallory):
            await registry.bind(key.actor)
        await publish_raw(js, first)
        await publish_raw(js, reuse, dedupe=False)
        runner = ConsumerRunner(
            nc,
            JournalObserver(live, name="j"),
            filter_subject=events_filter(project),
            registry=RegistryWithOneHiccup(js, "alice"),
            redelivery_delays_s=(0.2,),
        )
        await drain(runner)
        await replay(js, JournalObserver(replayed, name="r"))
        texts = {
            name: [r.envelope["body"]["text"] for r in journal.query(EventQuery(project=project))]
            for name, journal in (("live", live), ("replayed", replayed))
        }
        assert texts == {"live": ["alice's words under this id"], "replayed": ["alice's words under this id"]}
    finally:
        live.close()
        replayed.close()
        await nc.close()


# -- 3. a message that stops a PostgreSQL journal ----------------------------------------------------------


async def test_a_nul_character_in_a_claim_does_not_stop_a_postgresql_journal(
    nats_server: NatsServer, tmp_path: Path, project: str, postgres_url: str
) -> None:
    """PostgreSQL text cannot hold NUL. Such an event, validly signed by a raw client, used to reach
    Journal.write, whose DataError was reported as Unavailable: the runner held the batch as an outage forever
    and every later event waited. The event model refuses NUL now, so every path dead-letters it."""
    key = AgentKey.load_or_create(tmp_path / "alice", "alice")
    template = signed(key, "finding", finding(text="a NUL in the middle"), project)
    raw = template.model_dump(mode="json", exclude={"signature"}) | {"schema_version": 1}  # legacy: signed inside
    raw["body"]["text"] = "a NUL \x00 in the middle"
    seed = (tmp_path / "alice" / "keys" / "alice.nk").read_bytes().strip()
    signature = base64.urlsafe_b64encode(nkeys.from_seed(seed).sign(canonical_json(raw))).rstrip(b"=").decode()
    poison_bytes = canonical_json(raw | {"signature": signature})
    poison = template
    after = signed(key, "finding", finding(text="an ordinary finding published after it"), project)
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    journal = Journal(postgres_url)
    journal.migrate()
    await ensure_streams(js)
    await AgentRegistry(js).bind(key.actor)
    await js.publish(event_subject(project, "finding", poison.artifact_id), poison_bytes)
    await publish_raw(js, after)
    runner = ConsumerRunner(
        nc, JournalObserver(journal, name=f"pg-{project}"), filter_subject=events_filter(project), batch_size=1
    )
    task = asyncio.create_task(runner.run())
    try:

        def journaled() -> bool:
            return str(after.event_id) in journal.has([str(after.event_id)])

        try:
            await eventually(journaled, timeout_s=20)
        except AssertionError:
            pytest.fail(
                f"the journal is stuck: degraded={runner.stats.degraded} outage_retries={runner.stats.outage_retries}"
                f" last_error={(runner.stats.last_error or '')[:160]!r}"
            )
        dead = await dlq_reasons(js)
        assert ("invalid_event", event_subject(project, "finding", poison.artifact_id)) in dead
    finally:
        await stop_all([task])
        journal.close()
        await nc.close()
