"""Fixtures that start real components: nats-server processes on free loopback ports, SQLite files and a
PostgreSQL database of its own per run. A missing component fails the run loudly; nothing is skipped."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from bus.client.client import EpibusClient, connect
from bus.host.server import NatsServer
from epibus.node.node import Node, NodeConfig
from observers.journal import Journal
from tests.scheduling import longest_first


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A long or soak run is slow too, so the quick loop (`-m "not slow"`, which replaces the default marker
    expression) never starts one. The longest modules are handed out first (tests/scheduling.py)."""
    longest_first(items)
    for item in items:
        if item.get_closest_marker("long") or item.get_closest_marker("soak"):
            item.add_marker(pytest.mark.slow)


# epibus honours the NATS tools' variables; a developer's own must not point the suite at another server.
for _name in ("NATS_URL", "NATS_CREDS"):
    os.environ.pop(_name, None)

POSTGRES_ADMIN_URL = os.environ.get("EPIBUS_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh nats-server 2.15 with JetStream, killed and restartable by the test."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def shared_nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """One nats-server for a module's property tests (hypothesis runs many examples; each uses its own project
    and agents, so they do not meet)."""
    server = NatsServer(tmp_path_factory.mktemp("shared") / "nats")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def project() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """A database of its own on the machine's PostgreSQL, dropped at the end; fails (never skips) without one."""
    admin = make_url(POSTGRES_ADMIN_URL)
    name = f"epibus_test_{uuid.uuid4().hex[:10]}"
    conninfo = (
        f"host={admin.host} port={admin.port or 5432} user={admin.username or 'postgres'} dbname={admin.database}"
    )
    try:
        with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as e:
        pytest.fail(
            f"PostgreSQL is required at {POSTGRES_ADMIN_URL} ({e}); start it (see .ci/run) or set "
            "EPIBUS_TEST_POSTGRES_URL",
            pytrace=False,
        )
    try:
        yield admin.set(drivername="postgresql+psycopg", database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A database of this test run's own, shared by the tests that need one."""
    with postgres_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def journal_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'journal.db'}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def sqlite_journal_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'journal.db'}"


@pytest.fixture
def journal(sqlite_journal_url: str) -> Iterator[Journal]:
    """A migrated SQLite journal of the test's own."""
    store = Journal(sqlite_journal_url)
    store.migrate()
    yield store
    store.close()


@pytest.fixture
async def node(nats_server: NatsServer, home: Path, sqlite_journal_url: str) -> AsyncIterator[Node]:
    """A node joined to the test's nats-server: journal observer, lookup service, forwarder."""
    async with Node(NodeConfig(home=home, nats_url=nats_server.url, journal_url=sqlite_journal_url, mirror="off")) as n:
        yield n


@pytest.fixture
async def client(nats_server: NatsServer, home: Path) -> AsyncIterator[EpibusClient]:
    async with connect(nats_server.url, agent="alice", home=home) as c:
        yield c


def finding(i: int = 0, text: str | None = None) -> dict[str, object]:
    return {"text": text or f"finding number {i}", "impact": 0.5, "confidence": 0.7, "subject": "tests"}
