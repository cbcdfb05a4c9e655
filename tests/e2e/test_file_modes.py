"""A node's home holds a fleet's memory, so only its owner can read it: every directory epibus creates under it
is 0700 and every file 0600, whatever the process umask, including the files SQLite, qdrant-edge and the embedded
nats-server create on their own. A home left 0755 by an older epibus is tightened when a node starts."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.client.client import connect
from bus.host.home import private_tree
from bus.host.server import NatsServer
from bus.model.vocab import ReceiptLevel
from epibus.cli.mesh_roster import seat_as_operator
from epibus.monitoring.health import HEALTH_FILE
from epibus.monitoring.statusline import STATUS_FILE
from epibus.node.node import Node, NodeConfig
from mesh.agent import MeshAgent
from tests.conftest import finding
from tests.support import eventually

# Files that exist only while the node runs (SQLite's side files, the server's ports file) or that it writes
# as it goes: a walk that misses one of them did not look at what the test is about.
EXPECTED_WHILE_RUNNING = {
    "journal.db",
    "journal.db-wal",
    "journal.db-shm",
    "outbox.db",
    "outbox.db-wal",
    "outbox.db-shm",
    "embed-cache.db",
    "embed-cache.db-wal",
    "embed-cache.db-shm",
    "node.json",
    "node-name",
    HEALTH_FILE,
    STATUS_FILE,
    "keys/alice.nk",
    "mesh/recorder.cursor",
    "mirror/collection.json",
    "models/all-MiniLM-L6-v2-int8/tokenizer_config.json",
    "nats/nats-server.conf",
    "nats/nats-server.log",
    "nats/nats-server.lock",
    "nats/nats-server.pid",
    "nats/ports.json",
}


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """The usual umask, under which anything created without an explicit mode is readable by everyone."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def walk(home: Path) -> tuple[dict[str, int], dict[str, int]]:
    """Every directory and regular file under home (home itself as '.'), by relative path, with its mode."""
    dirs: dict[str, int] = {}
    files: dict[str, int] = {}
    for directory, names, file_names in os.walk(home):
        dirs[str(Path(directory).relative_to(home))] = stat.S_IMODE(os.lstat(directory).st_mode)
        for name in file_names:
            path = Path(directory, name)
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode):
                files[str(path.relative_to(home))] = stat.S_IMODE(info.st_mode)
            else:  # the model's files are links into the installed package; a link has no mode of its own
                assert stat.S_ISLNK(info.st_mode), path
                assert path.parent.parent.name == "models", path
        assert all(not Path(directory, name).is_symlink() for name in names), directory
    return dirs, files


def leave_crashed_sqlite(scratch: Path, path: Path) -> None:
    """A database at `path` with a write-ahead log not yet checkpointed into it, as a killed process leaves it
    (SQLite keeps such a log, and its mode, when it opens the database again)."""
    with contextlib.closing(sqlite3.connect(scratch)) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA wal_autocheckpoint=0")
        db.execute("CREATE TABLE leftover (x)")
        db.commit()
        shutil.copy(scratch, path)
        shutil.copy(f"{scratch}-wal", f"{path}-wal")


def offenders(dirs: dict[str, int], files: dict[str, int]) -> list[str]:
    return [f"{path}/ {mode:o}" for path, mode in sorted(dirs.items()) if mode != 0o700] + [
        f"{path} {mode:o}" for path, mode in sorted(files.items()) if mode != 0o600
    ]


async def test_every_directory_and_file_of_a_running_node_with_its_server_and_mirror_is_owner_only(
    tmp_path: Path, project: str, permissive_umask: None
) -> None:
    home = tmp_path / "fresh" / "home"  # neither exists yet: the node creates both
    async with Node(NodeConfig(home=home)) as node:
        assert node.server is not None
        assert node.mirror is not None
        async with connect(node.nats_url, agent="alice", home=home) as alice:
            receipt = await alice.publish(
                alice.event("finding", finding(1), project=project), wait_for=ReceiptLevel.journaled
            )
            assert receipt.level is ReceiptLevel.journaled
            mesh = MeshAgent(alice)
            await seat_as_operator([node.nats_url], home, project, "alice")
            await mesh.propose(project, "rotate logs", "the disk fills up", category="operational", agents=["alice"])
            await eventually(lambda: node.mirror is not None and node.mirror.indexed >= 1, timeout_s=15)
            await eventually(
                lambda: all((home / name).exists() for name in ("mesh/recorder.cursor", HEALTH_FILE, STATUS_FILE))
            )

            dirs, files = walk(home)
            missing = EXPECTED_WHILE_RUNNING - files.keys()
            assert not missing, f"not written, so not checked: {sorted(missing)}"
            assert any(path.startswith("nats/jetstream/") for path in files), sorted(files)
            assert any(path.startswith("mirror/hot-") for path in files), sorted(files)
            assert f"nats/nats-server_{node.server.pid}.ports" in files, sorted(files)
            assert not offenders(dirs, files), f"not owner-only while running: {offenders(dirs, files)}"

    assert stat.S_IMODE((tmp_path / "fresh").stat().st_mode) == 0o700  # created on the way to home
    dirs, files = walk(home)  # closing flushes and rewrites files (the mirror's segments)
    assert "journal.db" in files
    assert "mirror/collection.json" in files
    assert not offenders(dirs, files), f"not owner-only after the node stopped: {offenders(dirs, files)}"


async def test_a_home_left_readable_by_everyone_is_made_owner_only_at_node_start_and_logged_once(
    nats_server: NatsServer, tmp_path: Path, permissive_umask: None, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    leave_crashed_sqlite(tmp_path / "scratch.db", home / "journal.db")
    assert stat.S_IMODE(home.stat().st_mode) == 0o755
    assert stat.S_IMODE((home / "journal.db").stat().st_mode) == 0o644
    assert stat.S_IMODE((home / "journal.db-wal").stat().st_mode) == 0o644
    caplog.set_level(logging.INFO, logger="epibus.node.node")

    config = NodeConfig(home=home, nats_url=nats_server.url, mirror="off")
    async with Node(config):
        dirs, files = walk(home)
        assert {"journal.db", "journal.db-wal", "outbox.db", "node-name"} <= files.keys()
        assert not offenders(dirs, files), f"not owner-only after a start on an old home: {offenders(dirs, files)}"
    async with Node(config):  # already owner-only: nothing to tighten, nothing to say
        pass

    tightened = [r.getMessage() for r in caplog.records if str(home) in r.getMessage() and "0700" in r.getMessage()]
    assert tightened == [f"{home} was mode 0755 and is now 0700: a fleet's memory is readable by its owner only"]
    assert [r.levelno for r in caplog.records if r.getMessage() in tightened] == [logging.INFO]


def test_tightening_a_tree_while_a_worker_renames_its_files_in_it_does_not_fail(tmp_path: Path) -> None:
    """A seal worker writes its shard beside the live ones and renames temporary files as it goes: a file that
    goes between the walk's listing and its chmod is simply gone, not an error for the mirror's write."""
    root = tmp_path / "mirror"
    (root / "build-1").mkdir(parents=True)
    stop = threading.Event()

    def worker() -> None:
        n = 0
        while not stop.is_set():
            temporary = root / "build-1" / f".atomicwrite{n}"
            temporary.write_bytes(b"x")
            temporary.chmod(0o644)
            temporary.rename(root / "build-1" / f"page{n % 4}")
            n += 1

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        for _ in range(300):
            private_tree(root)
    finally:
        stop.set()
        thread.join()
    private_tree(root)
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in root.rglob("*"))
