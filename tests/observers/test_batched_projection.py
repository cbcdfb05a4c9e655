"""The journal's batched write (artifacts loaded per project by key, tombstones asked per claim, one insert per
table) ends in the same journal as writing the same deliveries one at a time, and as writing them in batches
of random sizes: every artifact's state, every event's row and outcome, every verification and tombstone.

Histories are random, with hostile messages mixed in, and each ends with a claim, its retraction and the same
claim made again, so a claim and its retraction (and the tombstone it leaves) land in one batch. Deliveries
are read from a real stream through the batch admission, as the runner reads them."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from bus.enrolment.registry import AgentRegistry
from bus.host.server import NatsServer
from bus.intake.admission import Admission, Delivery, Rejected
from bus.intake.batch_context import BatchContext
from bus.intake.stream_read import read_stream
from bus.model.tombstones import content_hash
from bus.model.vocab import ResolutionKind
from bus.subjects import STREAM, events_filter
from observers.journal import Journal
from observers.schema import artifacts, events, tombstones, verifications
from tests.conftest import postgres_database
from tests.histories import AGENTS, RESOLUTIONS, Op, build, fresh_project, histories, make_keys, publish, register_keys

QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
RETRACTED = RESOLUTIONS.index(ResolutionKind.retracted)


def with_retraction(history: list[Op], agent: int, text: int) -> list[Op]:
    """The history, then a claim, its retraction by its author, and the same claim again (flagged)."""
    claims = sum(1 for op in history if op[0] == "claim")
    return [
        *history,
        ("claim", 0, agent, text, "none", 0),
        ("resolve", agent, claims, RETRACTED, 0),
        ("claim", 0, agent, text, "none", 0),
    ]


async def deliveries_of(url: str, project: str) -> list[Delivery]:
    """The project's messages as the runner admits them: checked as a batch, bound in order, context attached."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        admission = Admission(AgentRegistry(js))
        admitted: list[Delivery] = []
        async for batch in read_stream(js, STREAM, filter_subject=events_filter(project)):
            for msg, checked in zip(batch, await admission.check_msgs(batch), strict=True):
                with contextlib.suppress(Rejected):  # the runner dead-letters it: no journal sees it
                    admitted.append(await admission.admit_checked(msg, checked))
        return await BatchContext(js, admission).attach(admitted)
    finally:
        await nc.close()


def contents(journal: Journal, project: str) -> dict[str, Any]:
    """The journal read back table by table (received_at is the wall clock of the write: left out)."""
    with journal.engine.connect() as conn:
        event_rows = conn.execute(
            select(events).where(events.c.project == project).order_by(events.c.stream_seq)
        ).mappings()
        artifact_rows = conn.execute(
            select(artifacts).where(artifacts.c.project == project).order_by(artifacts.c.artifact_id)
        ).mappings()
        verification_rows = conn.execute(
            select(verifications).where(verifications.c.project == project).order_by(verifications.c.event_id)
        ).mappings()
        tombstone_rows = conn.execute(
            select(tombstones).where(tombstones.c.project == project).order_by(tombstones.c.content_hash)
        ).mappings()
        return {
            "events": [{k: v for k, v in r.items() if k != "received_at"} for r in event_rows],
            "artifacts": [dict(r) for r in artifact_rows],
            "verifications": [dict(r) for r in verification_rows],
            "tombstones": [dict(r) for r in tombstone_rows],
        }


def write_in(journal: Journal, deliveries: Sequence[Delivery], sizes: Sequence[int]) -> list[tuple[int, str]]:
    """Write in consecutive batches of the given sizes (the last size repeats); returns the refusals."""
    refused: list[tuple[int, str]] = []
    at, turn = 0, 0
    while at < len(deliveries):
        size = sizes[min(turn, len(sizes) - 1)]
        written = journal.write(deliveries[at : at + size])
        refused += [(r.stream_seq, r.reason.value) for r in written.refused]
        at, turn = at + size, turn + 1
    return refused


@contextlib.contextmanager
def journals(dialect: str, root: Path, names: Sequence[str]) -> Iterator[dict[str, Journal]]:
    with contextlib.ExitStack() as stack:
        opened: dict[str, Journal] = {}
        for name in names:
            url = (
                f"sqlite:///{root / f'{name}.db'}" if dialect == "sqlite" else stack.enter_context(postgres_database())
            )
            journal = Journal(url)
            journal.migrate()
            stack.callback(journal.close)
            opened[name] = journal
        yield opened


def check_batched_equals_single(
    server: NatsServer, root: Path, dialect: str, history: list[Op], agent: int, text: int, sizes: list[int]
) -> None:
    keys = make_keys()
    project = fresh_project()

    async def go() -> list[Delivery]:
        await register_keys(server.url, keys)
        nc = await nats.connect(server.url)
        try:
            await publish(nc.jetstream(), build(with_retraction(history, agent, text), keys, project))
        finally:
            await nc.close()
        return await deliveries_of(server.url, project)

    deliveries = asyncio.run(go())
    with journals(dialect, root, ("whole", "single", "random")) as opened:
        refused = {
            "whole": write_in(opened["whole"], deliveries, [len(deliveries) or 1]),
            "single": write_in(opened["single"], deliveries, [1]),
            "random": write_in(opened["random"], deliveries, sizes),
        }
        found = {name: contents(journal, project) for name, journal in opened.items()}
    assert refused["whole"] == refused["single"] == refused["random"]
    assert found["whole"] == found["single"]
    assert found["random"] == found["single"]
    # Unless an enrolment record of the history forbids it, the retraction at the end left a tombstone of its
    # content (the first one for that content stays: an earlier rolled-back claim of the same words may hold
    # it) and the repeated claim carries the flag: the batch really held a claim, its retraction and the tombstone.
    *_, claim, retraction, again = found["single"]["events"]
    if claim["status"] == retraction["status"] == again["status"] == "applied":
        assert claim["artifact_id"] == retraction["artifact_id"]
        digest = content_hash(json.loads(claim["envelope"])["body"]["text"])
        assert digest in {t["content_hash"] for t in found["single"]["tombstones"]}
        assert "previously_retracted" in (again["flags"] or "")


sizes = st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=6)


@settings(max_examples=40, deadline=None, suppress_health_check=QUIET)
@given(
    history=histories,
    agent=st.integers(min_value=0, max_value=len(AGENTS) - 1),
    text=st.integers(min_value=0, max_value=4),
    sizes=sizes,
)
def test_sqlite_batched_projection_equals_one_event_at_a_time(
    shared_nats_server: NatsServer,
    tmp_path_factory: pytest.TempPathFactory,
    history: list[Op],
    agent: int,
    text: int,
    sizes: list[int],
) -> None:
    check_batched_equals_single(shared_nats_server, tmp_path_factory.mktemp("j"), "sqlite", history, agent, text, sizes)


@settings(max_examples=8, deadline=None, suppress_health_check=QUIET)
@given(
    history=histories,
    agent=st.integers(min_value=0, max_value=len(AGENTS) - 1),
    text=st.integers(min_value=0, max_value=4),
    sizes=sizes,
)
def test_postgresql_batched_projection_equals_one_event_at_a_time(
    shared_nats_server: NatsServer,
    tmp_path_factory: pytest.TempPathFactory,
    history: list[Op],
    agent: int,
    text: int,
    sizes: list[int],
) -> None:
    check_batched_equals_single(
        shared_nats_server, tmp_path_factory.mktemp("j"), "postgresql", history, agent, text, sizes
    )
