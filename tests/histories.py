"""Random histories of a project, for the differential tests: claims of every kind by several agents, the
changes made to them, enrolment changes between them (roles, projects, a shared owner, revocation, recorded on
the stream as a node records them), and hostile messages mixed in (forged keys, broken signatures, wrong
subjects, impossible times, reused event ids, exact resends). A history is drawn as plain operations and built
into signed messages by `build`, so hypothesis can shrink it."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import nats
import nats.js.errors
import nkeys
from hypothesis import strategies as st
from nats.js import JetStreamContext

from bus.broker.streams import ensure_streams
from bus.client.project_view import load_project
from bus.enrolment.registry import AgentRegistry
from bus.identity.signing import AgentKey, node_event_key, wire_message
from bus.model.auth import Enrolment, ReviewPolicy
from bus.model.authority import enrolment_event, policy_event
from bus.model.erasure import erased_events, erased_history
from bus.model.event import Envelope, draft_event
from bus.model.state import REFUSED, ArtifactState, decide
from bus.model.vocab import ResolutionKind, ReviewMode, Role
from bus.subjects import ENROLMENT_KIND, POLICY_PROJECT, REVIEW_POLICY_KIND, STREAM, event_subject
from tests.support import identity_for

AGENTS = ("alice", "bob", "carol")
CLAIM_KINDS = ("finding", "unknown", "assumption", "decision", "mistake", "dead_end")
TEXTS = ("the cache is cold", "p99 doubled", "the index is stale", "retries hide the bug", "disk fills at night")
RESOLUTIONS = tuple(ResolutionKind)
ROLE_SETS = ((Role.agent,), (Role.agent, Role.admin), (Role.reviewer,), (Role.admin,), (Role.coordinator,))
SCOPES = ("every project", "this project", "another project")
POLICY_IMPACTS = (None, 0.0, 0.5, 0.9)

# (operation, *small integers); targets index the artifacts made so far, modulo their number.
Op = tuple[Any, ...]

TARGETS = range(51)
AGENT = range(len(AGENTS))
# The grammar of a history, once: each operation's name and the values each of its arguments may take.
GRAMMAR: tuple[tuple[str, tuple[Sequence[Any], ...]], ...] = (
    ("claim", (range(len(CLAIM_KINDS)), AGENT, range(len(TEXTS)), ("none", "none", "revises", "supersedes"), TARGETS)),
    ("verify", (AGENT, TARGETS)),
    ("contradict", (AGENT, TARGETS, TARGETS)),
    ("rollback", (AGENT, TARGETS)),
    ("resolve", (AGENT, TARGETS, range(len(RESOLUTIONS)), TARGETS)),
    ("forget", (AGENT, TARGETS)),
    ("claim_on_existing_id", (AGENT, TARGETS)),
    ("forged", (AGENT,)),
    ("bad_signature", (AGENT,)),
    ("wrong_subject", (AGENT,)),
    ("bad_time", ((1900, 2999, 1, 9999),)),
    ("reuse_id", (AGENT, TARGETS)),
    ("resend", (TARGETS,)),
    # agent, its roles, its projects, one owner shared with the other agents drawn so (else its own), revoked
    ("enrol", (AGENT, range(len(ROLE_SETS)), range(len(SCOPES)), (False, True), (False, False, False, True))),
    ("share_owner", (AGENT, AGENT)),  # two agents become identities of one owner: neither verifies the other
    # the project's review policy, as a node records it: which impact needs a person, rank or withhold
    ("policy", (range(len(POLICY_IMPACTS)), tuple(ReviewMode))),
)
ops = st.one_of(
    *(st.tuples(st.just(name), *(st.sampled_from(list(values)) for values in args)) for name, args in GRAMMAR)
)


def random_history(rng: random.Random, max_size: int = 30) -> list[Op]:
    """A history drawn without hypothesis (benchmarks), from the same grammar."""
    return [
        (name, *(rng.choice(list(values)) for values in args))
        for name, args in (rng.choice(GRAMMAR) for _ in range(rng.randint(1, max_size)))
    ]


histories = st.lists(ops, min_size=1, max_size=30)


@dataclass(frozen=True)
class Message:
    subject: str
    data: bytes
    deduplicate: bool  # sent with Nats-Msg-Id (as epibus clients do); hostile resends are sent without it
    forget: tuple[AgentKey, str] | None = None  # made when published, as the client's forget does
    headers: dict[str, str] | None = None  # the event's signature headers (none for a legacy event)


@dataclass
class Keys:
    agents: dict[str, AgentKey]  # by role in the history (alice, bob, carol); their agent ids are unique per Keys
    mallory_seed: bytes  # signs as other agents: admission must refuse it (their keys are registered)
    node: AgentKey  # a node's identity: signs the history's enrolment records

    @property
    def suffix(self) -> str:
        return self.agents[AGENTS[0]].agent_id.rsplit("-", 1)[1]


async def register_keys(url: str, keys: Keys) -> None:
    """Bind the genuine agents' keys first, as their first events would: a forged key must never bind."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        registry = AgentRegistry(js)
        for key in [*keys.agents.values(), keys.node]:
            await registry.bind(key.actor)
    finally:
        await nc.close()


