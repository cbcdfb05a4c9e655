"""`epibus doctor` against real broken setups: a nats-server without JetStream, a stream changed behind epibus's
back, journals (SQLite and PostgreSQL) whose schema is older or newer than the code, a mirror collection built
for another model, a world-readable home and key. Each is reported with its fix and exit code 1; a sound setup
is all ok with exit 0. The CLI runs in-process (typer's runner); the servers and databases are real."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from bus.broker.streams import ensure_streams
from bus.host.server import NatsServer, nats_server_binary
from bus.identity.signing import AgentKey
from bus.subjects import STREAM
from epibus.cli.app import app
from epibus.ops.doctor import SKEW_FAIL_S, SKEW_WARN_S, skew_verdict
from epibus.ops.doctor_local import DISK_WARN_ABOVE_RESERVE_BYTES, disk_verdict
from observers.journal import Journal
from observers.mirror.edge import EdgeVectorStore
from observers.schema import LATEST_VERSION
from tests.conftest import postgres_database
from tests.support import eventually_sync


def doctor(home: Path, url: str, journal: str, *more: str) -> tuple[int, dict[str, dict[str, Any]]]:
    """Exit code and the report by check name, as `epibus doctor --json` prints them."""
    env = {"EPIBUS_AGENT": "doctor-test", "EPIBUS_EMBED_MODEL": "", "EPIBUS_REPLICAS": None}
    args = ["doctor", "--json", "--home", str(home), "--nats", url, "--journal", journal, *more]
    result = CliRunner().invoke(app, args, env=env, catch_exceptions=False)
    lines = json.loads(result.stdout)
    assert len({line["check"] for line in lines}) == len(lines), lines
    return result.exit_code, {line["check"]: line for line in lines}


def failed(report: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: line for name, line in report.items() if line["status"] != "ok"}


@pytest.fixture
def sound(nats_server: NatsServer, tmp_path: Path) -> tuple[Path, str, str]:
    """A home, a server with every stream and bucket a node makes, and a current journal."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    AgentKey.load_or_create(home, "doctor-test")

    async def make_streams() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            await ensure_streams(nc.jetstream(), replicas=1)
        finally:
            await nc.close()

    asyncio.run(make_streams())
    journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}")
    journal.migrate()
    journal.close()
    return home, nats_server.url, journal.url


def test_a_sound_setup_is_all_ok(sound: tuple[Path, str, str]) -> None:
    code, report = doctor(*sound)
    assert failed(report) == {}
    assert code == 0
    expected = {"nats", "jetstream", "server version", "stream EPI", "stream KV_epibus_mesh", "clock", "journal"}
    assert expected <= report.keys()
    assert report["agent doctor-test"]["detail"].startswith("not enrolled yet")  # an open registry binds it


