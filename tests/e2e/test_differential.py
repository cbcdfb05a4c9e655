"""One truth in every store: random histories go through every path that builds state, and every path must
end with the same artifacts in the same state and the same admitted events.

Forgets are done as the client does them: the `forgotten` event, then every message of the artifact erased
from the stream; the live runners are caught up before some forgets and overtaken by others. Enrolment changes
(roles, projects, a shared owner, revocation) are recorded on the stream between the events, as a node records
them, so every path must also decide who may do what alike: the journal runners read only the project's
subjects and learn the records from the stream, a rebuilt projection from what its journal kept.

The paths: the client's fold (`load_project`); the live runner into a SQLite journal and into an edge mirror,
each with random batch sizes, the mirror restarted part-way; `replay` into a PostgreSQL journal and into a fresh
mirror (what `reindex` does); `verify --repair` into an empty journal, and that journal's projection rebuilt.
`test_nodes_agree_after_live_catch_up_and_reindex` adds whole nodes: one live, one catching up, one reindexed.

Each example runs in its own event loop against one nats-server per module, in a project of its own. Set
EPIBUS_DIFFERENTIAL_EXAMPLES to change how many examples run in the suite; `pytest -m long` runs 2,000."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.js.errors
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.js import JetStreamContext
from sqlalchemy import select

from bus.client.project_view import load_project
from bus.host.server import NatsServer
from bus.intake.reader import replay
from bus.intake.runner import ConsumerRunner
from bus.model.review import review_status
from bus.model.state import ArtifactState
from bus.subjects import STREAM, events_filter
from observers.journal import Journal, JournalObserver
from observers.mirror.edge import EdgeVectorStore
from observers.mirror.observer import MirrorObserver, payload_state
from observers.mirror.store import Filter, VectorStore
from observers.projection import row_to_state
from observers.reads import review_policy
from observers.schema import artifacts, events
from observers.verify import verify
from tests.conftest import postgres_database
from tests.histories import (
    HashEmbedder,
    Op,
    build,
    differences,
    fresh_project,
    histories,
    make_keys,
    publish,
    register_keys,
)

EXAMPLES = int(os.environ.get("EPIBUS_DIFFERENTIAL_EXAMPLES", "36"))  # the suite's 12 minutes; `-m long` runs 2,000
LONG_EXAMPLES = 2_000
QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]


@dataclass
class Bus:
    server: NatsServer
    root: Path
    postgres_url: str


@pytest.fixture(scope="module")
def bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bus]:
    with postgres_database() as postgres_url:
        yield from _bus(tmp_path_factory, postgres_url)


def _bus(tmp_path_factory: pytest.TempPathFactory, postgres_url: str) -> Iterator[Bus]:
    root = tmp_path_factory.mktemp("differential")
    server = NatsServer(root / "nats")
    server.start()
    try:
        yield Bus(server, root, postgres_url)
    finally:
        server.stop()


async def journal_states(journal: Journal, project: str) -> dict[str, ArtifactState]:
    def read() -> dict[str, ArtifactState]:
        with journal.engine.connect() as conn:
            rows = conn.execute(select(artifacts).where(artifacts.c.project == project))
            return {r.artifact_id: row_to_state(r._mapping) for r in rows}

    return await asyncio.to_thread(read)


def journal_events(journal: Journal, project: str) -> dict[str, str]:
    """event id → what the projection made of it (applied, rejected, forgotten)."""
    with journal.engine.connect() as conn:
        rows = conn.execute(select(events.c.event_id, events.c.status).where(events.c.project == project))
        return {row.event_id: row.status for row in rows}


async def mirror_states(store: VectorStore, project: str) -> dict[str, ArtifactState]:
    points = await store.retrieve(await store.point_ids(Filter(equals={"project": project})))
    states = [payload_state(p.payload) for p in points]
    assert len({s.artifact_id for s in states}) == len(states), "two points for one artifact"
    return {s.artifact_id: s for s in states}


async def drain(runner: ConsumerRunner, *, steps: int | None = None) -> None:
    """Step the runner until its consumer has nothing left (or for `steps` fetches)."""
    done = 0
    while steps is None or done < steps:
        fetched = await runner.step()
        done += 1
        if fetched == 0:
            info = await runner.js.consumer_info(STREAM, runner.observer.name)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                return


def open_journal(url: str) -> Journal:
    journal = Journal(url)
    journal.migrate()
    return journal


async def run_paths(bus: Bus, history: list[Op], seed: int, workdir: Path) -> None:
    rng = random.Random(seed)
    project = fresh_project()
    keys = make_keys()  # agents of this example's own: its enrolment records reach no other example
    await register_keys(bus.server.url, keys)
    nc = await nats.connect(bus.server.url)
    js: JetStreamContext = nc.jetstream()
    journals: list[Journal] = []
    stores: list[EdgeVectorStore] = []
    embedder = HashEmbedder()
    try:
        live_journal = open_journal(f"sqlite:///{workdir / 'live.db'}")
        journals.append(live_journal)
        journal_runner = ConsumerRunner(
            nc,
            JournalObserver(live_journal, name=f"j-{project}"),
            filter_subject=events_filter(project),
            batch_size=rng.randint(1, 40),
            fetch_timeout_s=0.05,
        )
        store = await EdgeVectorStore.open(workdir / "mirror-live", embedder.model_id, embedder.dimension)
        stores.append(store)
        batch = rng.randint(1, 40)

        def mirror_runner(on: VectorStore) -> ConsumerRunner:
            observer = MirrorObserver(on, embedder, name=f"m-{project}", journal=live_journal)
            return ConsumerRunner(
                nc, observer, filter_subject=events_filter(project), batch_size=batch, fetch_timeout_s=0.05
            )

        live_mirror = mirror_runner(store)

        async def live_nodes_catch_up() -> None:
            if rng.random() < 0.5:  # else the forget's erase overtakes them, as it may a node that lags
                await drain(journal_runner)
                await drain(live_mirror)

        # A closing claim: runners confined to the project's subjects learn the records made after its last
        # event (a review policy) with its next one; a node's journal reads every subject and learns them at once.
        closed = [*history, ("claim", 0, 0, 0, "none", 0)]
        first_seq, _ = await publish(js, build(closed, keys, project), before_forget=live_nodes_catch_up)
        start = max(first_seq, 1)
        fold = (await load_project(js, project)).fold

        await drain(journal_runner)
        await drain(live_mirror, steps=rng.randint(1, 3))
        await store.close()  # a restart part-way: the consumer resumes where the acks left it
        store = await EdgeVectorStore.open(workdir / "mirror-live", embedder.model_id, embedder.dimension)
        stores.append(store)
        await drain(mirror_runner(store))

        pg_journal = open_journal(bus.postgres_url)
        journals.append(pg_journal)
        await replay(js, JournalObserver(pg_journal, name="replayed"), start_seq=start, batch_size=rng.randint(1, 40))

        rebuilt = await EdgeVectorStore.open(workdir / "mirror-rebuilt", embedder.model_id, embedder.dimension)
        stores.append(rebuilt)
        rebuilder = MirrorObserver(rebuilt, embedder, name="rebuilt", journal=pg_journal)
        await replay(js, rebuilder, start_seq=start, batch_size=rng.randint(1, 40))

        repaired = open_journal(f"sqlite:///{workdir / 'repaired.db'}")
        journals.append(repaired)
        await verify(js, repaired, None, project=project, repair=True)
        repaired_states = await journal_states(repaired, project)
        await asyncio.to_thread(repaired.rebuild_projection)

        paths: dict[str, dict[str, ArtifactState]] = {
            "fold": dict(fold.artifacts),
            "journal live (sqlite)": await journal_states(live_journal, project),
            "journal replayed (postgresql)": await journal_states(pg_journal, project),
            "journal repaired": repaired_states,
            "journal rebuilt": await journal_states(repaired, project),
            "mirror live, restarted": await mirror_states(store, project),
            "mirror rebuilt": await mirror_states(rebuilt, project),
        }
        assert differences(paths) == {}, history
        # The project's review policy, as every journal recorded it and the client's fold read it, and what it
        # makes of each claim the safe door would show (awaiting a person, reviewed, or nothing asked).
        policy = (await load_project(js, project)).authority.policy(project)
        policies = {j.safe_url: await asyncio.to_thread(review_policy, j, project) for j in journals}
        assert set(policies.values()) == {policy}, policies
        reviews = {name: {aid: review_status(s, policy) for aid, s in states.items()} for name, states in paths.items()}
        assert all(found == reviews["fold"] for found in reviews.values()), reviews

        # The same events, each applied or rejected alike. A journal that saw an artifact's events before its
        # forget keeps a redacted audit row for each ("forgotten"); a path that read the stream after the
        # erase never saw them.
        statuses = [
            {e: status for e, status in journal_events(journal, project).items() if status != "forgotten"}
            for journal in journals
        ]
        for journal, found in zip(journals, statuses, strict=True):
            diff = {e: (statuses[0].get(e), found.get(e)) for e in set(found) | set(statuses[0])}
            assert found == statuses[0], (journal.safe_url, {e: d for e, d in diff.items() if d[0] != d[1]})
        assert set(statuses[0]) == set(fold.digests)
        assert {e for e, status in statuses[0].items() if status == "rejected"} == set(fold.rejected)
    finally:
        for name in (f"j-{project}", f"m-{project}"):
            with contextlib.suppress(nats.js.errors.NotFoundError):  # the example's durables: not needed again
                await js.delete_consumer(STREAM, name)
        for s in stores:
            await s.close()
        for journal in journals:
            journal.close()
        await nc.close()


# The suite's examples in three parts, each a class: xdist gives each class a worker of its own (loadscope), so
# the parts run side by side and none is the run's tail; each test draws its own examples (hypothesis seeds by the
# test's name).
@pytest.mark.slow  # ~50-60 s of one worker each: the quick loop keeps the one-example-per-path tests
class TestFirstPart:
    @pytest.mark.timeout(1800)
    @settings(max_examples=EXAMPLES // 3, deadline=None, suppress_health_check=QUIET)
    @given(history=histories, seed=st.integers(0, 2**32 - 1))
    def test_every_path_that_builds_state_gives_the_same_state(
        self, bus: Bus, tmp_path_factory: pytest.TempPathFactory, history: list[Op], seed: int
    ) -> None:
        asyncio.run(run_paths(bus, history, seed, tmp_path_factory.mktemp("example")))


@pytest.mark.slow
class TestSecondPart:
    @pytest.mark.timeout(1800)
    @settings(max_examples=EXAMPLES // 3, deadline=None, suppress_health_check=QUIET)
    @given(history=histories, seed=st.integers(0, 2**32 - 1))
    def test_every_path_builds_the_same_state_on_other_histories(
        self, bus: Bus, tmp_path_factory: pytest.TempPathFactory, history: list[Op], seed: int
    ) -> None:
        asyncio.run(run_paths(bus, history, seed, tmp_path_factory.mktemp("example")))


@pytest.mark.slow
class TestLastPart:
    @pytest.mark.timeout(1800)
    @settings(max_examples=EXAMPLES - 2 * (EXAMPLES // 3), deadline=None, suppress_health_check=QUIET)
    @given(history=histories, seed=st.integers(0, 2**32 - 1))
    def test_every_path_gives_the_same_state_on_yet_other_histories(
        self, bus: Bus, tmp_path_factory: pytest.TempPathFactory, history: list[Op], seed: int
    ) -> None:
        asyncio.run(run_paths(bus, history, seed, tmp_path_factory.mktemp("example")))


@pytest.mark.long
@pytest.mark.timeout(7200)
@settings(max_examples=LONG_EXAMPLES, deadline=None, suppress_health_check=QUIET)
@given(history=histories, seed=st.integers(0, 2**32 - 1))
def test_every_path_gives_the_same_state_over_a_long_run(
    bus: Bus, tmp_path_factory: pytest.TempPathFactory, history: list[Op], seed: int
) -> None:
    asyncio.run(run_paths(bus, history, seed, tmp_path_factory.mktemp("example")))
