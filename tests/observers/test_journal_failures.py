"""Every public method of the journal reaches the database through one choke point: a database that does not
answer surfaces as Unavailable naming the journal, never as a SQLAlchemy or driver error, never as an empty
answer. A statement the database refuses for what it is (a table that is not there) is a failure, not an
outage."""

from __future__ import annotations

import inspect
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from bus.errors import ComponentFailed, Unavailable
from bus.identity.signing import AgentKey
from bus.intake.admission import Delivery
from bus.model.event import draft_event
from bus.subjects import event_subject
from observers.journal import EventQuery, Journal
from tests.conftest import finding

EVENT_ID = "0190f0f0-0000-7000-8000-000000000000"


def _delivery(key: AgentKey) -> Delivery:
    event = key.sign(draft_event("finding", finding(), project="p", actor=key.actor, session_id="s"))
    return Delivery(event, event_subject("p", "finding", event.artifact_id), 1, 1)


def _read(journal: Journal, _key: AgentKey) -> object:
    with journal.reading("a read from outside the class") as conn:
        return conn.execute(select(text("1"))).scalar_one()


# Every public method, called as a caller would: (name, call).
CALLS: list[tuple[str, Callable[[Journal, AgentKey], object]]] = [
    ("identity", lambda j, _k: j.identity()),
    ("migrate", lambda j, _k: j.migrate()),
    ("check", lambda j, _k: j.check()),
    ("adopt_identity", lambda j, _k: j.adopt_identity("x")),
    ("write", lambda j, k: j.write([_delivery(k)])),
    ("kept_events", lambda j, _k: j.kept_events([EVENT_ID])),
    ("rebuild_projection", lambda j, _k: j.rebuild_projection()),
    ("tombstones_of", lambda j, _k: j.tombstones_of([EVENT_ID])),
    ("forgotten_check", lambda j, _k: j.forgotten_check("p", "a", [EVENT_ID])),
    ("scrub", lambda j, _k: j.scrub()),
    ("has", lambda j, _k: j.has([EVENT_ID])),
    ("outcomes", lambda j, _k: j.outcomes([EVENT_ID])),
    ("query", lambda j, _k: j.query(EventQuery(project="p"))),
    ("count", lambda j, _k: j.count()),
    ("projects", lambda j, _k: j.projects()),
    ("event_ids", lambda j, _k: j.event_ids()),
    ("reading", _read),
]
NO_DATABASE = {"close", "safe_url", "replace_file"}  # disposes the pool; renders the URL; renames files


def test_the_table_names_every_public_method_of_the_journal() -> None:
    public = {name for name, _ in inspect.getmembers(Journal) if not name.startswith("_")}
    assert public - NO_DATABASE == {name for name, _ in CALLS}


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> AgentKey:
    return AgentKey.load_or_create(tmp_path_factory.mktemp("keys"), "alice")


def _sqlite_whose_directory_is_gone(tmp_path: Path) -> Journal:
    folder = tmp_path / "gone"
    journal = Journal(f"sqlite:///{folder / 'journal.db'}")  # makes the directory and an empty file
    shutil.rmtree(folder)  # no connection was opened yet: the first one cannot open the file
    return journal


def _postgres_nobody_listens_on(_tmp_path: Path) -> Journal:
    return Journal("postgresql+psycopg://postgres@127.0.0.1:1/test?connect_timeout=2")


BROKEN: dict[str, Callable[[Path], Journal]] = {
    "sqlite-directory-gone": _sqlite_whose_directory_is_gone,
    "postgres-closed-port": _postgres_nobody_listens_on,
}


@pytest.fixture(params=sorted(BROKEN))
def broken(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Journal]:
    journal = BROKEN[request.param](tmp_path)
    yield journal
    journal.close()


@pytest.mark.parametrize(("name", "call"), CALLS, ids=[name for name, _ in CALLS])
def test_a_database_that_does_not_answer_is_unavailable_from_every_method(
    broken: Journal, key: AgentKey, name: str, call: Callable[[Journal, AgentKey], Any]
) -> None:
    with pytest.raises(Unavailable) as raised:
        call(broken, key)
    assert raised.value.component == "journal"
    assert broken.safe_url in str(raised.value)


@pytest.mark.parametrize("name", ["identity", "count", "query", "outcomes"])
def test_a_table_that_is_not_there_is_a_failure_not_an_outage(tmp_path: Path, name: str) -> None:
    journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}")  # never migrated
    call = dict(CALLS)[name]
    try:
        with pytest.raises(ComponentFailed, match="no such table") as raised:
            call(journal, None)  # type: ignore[arg-type]  # these calls take no key
        assert raised.value.component == "journal"
    finally:
        journal.close()
