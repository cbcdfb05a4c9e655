"""The compose file's whole shape: the PostgreSQL service that holds the node's journal and the URL that points
the node at it, healthchecks behind every dependency, loopback-only host ports, declared volumes. The journal URL
is also run against this machine's PostgreSQL, and `docker compose config` checks the file where Docker runs."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from observers.journal import Journal
from tests.deploy.support import (
    COMPOSE_FILE,
    DOCKERFILE,
    NATS_SERVICES,
    REPO,
    UnsetVariable,
    compose,
    env_of,
    host_ports,
    interpolate,
    mounts_of,
    service,
)

PASSWORD = "s3cretJournal"  # what an operator exports as EPIBUS_POSTGRES_PASSWORD
PG_DATA = "/var/lib/postgresql/data"


def services() -> dict[str, dict[str, Any]]:
    found = compose().get("services") or {}
    assert isinstance(found, dict)
    return found


def test_the_postgres_service_keeps_its_data_on_a_volume_and_reports_healthy() -> None:
    svc = service("postgres")
    assert str(svc.get("image", "")).startswith("postgres:16"), svc.get("image")
    env = env_of(svc)
    assert env.get("POSTGRES_USER") == "epibus"
    assert env.get("POSTGRES_DB") == "epibus"
    assert "POSTGRES_HOST_AUTH_METHOD" not in env, "trust would let anyone on the network in"
    with pytest.raises(UnsetVariable, match="EPIBUS_POSTGRES_PASSWORD"):
        interpolate(env["POSTGRES_PASSWORD"], {})  # compose refuses to run without a password
    assert interpolate(env["POSTGRES_PASSWORD"], {"EPIBUS_POSTGRES_PASSWORD": PASSWORD}) == PASSWORD
    volumes = [(s, t) for s, t, _ in mounts_of(svc) if not s.startswith((".", "/"))]
    assert ("postgres-data", PG_DATA) in volumes, volumes
    test = svc.get("healthcheck", {}).get("test", [])
    assert test[:2] == ["CMD", "pg_isready"], test
    assert test[test.index("-d") + 1] == env["POSTGRES_DB"], test
    assert test[test.index("-U") + 1] == env["POSTGRES_USER"], test
    assert not svc.get("ports"), "the journal's database is reached on the compose network only"


def compose_journal_url() -> str:
    url = env_of(service("epibus")).get("EPIBUS_JOURNAL_URL", "")
    assert url, "the epibus service sets no EPIBUS_JOURNAL_URL: its journal would be SQLite in its home"
    with pytest.raises(UnsetVariable, match="EPIBUS_POSTGRES_PASSWORD"):
        interpolate(url, {})
    return interpolate(url, {"EPIBUS_POSTGRES_PASSWORD": PASSWORD})


def test_the_epibus_journal_url_points_at_the_postgres_service() -> None:
    url = make_url(compose_journal_url())
    pg = env_of(service("postgres"))
    assert url.get_backend_name() == "postgresql", url
    assert (url.host, url.port or 5432) == ("postgres", 5432), url
    assert (url.username, url.password, url.database) == (pg["POSTGRES_USER"], PASSWORD, pg["POSTGRES_DB"])
    depends = service("epibus").get("depends_on") or {}
    assert depends.get("postgres", {}).get("condition") == "service_healthy", depends
    assert "[node,postgres]" in DOCKERFILE.read_text(), "the image lacks the node extra or the PostgreSQL driver"


def test_the_compose_journal_url_runs_a_journal_on_postgresql(postgres_url: str) -> None:
    """The URL as compose writes it (its scheme and driver), on this machine's PostgreSQL: the journal's tables
    are made, and read back through psycopg."""
    local = make_url(postgres_url)
    url = make_url(compose_journal_url()).set(
        host=local.host, port=local.port, username=local.username, password=local.password, database=local.database
    )
    journal = Journal(url.render_as_string(hide_password=False))
    try:
        journal.migrate()
    finally:
        journal.close()
    conninfo = f"host={local.host} port={local.port or 5432} user={local.username} dbname={local.database}"
    with psycopg.connect(conninfo, connect_timeout=5) as conn:
        tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert "events" in tables, tables


def test_every_dependency_waits_for_a_healthcheck() -> None:
    for name, svc in services().items():
        depends = svc.get("depends_on") or {}
        assert isinstance(depends, dict), f"{name}: depends_on without conditions starts before they are ready"
        for dep, spec in depends.items():
            assert spec.get("condition") == "service_healthy", f"{name} depends on {dep}: {spec}"
            assert services()[dep].get("healthcheck", {}).get("test"), f"{dep} has no healthcheck for {name}"
    assert set(service("epibus").get("depends_on") or {}) == {*NATS_SERVICES, "postgres"}


def test_host_ports_are_loopback_only() -> None:
    published = {name: host_ports(svc) for name, svc in services().items() if svc.get("ports")}
    assert published, "no service is reachable from the host"
    for name, ports in published.items():
        for spec in ports:
            assert spec.startswith("127.0.0.1:"), f"{name} publishes {spec} beyond loopback"


def test_named_volumes_are_declared_and_used() -> None:
    declared = set(compose().get("volumes") or {})
    used = {s for svc in services().values() for s, _, _ in mounts_of(svc) if not s.startswith((".", "/"))}
    assert used == declared, f"used {sorted(used)}, declared {sorted(declared)}"
    assert "postgres-data" in declared


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False).returncode == 0


def test_docker_compose_accepts_the_file_and_refuses_it_without_a_password() -> None:
    if not docker_answers():
        pytest.skip("no Docker engine: `docker info` does not answer")
    command = ["docker", "compose", "-f", str(COMPOSE_FILE), "config", "--format", "json"]
    without = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, check=False, env={})
    assert without.returncode != 0
    assert "EPIBUS_POSTGRES_PASSWORD" in without.stderr
    env = {"EPIBUS_POSTGRES_PASSWORD": PASSWORD, "PATH": "/usr/local/bin:/usr/bin:/bin"}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, check=False, env=env)
    assert result.returncode == 0, result.stderr
    rendered = json.loads(result.stdout)["services"]
    assert set(rendered) == {*NATS_SERVICES, "postgres", "epibus"}
    assert "@postgres:5432/epibus" in rendered["epibus"]["environment"]["EPIBUS_JOURNAL_URL"]
