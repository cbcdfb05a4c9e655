"""Artifact ids by prefix, looked up in a real journal (SQLite and PostgreSQL) that a real node wrote from a
real nats-server: dashes and case ignored, an exact id first, the project respected, at most 11 returned."""

from __future__ import annotations

from pathlib import Path

import pytest

from bus.client.client import connect
from bus.errors import AmbiguousId, NotFound
from bus.host.server import NatsServer
from bus.model.ids import SHOWN_MATCHES, id_prefix, only_match
from bus.model.vocab import ReceiptLevel
from epibus.node.node import Node, NodeConfig
from observers.reads import artifact_ids_like
from tests.conftest import finding


def test_what_counts_as_a_prefix() -> None:
    assert id_prefix("0193a4b2-c3d4") == "0193a4b2c3d4"
    assert id_prefix("0193A4B2C3D4") == "0193a4b2c3d4"
    assert id_prefix("01-93") == "0193"
    assert id_prefix("019") is None  # too short: taken as a whole id
    assert id_prefix("cache-notes") is None  # not hex: an id chosen by hand
    assert id_prefix("0193a4b2-c3d4-7e5f-8a6b-9c0d1e2f3a4b") is None  # written out whole: no lookup


def test_one_match_none_or_several() -> None:
    assert only_match("dead", "ID", ["dead", "deadbeef"], what="artifact", where="in project 'p'", hint="h") == "dead"
    assert only_match("dead", "ID", ["deadbeef"], what="artifact", where="in project 'p'", hint="h") == "deadbeef"
    with pytest.raises(NotFound, match=r"^artifact 'beef' not found; no artifact id in project 'p' starts with it"):
        only_match("beef", "ID", [], what="artifact", where="in project 'p'", hint="h")
    many = [f"dead{i:02d}" for i in range(SHOWN_MATCHES + 1)]
    with pytest.raises(AmbiguousId, match=r"^ID='dead' is ambiguous: more than 10 artifacts in project 'p'") as e:
        only_match("dead", "ID", many, what="artifact", where="in project 'p'", hint="h")
    assert e.value.matches == tuple(many[:SHOWN_MATCHES])


async def test_the_journal_finds_ids_by_prefix(
    nats_server: NatsServer, home: Path, journal_url: str, project: str
) -> None:
    config = NodeConfig(home=home, nats_url=nats_server.url, journal_url=journal_url, mirror="off")
    async with Node(config) as node, connect(nats_server.url, agent="alice", home=home) as client:
        assert node.journal is not None
        ids = ["dead", "deadbeef-0001", "DEADBEEF-0002", "cafe-0001"]
        events = [client.event("finding", finding(i), project=project, artifact_id=a) for i, a in enumerate(ids)]
        elsewhere = client.event("finding", finding(9), project=f"{project}-x", artifact_id="deadbeef-0003")
        await client.publish_many([*events, elsewhere], wait_for=ReceiptLevel.journaled)

        def like(value: str, where: str | None = project) -> list[str]:
            digits = id_prefix(value)
            assert digits is not None
            return artifact_ids_like(node.journal, where, value, digits)  # type: ignore[arg-type]

        found = like("dead")
        assert found[0] == "dead"  # the exact id first (the order of the rest is the database's collation)
        assert sorted(found) == sorted(["dead", "DEADBEEF-0002", "deadbeef-0001"])
        assert sorted(like("dead-beef")) == sorted(["DEADBEEF-0002", "deadbeef-0001"])
        assert like("DEADBEEF0001") == ["deadbeef-0001"]
        assert sorted(like("deadbeef", None)) == sorted(["DEADBEEF-0002", "deadbeef-0001", "deadbeef-0003"])
        assert like("beef") == []