def make_keys() -> Keys:
    """Agents of their own (`alice-<hex>`…): enrolment records are fleet-wide, so a history's grants and
    revocations must not reach the agents of another history on the same server."""
    suffix = uuid.uuid4().hex[:8]
    return Keys(
        {a: AgentKey.generate(f"{a}-{suffix}") for a in AGENTS},
        nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER),
        node_event_key(AgentKey.generate("node")),
    )


def _claim_body(kind: str, text: str, link: str, target: str | None) -> dict[str, Any]:
    if kind == "finding":
        body: dict[str, Any] = {"text": text, "impact": 0.5, "confidence": 0.6, "subject": "tests"}
        if target is not None and link != "none":
            body[link] = target
        return body
    if kind == "unknown":
        return {"question": text, "impact": 0.0}
    if kind == "assumption":
        return {"text": text, "confidence": 0.9}
    if kind == "decision":
        return {"choice": text, "rationale": "because", "confidence": 0.5, "reversibility": "exploratory"}
    if kind == "mistake":
        return {"mistake": text, "why_wrong": "w", "cost_estimate": "1h", "root_cause": "r", "prevention": "p"}
    return {"approach": text, "why_failed": "it did not"}


class _Builder:
    def __init__(self, keys: Keys, project: str) -> None:
        self.keys = keys
        self.project = project
        self.artifacts: list[str] = []
        self.sent: list[Envelope] = []
        self.messages: list[Message] = []

    def target(self, index: int) -> str:
        return self.artifacts[index % len(self.artifacts)] if self.artifacts else f"absent-{index}"

    def event(self, agent: str, kind: str, body: dict[str, Any], **fields: Any) -> Envelope:
        key = self.keys.agents[agent]
        return key.sign(draft_event(kind, body, project=self.project, actor=key.actor, session_id="s", **fields))

    def send(self, event: Envelope, *, deduplicate: bool = True, subject: str | None = None) -> None:
        subject = subject or event_subject(event.project, event.kind, event.artifact_id)
        wire = wire_message(event)
        self.messages.append(Message(subject, wire.data, deduplicate, headers=dict(wire.headers)))
        self.sent.append(event)

    def apply(self, op: Op) -> None:
        name, *args = op
        getattr(self, f"_{name}")(*args)

    def _claim(self, kind_i: int, agent_i: int, text_i: int, link: str, target_i: int) -> None:
        kind = CLAIM_KINDS[kind_i]
        target = self.target(target_i) if self.artifacts else None
        event = self.event(AGENTS[agent_i], kind, _claim_body(kind, TEXTS[text_i], link, target))
        self.artifacts.append(event.artifact_id)
        self.send(event)

    def _verify(self, agent_i: int, target_i: int) -> None:
        self.send(self.event(AGENTS[agent_i], "verified", {"note": "checked"}, artifact_id=self.target(target_i)))

    def _contradict(self, agent_i: int, target_i: int, by_i: int) -> None:
        body = {"contradicted_by": self.target(by_i), "reason": "measured"}
        self.send(self.event(AGENTS[agent_i], "contradicted", body, artifact_id=self.target(target_i)))

    def _rollback(self, agent_i: int, target_i: int) -> None:
        self.send(self.event(AGENTS[agent_i], "rolled_back", {"reason": "bad"}, artifact_id=self.target(target_i)))

    def _resolve(self, agent_i: int, target_i: int, resolution_i: int, successor_i: int) -> None:
        resolution = RESOLUTIONS[resolution_i]
        body: dict[str, Any] = {"resolution": resolution.value}
        if resolution is ResolutionKind.superseded:
            body["superseded_by"] = self.target(successor_i)
        self.send(self.event(AGENTS[agent_i], "resolved", body, artifact_id=self.target(target_i)))

    def _forget(self, agent_i: int, target_i: int) -> None:
        target = self.target(target_i)
        subject = event_subject(self.project, "forgotten", target)
        self.messages.append(Message(subject, b"", True, forget=(self.keys.agents[AGENTS[agent_i]], target)))

    def _claim_on_existing_id(self, agent_i: int, target_i: int) -> None:
        body = _claim_body("finding", "a claim on an id in use", "none", None)
        self.send(self.event(AGENTS[agent_i], "finding", body, artifact_id=self.target(target_i)))

    def _forged(self, agent_i: int) -> None:
        impostor = AgentKey(self.keys.agents[AGENTS[agent_i]].agent_id, self.keys.mallory_seed)
        body = _claim_body("finding", "forged", "none", None)
        self.send(
            impostor.sign(draft_event("finding", body, project=self.project, actor=impostor.actor, session_id="s"))
        )

    def _bad_signature(self, agent_i: int) -> None:
        event = self.event(AGENTS[agent_i], "finding", _claim_body("finding", "signed", "none", None))
        tampered = event.model_copy(update={"body": event.body.model_copy(update={"text": "tampered"})})
        self.send(tampered)

    def _wrong_subject(self, agent_i: int) -> None:
        event = self.event(AGENTS[agent_i], "finding", _claim_body("finding", "misfiled", "none", None))
        self.send(event, subject=event_subject(self.project, "unknown", event.artifact_id))

    def _bad_time(self, year: int) -> None:
        at = datetime(year, 6, 1, tzinfo=UTC)
        self.send(self.event("alice", "finding", _claim_body("finding", f"dated {year}", "none", None), recorded_at=at))

    def _reuse_id(self, agent_i: int, earlier_i: int) -> None:
        # An id of this project's: a reader of one project (the fold, a project's journal) never sees the
        # enrolment records' ids, so which event an id holds across projects is not one truth these paths share.
        sent = [e for e in self.sent if e.project == self.project]
        if not sent:
            return
        earlier = sent[earlier_i % len(sent)]
        body = _claim_body("finding", f"reusing {earlier.event_id}", "none", None)
        event = self.event(AGENTS[agent_i], "finding", body, event_id=earlier.event_id)
        self.send(event, deduplicate=False)  # a raw client: JetStream deduplicates only inside its window

    def _enrol(self, agent_i: int, roles_i: int, scope_i: int, shared: bool, revoked: bool) -> None:
        key = self.keys.agents[AGENTS[agent_i]]
        projects = (("*",), (self.project,), (f"elsewhere-{self.keys.suffix}",))[scope_i]
        at = datetime.now(UTC)
        enrolment = Enrolment(
            agent_id=key.agent_id,
            public_key=key.public_key,
            owner=f"team-{self.keys.suffix}" if shared else key.agent_id,
            roles=ROLE_SETS[roles_i],
            projects=projects,
            enrolled_by="histories",
            enrolled_at=at,
            revoked_at=at if revoked else None,
            identity=identity_for(list(ROLE_SETS[roles_i])),
        )
        event = enrolment_event(self.keys.node, enrolment, session_id="s")
        self.send(event, subject=event_subject(POLICY_PROJECT, ENROLMENT_KIND, key.agent_id))

    def _policy(self, impact_i: int, mode: ReviewMode) -> None:
        policy = ReviewPolicy(
            project=self.project,
            human_review_impact=POLICY_IMPACTS[impact_i],
            mode=mode,
            set_by="histories",
            set_at=datetime.now(UTC),
        )
        event = policy_event(self.keys.node, policy, session_id="s")
        self.send(event, subject=event_subject(POLICY_PROJECT, REVIEW_POLICY_KIND, self.project))

    def _share_owner(self, first_i: int, second_i: int) -> None:
        for agent_i in (first_i, second_i):
            self._enrol(agent_i, 0, 0, True, False)

    def _resend(self, earlier_i: int) -> None:
        sent = [m for m in self.messages if m.forget is None]
        if sent:
            earlier = sent[earlier_i % len(sent)]
            self.messages.append(Message(earlier.subject, earlier.data, False, headers=earlier.headers))


