"""Consuming events from Python with ack semantics (`EpibusClient.consume`), as an enrolled agent on a node with
authentication: at least once, resumable from a cursor file, refused messages never handed over, a bound on
what is handed over and not acknowledged."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NatsClient

import epibus
from bus.client.consume import Consumer, Received
from bus.errors import ConfigError, Forbidden, LimitReached
from bus.intake.cursor import FileCursor, MemoryCursor
from epibus.node.node import Node, NodeConfig
from tests.conftest import finding
from tests.security.test_confinement import agent


async def next_of(events: Consumer) -> Received:
    async with asyncio.timeout(15):
        return await anext(events)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    async with Node(NodeConfig(home=tmp_path / "home", mirror="off")) as running:
        assert running.authenticated
        yield running


async def test_a_second_run_resumes_after_what_was_acknowledged_and_gets_the_rest_again(
    node: Node, project: str, tmp_path: Path
) -> None:
    cursor_path = tmp_path / "reader.cursor"
    async with agent(node, "carol", project) as carol:
        sent = [(await carol.publish(carol.event("finding", finding(i), project=project))).event_id for i in range(5)]
        async with carol.consume(project, cursor=FileCursor(cursor_path), from_start=True) as events:
            first_run = [await next_of(events) for _ in range(5)]
            for received in (first_run[0], first_run[1], first_run[3]):  # the third is never acknowledged
                received.ack()
        assert [r.event.event_id for r in first_run] == sent
        assert FileCursor(cursor_path).load() == first_run[1].seq  # stops before the first one not acknowledged
        assert events.stats.delivered == 5
        assert events.stats.acked == 3

        async with carol.consume(project, cursor=FileCursor(cursor_path), from_start=True) as events:
            second_run = [await next_of(events) for _ in range(3)]
            for received in second_run:
                received.ack()
        assert [r.event.event_id for r in second_run] == sent[2:]  # the fourth again too: at least once
        assert FileCursor(cursor_path).load() == first_run[4].seq


async def test_events_published_after_the_reader_started_arrive_and_a_kind_filter_holds(
    node: Node, project: str
) -> None:
    async with agent(node, "dave", project) as dave:
        await dave.publish(dave.event("finding", finding(0), project=project))  # before: not "new"
        async with dave.consume(project, kind="unknown") as events:
            await dave.publish(dave.event("finding", finding(1), project=project))
            asked = await dave.publish(dave.event("unknown", {"question": "why?", "impact": 0.3}, project=project))
            received = await next_of(events)
        assert received.event.event_id == asked.event_id
        assert received.subject.startswith(f"epi.{project}.unknown.")


async def test_a_message_the_nodes_refuse_is_counted_never_handed_over_and_passed_by_the_cursor(
    node: Node, project: str
) -> None:
    cursor = MemoryCursor()
    async with agent(node, "erin", project) as erin:
        assert erin.nc is not None
        await erin.nc.jetstream().publish(f"epi.{project}.finding.{uuid.uuid4()}", b'{"not": "an event"}', timeout=5)
        good = await erin.publish(erin.event("finding", finding(1), project=project))
        async with erin.consume(project, cursor=cursor, from_start=True) as events:
            received = await next_of(events)
            received.ack()
        assert received.event.event_id == good.event_id
        assert events.stats.rejected == 1
        assert "invalid" in str(events.stats.last_rejection)
        assert cursor.load() == received.seq  # past the refused message, which came first


async def test_another_projects_events_are_refused_before_anything_is_read(node: Node, project: str) -> None:
    async with agent(node, "frank", project) as frank:
        with pytest.raises(Forbidden, match=f"{project}-other"):
            frank.consume(f"{project}-other")


async def test_too_many_unacknowledged_events_is_a_limit_with_its_number(node: Node, project: str) -> None:
    async with agent(node, "grace", project) as grace:
        for i in range(3):
            await grace.publish(grace.event("finding", finding(i), project=project))
        async with grace.consume(project, from_start=True, max_unacked=2) as events:
            held = [await next_of(events), await next_of(events)]
            with pytest.raises(LimitReached, match=r"unacknowledged events \(2\)"):
                await next_of(events)
            held[0].ack()
            third = await next_of(events)  # room again
        assert third.seq > held[1].seq


def test_max_unacked_below_one_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="max_unacked"):
        Consumer(NatsClient(), "demo", max_unacked=0)


def test_the_public_api_offers_the_consumer_and_its_cursors() -> None:
    assert epibus.Consumer is Consumer
    assert (epibus.FileCursor, epibus.MemoryCursor) == (FileCursor, MemoryCursor)


@settings(max_examples=200, deadline=None)
@given(
    handed=st.integers(min_value=1, max_value=30),
    acks=st.lists(st.integers(min_value=0, max_value=29), max_size=40),
)
def test_the_cursor_never_passes_an_event_not_acknowledged(handed: int, acks: list[int]) -> None:
    """Whatever order acks come in (repeated, or for events not handed over yet): the saved sequence is the
    one right before the first unacknowledged event handed over, or the last one handed when all are."""
    cursor = MemoryCursor()
    consumer = Consumer(NatsClient(), "demo", cursor=cursor)  # its bookkeeping only: nothing is read
    seqs = [10 + 2 * i for i in range(handed)]  # sequences with gaps: other subjects' messages between
    for seq in seqs:
        consumer._unacked.add(seq)
        consumer._pass(seq)
    acked: set[int] = set()
    for index in acks:
        if index < handed:
            consumer._acked(seqs[index])
            acked.add(seqs[index])
    waiting = [seq for seq in seqs if seq not in acked]
    expected = waiting[0] - 1 if waiting else seqs[-1]
    assert consumer.watermark == expected
    assert cursor.load() == expected
