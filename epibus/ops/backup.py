"""Backups an operator can trust, and their restore onto a fresh home.

`backup` writes into one directory, in this order: the node's keys and small state files, the journal (SQLite's
online backup API: a consistent copy while the node writes; for PostgreSQL, what to run instead), then a
JetStream snapshot of every stream (events, dead letters, the buckets: registry, roster, tasks, tombstones).
The journal is copied before the streams, so every event it holds is in the snapshot. The mirror is not copied:
it is rebuilt from the stream.

`restore` refuses a home that holds anything of a node, puts the keys and state files back, restores every
stream into a fresh store through a server of its own (without consumers: the node makes its own at its first
start and reads the whole stream again into the journal and the mirror), and copies the journal in. After
`epibus up`, `epibus reconcile` is clean once the node has caught up."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from bus.broker.nats_errors import JS_TIMEOUT_S, nats_call
from bus.errors import ConfigError, Unavailable
from bus.host.home import NODE_FILE, private_dir, write_private
from bus.host.server import NatsServer
from bus.identity.signing import NODE_KEY_FILE
from observers.journal_engine import sqlite_file

MANIFEST = "manifest.json"
FORMAT = 1
CHUNK_BYTES = 128 * 1024
SNAPSHOT_TIMEOUT_S = 600.0
# What a node keeps in its home besides its stores: its identity, its agents' keys, its name, the mesh cursors.
STATE_FILES = (NODE_KEY_FILE, "node-name", "nats/system.nk")
STATE_GLOBS = ("keys/*.nk", "mesh/*.cursor")
# What marks a home as a node's: a restore never goes over it.
NODE_MARKS = (NODE_FILE, "journal.db", "nats/jetstream", "mirror")


@dataclass
class StreamCopy:
    name: str
    messages: int
    bytes: int
    first_seq: int
    last_seq: int
    snapshot_bytes: int = 0


@dataclass
class Manifest:
    format: int
    created_at: str
    home: str
    journal: dict[str, Any]
    streams: list[StreamCopy] = field(default_factory=list)
    state_files: list[str] = field(default_factory=list)

    def write(self, directory: Path) -> None:
        write_private(directory / MANIFEST, json.dumps(asdict(self), indent=2) + "\n", durable=True)

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(
                "backup", f"{directory} holds no {MANIFEST}: not a backup `epibus backup` wrote"
            ) from None
        except json.JSONDecodeError as e:
            raise ConfigError("backup", f"{path} is unreadable ({e})") from e
        if raw.get("format") != FORMAT:
            raise ConfigError("backup", f"{path} is format {raw.get('format')!r}; this epibus reads format {FORMAT}")
        raw["streams"] = [StreamCopy(**s) for s in raw["streams"]]
        return cls(**raw)


# -- backup ---------------------------------------------------------------------------------------------------


def copy_state_files(home: Path, directory: Path) -> list[str]:
    copied: list[str] = []
    wanted = [home / name for name in STATE_FILES] + [p for pattern in STATE_GLOBS for p in sorted(home.glob(pattern))]
    for path in wanted:
        if path.is_file():
            relative = path.relative_to(home)
            target = directory / "home" / relative
            private_dir(target.parent)
            shutil.copyfile(path, target)
            target.chmod(0o600)
            copied.append(str(relative))
    return copied


def copy_journal(journal_url: str, directory: Path) -> dict[str, Any]:
    """A consistent copy of a SQLite journal through SQLite's online backup API (the node keeps writing)."""
    file = sqlite_file(journal_url)
    if file is None:
        return {
            "kind": "postgresql",
            "copied": False,
            "do": "pg_dump --format=custom --file=journal.pgdump DATABASE, before this backup's streams were "
            "snapshotted (a dump taken later may hold events the snapshot does not)",
        }
    target = directory / "journal.db"
    with sqlite3.connect(f"file:{file}?mode=ro", uri=True, timeout=30) as source, sqlite3.connect(target) as copy:
        source.backup(copy)
        events = int(copy.execute("SELECT count(*) FROM events").fetchone()[0])
    target.chmod(0o600)
    return {"kind": "sqlite", "copied": True, "file": "journal.db", "events": events}


async def stream_names(nc: NatsClient) -> list[str]:
    async with nats_call("listing the streams"):
        infos = await nc.jetstream().streams_info()
    return sorted(info.config.name for info in infos if info.config.name)