def test_a_server_without_jetstream_is_a_failure_naming_the_switch(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [str(nats_server_binary()), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        eventually_sync(lambda: _listening(port))
        home = tmp_path / "home"
        home.mkdir(mode=0o700)
        code, report = doctor(home, f"nats://127.0.0.1:{port}", f"sqlite:///{tmp_path / 'none.db'}")
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert code == 1
    assert report["nats"]["status"] == "ok"
    assert report["jetstream"]["status"] == "fail"
    assert "-js" in report["jetstream"]["hint"]
    assert not any(name.startswith("stream ") for name in report)  # nothing to compare without JetStream
    assert report["journal"]["status"] == "fail"  # the file does not exist, and the doctor did not create it
    assert not (tmp_path / "none.db").exists()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_duplicate_window_changed_behind_epibus_s_back_is_reported_and_left_alone(
    sound: tuple[Path, str, str],
) -> None:
    home, url, journal = sound

    async def shorten() -> float:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(STREAM)
            info.config.duplicate_window = 5.0
            await js.update_stream(info.config)
            return float((await js.stream_info(STREAM)).config.duplicate_window or 0)
        finally:
            await nc.close()

    assert asyncio.run(shorten()) == 5.0
    code, report = doctor(home, url, journal)
    assert code == 1
    assert set(failed(report)) == {"stream EPI"}
    assert "duplicate_window=5.0s (epibus needs 600.0s)" in report["stream EPI"]["detail"]
    assert report["stream EPI"]["hint"] == "`epibus streams repair` restores it"

    async def window() -> float:
        nc = await nats.connect(url)
        try:
            return float((await nc.jetstream().stream_info(STREAM)).config.duplicate_window or 0)
        finally:
            await nc.close()

    assert asyncio.run(window()) == 5.0  # the doctor only reads


def test_streams_with_fewer_replicas_than_the_nodes_run_with_fail_naming_both(sound: tuple[Path, str, str]) -> None:
    code, report = doctor(*sound, "--replicas", "3")
    assert code == 1
    streams = {name for name in report if name.startswith("stream ")}
    assert set(failed(report)) == streams
    assert len(streams) == 9  # EPI, EPI_DLQ, EPI_VEC, EPI_WATCH and the five buckets
    assert "num_replicas=1 (epibus needs 3)" in report["stream EPI"]["detail"]
    assert "--replicas" in report["stream EPI"]["hint"]
    assert doctor(*sound, "--replicas", "1")[0] == 0


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
@pytest.mark.parametrize("version", [LATEST_VERSION - 1, LATEST_VERSION + 1])
def test_a_journal_schema_older_or_newer_than_the_code_fails_with_the_way_out(
    sound: tuple[Path, str, str], tmp_path: Path, database: str, version: int
) -> None:
    home, url, _ = sound
    with _journal_at(database, tmp_path, version) as journal:
        code, report = doctor(home, url, journal)
    assert code == 1
    assert set(failed(report)) == {"journal"}
    line = report["journal"]
    assert f"schema version {version}" in line["detail"]
    assert ("migrates" if version < LATEST_VERSION else "upgrade epibus") in line["hint"]


@contextlib.contextmanager
def _journal_at(database: str, tmp_path: Path, version: int) -> Iterator[str]:
    """A migrated journal of its own whose recorded schema version is then set to `version` by plain SQL."""
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(postgres_database()) if database == "postgres" else f"sqlite:///{tmp_path / 'j.db'}"
        journal = Journal(url)
        try:
            journal.migrate()
            with journal.engine.begin() as conn:
                conn.execute(text("DELETE FROM epibus_schema WHERE version > :v"), {"v": version})
                if version > LATEST_VERSION:
                    conn.execute(
                        text("INSERT INTO epibus_schema (version, description, applied_at) VALUES (:v, 'x', :t)"),
                        {"v": version, "t": datetime.now(UTC)},
                    )
        finally:
            journal.close()
        yield url


def test_a_mirror_built_for_another_model_fails_naming_both(sound: tuple[Path, str, str]) -> None:
    home, url, journal = sound

    async def build() -> None:
        store = await EdgeVectorStore.open(home / "mirror", "other/model", 16)
        await store.close()

    asyncio.run(build())
    code, report = doctor(home, url, journal)
    assert code == 1
    assert set(failed(report)) == {"mirror"}
    assert "other/model (16-d)" in report["mirror"]["detail"]
    assert "local/all-MiniLM-L6-v2-int8 (384-d)" in report["mirror"]["detail"]
    assert "epibus reindex" in report["mirror"]["hint"]


def test_a_world_readable_home_and_key_fail_with_the_chmod_to_run(sound: tuple[Path, str, str]) -> None:
    home, url, journal = sound
    key = home / "keys" / "doctor-test.nk"
    os.chmod(home, 0o755)
    os.chmod(key, 0o644)
    code, report = doctor(home, url, journal)
    assert code == 1
    assert set(failed(report)) == {"home mode", "key mode"}
    assert report["home mode"]["hint"] == f"chmod 700 {home}"
    assert report["key mode"]["hint"] == f"chmod 600 {key}"
    assert "0644" in report["key mode"]["detail"]


def test_disk_space_and_clock_skew_thresholds() -> None:
    where = Path("/")
    reserve = 256 << 20
    assert disk_verdict(where, reserve + DISK_WARN_ABOVE_RESERVE_BYTES, reserve).status == "ok"
    assert disk_verdict(where, reserve + DISK_WARN_ABOVE_RESERVE_BYTES - 1, reserve).status == "warn"
    assert disk_verdict(where, reserve - 1, reserve).status == "fail"
    assert skew_verdict(SKEW_WARN_S / 2, 0.001).status == "ok"
    assert skew_verdict(-(SKEW_WARN_S + 0.5), 0.001).status == "warn"
    assert skew_verdict(SKEW_FAIL_S + 1, 0.001).status == "fail"
    assert skew_verdict(SKEW_WARN_S + 0.5, 1.0).status == "ok"  # within the round trip's uncertainty


def test_a_stream_near_its_byte_limit_is_a_warning_naming_the_share_and_the_option(
    sound: tuple[Path, str, str],
) -> None:
    home, url, journal = sound

    async def nearly_fill() -> None:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(STREAM)
            info.config.max_bytes = info.state.bytes + 10_000  # as a node configured with a small limit sets it
            await js.update_stream(info.config)
            for i in range(20):
                await js.publish(f"epi.doctor.finding.fill{i}", b"x" * 400)
        finally:
            await nc.close()

    asyncio.run(nearly_fill())
    code, report = doctor(home, url, journal)
    assert code == 0  # a warning, not a failure
    assert report["stream EPI"]["status"] == "warn", report["stream EPI"]
    assert "bytes limit" in report["stream EPI"]["detail"]
    assert "--events-max-gib" in report["stream EPI"]["hint"]