def build(history: Iterable[Op], keys: Keys, project: str) -> list[Message]:
    builder = _Builder(keys, project)
    for op in history:
        builder.apply(op)
    return builder.messages


async def publish(
    js: JetStreamContext,
    messages: Sequence[Message],
    *,
    before_forget: Callable[[], Awaitable[None]] | None = None,
) -> tuple[int, int]:
    """Publish in order; returns the first and last stream sequence used (JetStream may drop duplicates).
    A forget is done as the client does it: the artifact's history from the fold, the `forgotten` event, then
    every message on the artifact's subjects erased. `before_forget` runs first (e.g. let live nodes catch up)."""
    seqs: list[int] = []
    for message in messages:
        if message.forget is not None:
            if before_forget is not None:
                await before_forget()
            seqs.append(await forget(js, *message.forget, project=message.subject.split(".")[1]))
            continue
        headers = dict(message.headers or {})
        if message.deduplicate:
            headers["Nats-Msg-Id"] = json.loads(message.data)["event_id"]
        ack = await js.publish(message.subject, message.data, headers=headers or None)
        if not ack.duplicate:
            seqs.append(ack.seq)
    return (min(seqs), max(seqs)) if seqs else (0, 0)


async def forget(js: JetStreamContext, key: AgentKey, artifact_id: str, *, project: str) -> int:
    """The `forgotten` event, then, if the client would have sent it (the rules allow it), the erase. A forget
    the client refuses is published anyway, as a raw agent could: every path rejects it, nothing is erased."""
    view = await load_project(js, project)
    earlier = view.erased.get((project, artifact_id), ())
    history = [h.model_dump(mode="json") for h in erased_history(view.fold.history.get(artifact_id, []), earlier)]
    messages = view.messages.get(artifact_id, [])
    erased = erased_events(view.fold.digests, messages, earlier) if artifact_id in view.fold.artifacts else ()
    body = {"reason": "privacy", "history": history, "events": [e.model_dump(mode="json") for e in erased]}
    event = key.sign(
        draft_event("forgotten", body, project=project, actor=key.actor, session_id="s", artifact_id=artifact_id)
    )
    wire = wire_message(event)
    ack = await js.publish(wire.subject, wire.data, headers=dict(wire.headers))
    try:
        decide(event, view.next_seq, view.fold.artifacts.get, view.fold.tombstones.__contains__, view.authority)
    except REFUSED:
        return int(ack.seq)  # what the client refuses, it never erases
    if artifact_id in view.fold.artifacts:  # the client forgets only what exists, and erases all of it
        for seq, _ in view.messages.get(artifact_id, []):
            try:
                await js.delete_msg(STREAM, seq)
            except nats.js.errors.NotFoundError:
                continue
    return int(ack.seq)