async def snapshot_stream(nc: NatsClient, name: str, directory: Path) -> StreamCopy:
    """A JetStream snapshot of one stream (its messages, without consumers) into `directory/streams/`."""
    streams = directory / "streams"
    private_dir(streams)
    inbox = nc.new_inbox()
    target = streams / f"{name}.tar.s2"
    # Written as it arrives (a stream may be gigabytes); owner-only from the start.
    out = os.fdopen(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
    written = 0
    finished: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

    async def receive(msg: Msg) -> None:
        status = (msg.headers or {}).get("Status")
        if not msg.data:  # the end: 204, or the server's error
            if not finished.done():
                finished.set_result(None if status in (None, "204") else f"{status} {msg.headers}")
            return
        nonlocal written
        out.write(msg.data)
        written += len(msg.data)
        if msg.reply:
            await nc.publish(msg.reply, b"")  # flow control: the server sends more as chunks are acked

    subscription = await nc.subscribe(inbox, cb=receive)
    try:
        request = {"deliver_subject": inbox, "no_consumers": True, "chunk_size": CHUNK_BYTES}
        async with nats_call(f"snapshotting stream {name}"):
            reply = await nc.request(
                f"$JS.API.STREAM.SNAPSHOT.{name}", json.dumps(request).encode(), timeout=JS_TIMEOUT_S
            )
        answer = json.loads(reply.data)
        if "error" in answer:
            raise Unavailable("nats", f"snapshot of {name} refused: {answer['error'].get('description')}")
        async with asyncio.timeout(SNAPSHOT_TIMEOUT_S):
            failure = await finished
        if failure is not None:
            raise Unavailable("nats", f"snapshot of {name} failed: {failure}")
    finally:
        await subscription.unsubscribe()
        out.close()
    write_private(streams / f"{name}.json", json.dumps({"config": answer["config"], "state": answer["state"]}))
    state = answer["state"]
    return StreamCopy(
        name=name,
        messages=int(state.get("messages", 0)),
        bytes=int(state.get("bytes", 0)),
        first_seq=int(state.get("first_seq", 0)),
        last_seq=int(state.get("last_seq", 0)),
        snapshot_bytes=written,
    )


def require_new_directory(directory: Path) -> None:
    if directory.exists() and any(directory.iterdir()):
        raise ConfigError("DIR", f"{directory} is not empty: back up into a new directory")
    private_dir(directory)


async def backup(
    nc: NatsClient, home: Path, journal_url: str, directory: Path, *, progress: Callable[[str], None] | None = None
) -> Manifest:
    """Write a backup of the node under `home` into `directory` (made 0700; it must be empty or absent)."""
    await asyncio.to_thread(require_new_directory, directory)
    manifest = Manifest(FORMAT, datetime.now(UTC).isoformat(), str(home), journal={})
    manifest.state_files = copy_state_files(home, directory)
    if progress:
        progress("journal")
    manifest.journal = await asyncio.to_thread(copy_journal, journal_url, directory)
    for name in await stream_names(nc):  # after the journal: every event it holds is in the snapshot
        if progress:
            progress(f"stream {name}")
        manifest.streams.append(await snapshot_stream(nc, name, directory))
    manifest.write(directory)
    return manifest


# -- restore --------------------------------------------------------------------------------------------------


def require_fresh_home(home: Path) -> None:
    found = [str(mark) for mark in NODE_MARKS if (home / mark).exists()]
    if found:
        raise ConfigError(
            "--home",
            f"{home} already holds a node ({', '.join(found)}): restore goes onto a fresh home; choose another "
            "--home or move this one away",
        )


async def restore_stream(nc: NatsClient, directory: Path, copy: StreamCopy) -> int:
    """Restore one stream from its snapshot; returns the messages the server reports."""
    streams = directory / "streams"
    described = json.loads((streams / f"{copy.name}.json").read_text())
    async with nats_call(f"restoring stream {copy.name}"):
        reply = await nc.request(
            f"$JS.API.STREAM.RESTORE.{copy.name}", json.dumps(described).encode(), timeout=JS_TIMEOUT_S
        )
        answer = json.loads(reply.data)
        if "error" in answer:
            raise Unavailable("nats", f"restore of {copy.name} refused: {answer['error'].get('description')}")
        target = answer["deliver_subject"]
        with (streams / f"{copy.name}.tar.s2").open("rb") as snapshot:  # a chunk at a time, as it was written
            while chunk := snapshot.read(CHUNK_BYTES):
                await nc.request(target, chunk, timeout=JS_TIMEOUT_S)
        done = json.loads((await nc.request(target, b"", timeout=SNAPSHOT_TIMEOUT_S)).data)
    if "error" in done:
        raise Unavailable("nats", f"restore of {copy.name} failed: {done['error'].get('description')}")
    return int(done["state"]["messages"])


async def restore(directory: Path, home: Path, *, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Put a backup back onto a fresh `home`. Raises ConfigError (not a backup, not a fresh home)."""
    manifest = Manifest.read(directory)
    require_fresh_home(home)
    private_dir(home)
    for relative in manifest.state_files:
        target = home / relative
        private_dir(target.parent)
        shutil.copyfile(directory / "home" / relative, target)
        target.chmod(0o600)
    server = NatsServer(home / "nats", monitor_port=0)  # its own server, no clients but this one
    restored: dict[str, int] = {}
    await asyncio.to_thread(server.start)
    try:
        nc = await nats.connect(server.url, allow_reconnect=False)
        try:
            for copy in manifest.streams:
                if progress:
                    progress(f"stream {copy.name}")
                restored[copy.name] = await restore_stream(nc, directory, copy)
        finally:
            await nc.close()
    finally:
        await asyncio.to_thread(server.stop)
    if manifest.journal.get("copied"):
        shutil.copyfile(directory / "journal.db", home / "journal.db")
        (home / "journal.db").chmod(0o600)
    return {"home": str(home), "streams": restored, "journal": manifest.journal, "state_files": manifest.state_files}
