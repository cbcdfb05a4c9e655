"""The outbox: durable before the receipt, group commit, leases across forwarders, refusals kept."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bus.host.server import NatsServer
from bus.outbox.outbox import Outbox
from bus.outbox.outbox_file import OutboxRow


def rows(n: int, prefix: str = "e") -> list[OutboxRow]:
    return [OutboxRow(f"{prefix}{i}", f"epi.p.finding.{prefix}{i}", f"payload {i}".encode()) for i in range(n)]


def stored(path: Path, *, unsent_only: bool = False) -> list[tuple[str, bytes]]:
    where = "WHERE sent_at IS NULL" if unsent_only else ""
    with sqlite3.connect(path) as db:  # another connection, another path than the outbox's own
        return [(r[0], bytes(r[1])) for r in db.execute(f"SELECT event_id, payload FROM outbox {where} ORDER BY seq")]


@pytest.fixture
async def outbox(tmp_path: Path) -> AsyncIterator[Outbox]:
    box = await Outbox(tmp_path / "outbox.db").open()
    yield box
    await box.close()


async def test_added_rows_are_on_disk_when_add_returns(outbox: Outbox) -> None:
    await outbox.add(rows(3))
    assert stored(outbox.path) == [("e0", b"payload 0"), ("e1", b"payload 1"), ("e2", b"payload 2")]


async def test_the_outbox_runs_with_synchronous_full(outbox: Outbox) -> None:
    level = await outbox.file.run(lambda: outbox.file.conn.execute("PRAGMA synchronous").fetchone()[0])
    assert level == 2  # FULL


async def test_concurrent_adds_share_commits_and_lose_nothing(outbox: Outbox) -> None:
    batches = [rows(5, prefix=f"b{i}-") for i in range(40)]
    await asyncio.gather(*(outbox.add(b) for b in batches))
    assert sorted(e for e, _ in stored(outbox.path)) == sorted(r.event_id for b in batches for r in b)


async def test_adding_an_event_id_twice_keeps_one_row(outbox: Outbox) -> None:
    await outbox.add(rows(2))
    await outbox.add(rows(2))
    assert [e for e, _ in stored(outbox.path)] == ["e0", "e1"]


async def test_a_leased_row_is_not_claimed_by_another_forwarder_until_the_lease_ends(tmp_path: Path) -> None:
    first = await Outbox(tmp_path / "o.db").open()
    second = await Outbox(tmp_path / "o.db").open()
    try:
        await first.add(rows(4))
        claimed = await first.claim(10, lease_s=60)
        assert [r.event_id for r in claimed] == ["e0", "e1", "e2", "e3"]
        assert await second.claim(10, lease_s=60) == []
        await first.release({"e1": "no PubAck"})
        assert [r.event_id for r in await second.claim(10, lease_s=60)] == ["e1"]
        await first.complete({"e0": (1, False), "e2": (2, False), "e3": (3, True)})
        assert [e for e, _ in stored(tmp_path / "o.db", unsent_only=True)] == ["e1"]
        # Another process's forwarder sent them: their receipts are readable from the shared outbox.
        assert await second.sent(["e0", "e1", "e3"]) == {"e0": (1, False), "e3": (3, True)}
        assert await second.depth() == 1
    finally:
        await first.close()
        await second.close()


async def test_a_refused_row_is_parked_with_its_reason_not_deleted(outbox: Outbox) -> None:
    await outbox.add(rows(2))
    await outbox.claim(10, lease_s=60)
    await outbox.park({"e0": "refused: maximum payload exceeded"})
    await outbox.release({"e1": "timeout"})
    assert await outbox.parked() == {"e0": "refused: maximum payload exceeded"}
    assert await outbox.depth() == 1
    assert [r.event_id for r in await outbox.claim(10, lease_s=60)] == ["e1"]
    assert {e for e, _ in stored(outbox.path)} == {"e0", "e1"}


async def test_publishing_a_sent_event_again_sends_it_again(outbox: Outbox) -> None:
    await outbox.add(rows(1))
    await outbox.claim(10, lease_s=60)
    await outbox.complete({"e0": (7, False)})
    assert await outbox.depth() == 0
    await outbox.add(rows(1))
    assert await outbox.sent(["e0"]) == {}
    assert [r.event_id for r in await outbox.claim(10, lease_s=60)] == ["e0"]


async def test_a_sent_event_sent_again_carries_the_bytes_given_again(outbox: Outbox) -> None:
    await outbox.add(rows(1))
    await outbox.claim(10, lease_s=60)
    await outbox.complete({"e0": (7, False)})
    assert stored(outbox.path) == [("e0", b"")]  # a sent row keeps its receipt, not the event
    await outbox.add(rows(1))
    assert [r.payload for r in await outbox.claim(10, lease_s=60)] == [b"payload 0"]


async def test_sent_rows_stay_bounded_under_repeated_publishing(
    outbox: Outbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("bus.outbox.outbox.MAX_SENT_ROWS", 50)
    for wave in range(6):
        batch = rows(40, prefix=f"w{wave}-")
        await outbox.add(batch)
        claimed = await outbox.claim(100, lease_s=60)
        await outbox.complete({r.event_id: (i, False) for i, r in enumerate(claimed)})
    kept = stored(outbox.path)
    assert len(kept) == 50  # the newest 50 receipts
    assert {payload for _, payload in kept} == {b""}
    assert kept[-1][0] == "w5-39"  # the newest receipts are the ones kept
    assert await outbox.sent(["w5-39"]) == {"w5-39": (39, False)}


async def test_a_pending_event_added_again_keeps_its_place_and_a_parked_one_stays_parked(outbox: Outbox) -> None:
    await outbox.add(rows(2))
    await outbox.claim(10, lease_s=60)
    await outbox.park({"e1": "refused"})
    await outbox.add(rows(2))
    assert await outbox.parked() == {"e1": "refused"}
    assert await outbox.claim(10, lease_s=60) == []  # e0 is still leased by the first claim


async def test_forgetting_an_artifact_leaves_no_byte_of_its_rows_in_the_outbox_files(outbox: Outbox) -> None:
    secret = b"the combination of the vault is 7-3-9-1-5"
    await outbox.add(
        [
            OutboxRow("claim", "epi.p.finding.a1", b'{"text": "' + secret + b'"}'),
            OutboxRow("note", "epi.p.verified.a1", b'{"note": "' + secret + b' checked"}'),
            OutboxRow("forget", "epi.p.forgotten.a1", b'{"reason": "personal data"}'),
            OutboxRow("other", "epi.p.finding.a2", b'{"text": "the mill is closed"}'),
        ]
    )
    await outbox.complete({"claim": (1, False), "note": (2, False)})  # sent rows are kept for their receipts
    assert await outbox.forget("p", "a1") == 2
    assert [event_id for event_id, _ in stored(outbox.path)] == ["forget", "other"]
    files = [f for f in outbox.path.parent.iterdir() if f.name.startswith("outbox.db")]
    assert [f.name for f in files if secret in f.read_bytes()] == []


async def test_an_event_held_longer_than_nodes_admit_is_parked_with_the_reason_not_sent(
    outbox: Outbox, nats_server: NatsServer, tmp_path: Path
) -> None:
    from datetime import UTC, datetime, timedelta

    import nats

    from bus.broker.streams import ensure_streams
    from bus.errors import InvalidEvent
    from bus.identity.signing import AgentKey
    from bus.model.event import draft_event, encode_event
    from bus.outbox.forwarder import Forwarder
    from bus.subjects import event_subject

    key = AgentKey.generate("alice")
    old = key.sign_v1(  # a legacy row: no signature column, forwarded as it is
        draft_event(
            "unknown",
            {"question": "still open?", "impact": 0.2},
            project="p",
            actor=key.actor,
            session_id="s",
            recorded_at=datetime.now(UTC) - timedelta(days=31),
        )
    )
    await outbox.add([OutboxRow(str(old.event_id), event_subject("p", "unknown", old.artifact_id), encode_event(old))])
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        forwarder = Forwarder(outbox, lambda: js)
        receipt = forwarder.sent(str(old.event_id))
        assert await forwarder.drain_once() is True
        with pytest.raises(InvalidEvent, match="EPIBUS_MAX_PUBLISH_DELAY_S"):
            await receipt
        assert "before the stream stored it" in (await outbox.parked())[str(old.event_id)]
        assert (await js.stream_info("EPI")).state.messages == 0
    finally:
        await nc.close()