StateKey = tuple[object, ...]


def state_key(s: ArtifactState) -> StateKey:
    """What every path must agree on for an artifact: identity, who vouched, trust, lifecycle, resolution and
    links."""
    resolution = s.resolution.value if s.resolution else None
    return (
        s.kind,
        s.author,
        s.created_event_id,
        s.verified_by,
        s.reviewed_by,
        s.reviewed_at,
        s.trust.value,
        s.lifecycle.value,
        resolution,
        s.revises,
        s.supersedes,
        s.superseded_by,
        s.contradicted_by,
    )


def differences(paths: Mapping[str, Mapping[str, ArtifactState]]) -> dict[str, Any]:
    """Per path, the artifacts that differ from the first path's (missing, extra, or another state)."""
    (reference_name, reference), *others = paths.items()
    want = {aid: state_key(s) for aid, s in reference.items()}
    found: dict[str, Any] = {}
    for name, states in others:
        got = {aid: state_key(s) for aid, s in states.items()}
        diff = {
            "missing": sorted(set(want) - set(got)),
            "extra": sorted(set(got) - set(want)),
            "differ": {a: {reference_name: want[a], name: got[a]} for a in set(want) & set(got) if want[a] != got[a]},
        }
        if any(diff.values()):
            found[name] = diff
    return found


class HashEmbedder:
    """Deterministic unit vectors from a text's hash: the differential tests are about state, not meaning,
    and a real model would spend their time budget embedding the same five texts."""

    model_id = "test/sha256-384"
    dimension = 384

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        vectors = []
        for text in texts:
            seed = hashlib.sha256(text.encode()).digest()
            raw = [((seed[i % 32] + i) % 17) - 8.0 + 0.5 for i in range(self.dimension)]
            norm = math.sqrt(sum(v * v for v in raw))
            vectors.append([v / norm for v in raw])
        return vectors


def fresh_project() -> str:
    return f"d-{uuid.uuid4().hex[:12]}"
