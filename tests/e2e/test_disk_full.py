"""A full disk is a state, not a crash. A node whose home is a small filesystem made here (tmpfs: CI runs as
root) is filled by publishing until it is below its reserve: the node stays up (no store writes into the reserve,
so qdrant-edge never meets a page it cannot back), it takes no more publishes (an agent is told the disk may be
full; a publish through the outbox on that disk gets one line naming the path and the free space), reads answer
and `health` names the full disk; once the filesystem grows, publishes are taken again and every acknowledged
event reaches the journal and the mirror by itself. A start on a full disk is refused in one line."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.client.client import connect
from bus.errors import EpibusError, Forbidden, Unavailable
from bus.identity.signing import AgentKey
from bus.model.vocab import Role
from tests.conftest import finding
from tests.support import (
    enrol_agent,
    eventually_sync,
    last_json,
    run_epibus,
    start_node_process,
    stop_node_process,
)

pytestmark = pytest.mark.slow
MIB = 1024 * 1024
RESERVE_MB = 64
DISK_MB = 400
ROOM_MB = 16  # free above the reserve when the node starts: the stream may take half of it
NODE_ENV = {"EPIBUS_DISK_RESERVE_MB": str(RESERVE_MB)}
# JetStream reserves them on a 400 MB disk
SMALL_STREAMS = ("--events-max-gib", "0.1", "--dlq-max-mib", "8", "--vectors-max-mib", "16", "--notices-max-mib", "8")


@contextlib.contextmanager
def small_disk(path: Path, size_mb: int) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    assert mounted.returncode == 0, f"this test mounts a small tmpfs and needs root: {mounted.stderr}"
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def resize(path: Path, size_mb: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size_mb}m", str(path)], check=True)


def free_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def fill_to(disk: Path, free: int) -> None:
    """Take space with a ballast file until `free` bytes are left (never gives any back)."""
    take = free_bytes(disk) - free
    if take > 0:
        index = len(list(disk.glob("ballast-*")))
        fd = os.open(disk / f"ballast-{index}", os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            os.posix_fallocate(fd, 0, take)
        finally:
            os.close(fd)


def disk_use(disk: Path) -> str:
    """What fills the disk, per directory: a failure says which store grew."""
    du = subprocess.run(["du", "-m", "-d", "3", str(disk)], capture_output=True, text=True)
    df = subprocess.run(["df", "-m", str(disk)], capture_output=True, text=True)
    return f"\n{df.stdout}{du.stdout}"


def health(home: Path) -> subprocess.CompletedProcess[str]:
    return run_epibus(home, "health", check=False)


async def test_a_full_disk_refuses_publishes_keeps_reads_and_resumes_when_space_returns(
    tmp_path: Path, project: str
) -> None:
    with small_disk(tmp_path / "disk", DISK_MB) as disk:
        home = disk / "home"
        process, status = start_node_process(home, *SMALL_STREAMS, env=NODE_ENV)
        fill_to(disk, (RESERVE_MB + ROOM_MB) * MIB)
        try:
            url = status["nats_url"]
            await enrol_agent(
                url, home, AgentKey.load_or_create(home, "filler"), roles=[Role.agent], projects=[project]
            )
            acked: list[str] = []
            refusal: EpibusError | None = None
            async with connect(url, agent="filler", home=home, outbox=False) as client:
                for batch in range(1200):  # 60,000 events: far more than the disk takes; under the publish budget
                    events = [client.event("finding", finding(batch * 50 + i), project=project) for i in range(50)]
                    try:
                        receipts = await client.publish_many(events, timeout_s=30)
                    except (Unavailable, Forbidden) as e:
                        refusal = e
                        break
                    acked += [str(r.event_id) for r in receipts if r.level == "published"]
                    await asyncio.sleep(0.2)
            assert refusal is not None, f"{len(acked)} events published and none refused"
            assert isinstance(refusal, Forbidden), refusal
            assert "disk is full" in str(refusal)
            assert "epibus health" in str(refusal)
            # Many were taken first; how many varies: the stores grow in steps (JetStream's blocks, the mirror's
            # 32 MiB pages), and the node sees the disk every 5 s. 1,000 exactly was seen.
            assert len(acked) >= 500
            outboxed = run_epibus(home, "publish", "finding", "-p", project, "--text", "one more", "--impact", "0.1",
                                  "--confidence", "0.1", "--subject", "s", check=False)  # fmt: skip
            assert outboxed.returncode == 1
            assert outboxed.stderr.count("\n") == 1, outboxed.stderr
            assert f"disk full: {disk}" in outboxed.stderr
            assert "MiB free" in outboxed.stderr

            down = health(home)
            assert down.returncode == 1
            assert "disk full" in down.stdout + down.stderr
            assert process.poll() is None  # up, not killed by a page it could not write
            newest = last_json(run_epibus(home, "events", "-p", project, "--limit", "1", "--json"))
            assert newest[0]["event_id"] in acked  # reads answer
            found = run_epibus(home, "recall", "finding number 7", "-p", project, "--json")
            assert found.returncode == 0

            resize(disk, DISK_MB + 300)

            def reconciled() -> dict[str, object] | None:
                report = last_json(run_epibus(home, "reconcile", "-p", project, "--json", check=False))
                (node_report,) = report["nodes"]
                return node_report if node_report["clean"] and node_report["stream_events"] == len(acked) else None

            eventually_sync(reconciled, timeout_s=120, interval_s=2)
            # The node measures its disk every few seconds and its observers retry on their own clock: healthy
            # again by itself, soon.
            last = health(home)
            for _ in range(30):
                if last.returncode == 0:
                    break
                await asyncio.sleep(1)
                last = health(home)
            assert last.returncode == 0, f"{last.stdout}{last.stderr}{disk_use(disk)}"
            assert process.poll() is None
        finally:
            stop_node_process(process)

        fill_to(disk, (RESERVE_MB - 8) * MIB)
        refused = run_epibus(home, "up", *SMALL_STREAMS, check=False, timeout_s=60)
        assert refused.returncode == 1
        assert refused.stderr.count("\n") == 1, refused.stderr
        assert f"disk full: {disk}" in refused.stderr

        for ballast in disk.glob("ballast-*"):
            ballast.unlink()
        too_large = run_epibus(disk / "home2", "up", check=False, timeout_s=60)  # 8 GiB of streams on 400 MB
        assert too_large.returncode == 1
        assert too_large.stderr.count("\n") == 1, too_large.stderr
        assert "lower `epibus up --events-max-gib`" in too_large.stderr
