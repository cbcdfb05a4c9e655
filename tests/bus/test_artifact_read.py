"""A state change reads the artifacts it names from their own subjects (`load_artifact`), not the whole project
(`load_project`): both must decide alike. Random histories (hostile messages, forgets, enrolment changes
included) are published, then a verify, contradict, rollback or forget of each artifact is decided from
both reads; and compare-and-set on the artifact's subjects still refuses a change that lost a race."""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import nkeys
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.js import JetStreamContext

from bus.client.client import connect
from bus.client.project_view import ProjectView, load_artifact, load_project
from bus.enrolment.registry import AgentRegistry
from bus.errors import Conflict, Forbidden, IllegalTransition, NotFound
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey, wire_message
from bus.model.event import Envelope, draft_event
from bus.model.state import ArtifactState, Change, decide
from bus.subjects import event_subject
from tests.conftest import finding
from tests.histories import AGENTS, Keys, Op, build, fresh_project, histories, make_keys, publish, register_keys

QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
KINDS = ("verified", "contradicted", "rolled_back", "forgotten", "resolved")


def vouched(state: ArtifactState | None) -> tuple[Any, ...] | None:
    """What the direct read answers for exactly: existence, identity, author, trust and contradiction."""
    if state is None:
        return None
    return (state.project, state.kind, state.author, state.created_event_id, state.trust, state.contradicted_by)


def outcome(view: ProjectView, event: Envelope) -> tuple[Any, ...]:
    """What deciding `event` against `view` says, without the artifacts' lifecycles (a claim elsewhere that
    supersedes an artifact changes its lifecycle, and no verify, contradict, rollback or forget reads it)."""
    fold = view.fold
    try:
        change: Change = decide(event, view.next_seq, fold.artifacts.get, fold.tombstones.__contains__, view.authority)
    except IllegalTransition as e:
        return ("illegal", e.artifact_id, e.requested, e.reason)
    except Forbidden as e:
        return ("forbidden", str(e))
    human = change.verification.human_review if change.verification else None
    return ("applied", tuple(vouched(s) for s in change.artifacts), human, change.tombstone is not None)


def transition(keys: Keys, agent: str, kind: str, project: str, artifact_id: str, other: str) -> Envelope:
    body: dict[str, Any] = {
        "verified": {"note": "checked"},
        "contradicted": {"contradicted_by": other, "reason": "measured"},
        "rolled_back": {"reason": "bad"},
        "forgotten": {"reason": "privacy"},
        "resolved": {"resolution": "stale"},
    }[kind]
    key = keys.agents[agent]
    draft = draft_event(kind, body, project=project, actor=key.actor, session_id="s", artifact_id=artifact_id)
    return key.sign(draft)


def reused_elsewhere(view: ProjectView) -> set[str]:
    """Artifacts one of whose admitted events carries an event id another artifact's subject holds: an id
    reused across subjects, which only the whole project's fold sees (the stores refuse the reuse)."""
    holders: dict[str, set[str]] = {}
    for artifact_id, messages in view.messages.items():
        for _, event_id in messages:
            if event_id is not None:
                holders.setdefault(event_id, set()).add(artifact_id)
    return {a for artifacts in holders.values() if len(artifacts) > 1 for a in artifacts}


@dataclass
class Tally:
    direct: int = 0
    whole_project: int = 0


async def compare(url: str, history: list[Op], seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    project, keys = fresh_project(), make_keys()
    await register_keys(url, keys)
    nc = await nats.connect(url)
    try:
        js: JetStreamContext = nc.jetstream()
        await publish(js, build(history, keys, project))
        registry = AgentRegistry(js)
        full = await load_project(js, project, registry)
        skipped = reused_elsewhere(full)
        named = sorted(set(full.messages) | set(full.fold.artifacts) | {"absent-0"})
        for artifact_id in named:
            if artifact_id in skipped:
                continue
            kind = rng.choice(KINDS)
            other = rng.choice(named)
            if kind == "contradicted" and other in skipped:
                continue  # the contradicting claim's id is reused elsewhere: only the whole project sees it
            event = transition(keys, rng.choice(AGENTS), kind, project, artifact_id, other)
            read = await load_artifact(js, event, registry)
            if read.view is None:
                tally.whole_project += 1
                assert read.whole_project is not None
                # only a decision that reads a lifecycle: a resolution, or a claim superseding another
                assert kind == "resolved" or "superseding" in read.whole_project, read.whole_project
                continue
            tally.direct += 1
            direct = read.view
            for aid in direct.messages:  # every artifact the direct read folded
                if aid not in skipped:
                    assert vouched(direct.fold.artifacts.get(aid)) == vouched(full.fold.artifacts.get(aid)), aid
            assert direct.subject_seq.get(artifact_id, 0) == full.subject_seq.get(artifact_id, 0)
            assert outcome(direct, event) == outcome(full, event), (kind, artifact_id)
    finally:
        await nc.close()


def test_the_direct_read_decides_as_the_whole_project_fold(shared_nats_server: NatsServer) -> None:
    tally = Tally()

    @settings(max_examples=40, deadline=None, suppress_health_check=QUIET)
    @given(history=histories, seed=st.integers(0, 2**32 - 1))
    def check(history: list[Op], seed: int) -> None:
        asyncio.run(compare(shared_nats_server.url, history, seed, tally))

    check()
    # Both reads were exercised: decisions from the direct read, and falls back to the project's fold.
    assert tally.direct > 0, tally
    assert tally.whole_project > 0, tally


def wire_parts(event: Envelope) -> tuple[str, bytes, dict[str, str]]:
    wire = wire_message(event)
    return wire.subject, wire.data, dict(wire.headers)


def hostile_on(
    project: str, artifact_id: str, bob: AgentKey, mallory: AgentKey
) -> list[tuple[str, bytes, dict[str, str]]]:
    """Messages on the artifact's own subjects that every path refuses: a forged key, a tampered signature, a
    time the stream cannot have, and a verification filed under the wrong kind."""
    out = []
    forged = mallory.sign(
        draft_event(
            "verified", {"note": "f"}, project=project, actor=mallory.actor, session_id="s", artifact_id=artifact_id
        )
    )
    signed = bob.sign(
        draft_event(
            "verified", {"note": "ok"}, project=project, actor=bob.actor, session_id="s", artifact_id=artifact_id
        )
    )
    tampered = signed.model_copy(update={"body": signed.body.model_copy(update={"note": "tampered"})})
    late = bob.sign(
        draft_event(
            "contradicted",
            {"contradicted_by": artifact_id + "x", "reason": "r"},
            project=project,
            actor=bob.actor,
            session_id="s",
            artifact_id=artifact_id,
            recorded_at=datetime(2999, 1, 1, tzinfo=UTC),
        )
    )
    for event, subject in (
        (forged, None),
        (tampered, None),
        (late, None),
        (signed, event_subject(project, "rolled_back", artifact_id)),
    ):
        wire = wire_message(event)
        out.append((subject or wire.subject, wire.data, dict(wire.headers)))
    return out


async def test_hostile_messages_a_retraction_and_a_lost_race(nats_server: NatsServer, home: Path, project: str) -> None:
    async with (
        connect(nats_server.url, agent="alice", home=home, outbox=False) as author,
        connect(nats_server.url, agent="bob", home=home, outbox=False) as verifier,
    ):
        mallory = AgentKey(verifier.key.agent_id, nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
        claim = author.event("finding", finding(text="the cache is cold"), project=project)
        await author.publish(claim)
        aid = claim.artifact_id
        for subject, data, headers in hostile_on(project, aid, verifier.key, mallory):
            await author.js.publish(subject, data, headers=headers)
        await author.transition("resolved", {"resolution": "retracted"}, project=project, artifact_id=aid)
        # The whole project's fold and the direct read agree on the artifact, hostile messages and all.
        verify = verifier.event("verified", {"note": "checked"}, project=project, artifact_id=aid)
        read = await load_artifact(verifier.js, verify)
        full = await load_project(verifier.js, project)
        assert read.view is not None
        assert read.view.invalid == 4 == full.invalid
        assert read.view.fold.artifacts[aid] == full.fold.artifacts[aid]
        assert read.view.subject_seq[aid] == full.subject_seq[aid]
        # A resolution reads the lifecycle: the whole project decides it.
        resolve = author.event("resolved", {"resolution": "stale"}, project=project, artifact_id=aid)
        assert (await load_artifact(author.js, resolve)).view is None
        with pytest.raises(IllegalTransition, match="already resolved"):
            await author.transition("resolved", {"resolution": "stale"}, project=project, artifact_id=aid)
        # So does a change to a claim that superseded another (its existence reads the other's lifecycle).
        successor = author.event("finding", {**finding(text="warm"), "supersedes": aid}, project=project)
        verify_successor = verifier.event("verified", {"note": "n"}, project=project, artifact_id=successor.artifact_id)
        with pytest.raises(IllegalTransition, match="already resolved"):
            await author.publish(successor)  # refused before publishing: the retracted claim is resolved
        subject, data, headers = wire_parts(successor)
        await author.js.publish(subject, data, headers=headers)  # as a raw client could: every path refuses it
        whole = (await load_artifact(verifier.js, verify_successor)).whole_project
        assert whole is not None
        assert "superseding" in whole
        with pytest.raises(NotFound, match="no artifact with this id"):
            await verifier.transition("verified", {"note": "n"}, project=project, artifact_id=successor.artifact_id)
        # The verifier decides from the direct read, then loses the race to a contradiction: JetStream refuses.
        stale = await verifier.change_view(verify)
        other = author.event("finding", finding(text="the cache is warm"), project=project)
        await author.publish(other)
        await author.transition(
            "contradicted", {"contradicted_by": other.artifact_id, "reason": "r"}, project=project, artifact_id=aid
        )
        with pytest.raises(Conflict):
            await verifier.transition("verified", {"note": "late"}, project=project, artifact_id=aid, view=stale)
        # Read again, the verification is illegal (contradicted only rolls back), and nothing was written.
        with pytest.raises(IllegalTransition, match="contradicted"):
            await verifier.transition("verified", {"note": "late"}, project=project, artifact_id=aid)
        after = await load_project(verifier.js, project)
        assert after.fold.artifacts[aid].trust.value == "contradicted"
        assert [v for v in after.fold.verifications if v.artifact_id == aid] == []
