"""The edge store's engine process, for real: it answers as the store does, an engine that dies is started again
on the same files with nothing lost, one that keeps dying is reported instead of restarted in a loop, and it
never outlives the process that started it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from bus.errors import ModelMismatch, Unavailable
from observers.mirror import edge_process
from observers.mirror.edge_process import EdgeProcessVectorStore
from observers.mirror.store import Filter, Point
from tests.support import eventually, eventually_sync

MODEL, DIM = "test/model-4d", 4


def points(n: int, start: int = 0) -> list[Point]:
    return [
        Point(uuid.UUID(int=i + 1), [1.0, float(i), 0.5, 0.1], {"project": "p", "kind": "finding", "n": i})
        for i in range(start, start + n)
    ]


def engine_pid(store: EdgeProcessVectorStore) -> int:
    assert store._process is not None
    return store._process.pid


async def test_an_engine_killed_is_started_again_on_the_same_files_with_nothing_lost(tmp_path: Path) -> None:
    store = await EdgeProcessVectorStore.open(tmp_path / "m", MODEL, DIM, seal_points=5)
    try:
        await store.upsert(points(12))
        await store.settle()
        first = engine_pid(store)
        os.kill(first, signal.SIGKILL)  # what SIGBUS on a page the disk cannot back does to it
        await eventually(lambda: store._reading is not None and store._reading.done(), timeout_s=10)
        assert sorted(p.id.int for p in await store.retrieve([uuid.UUID(int=i + 1) for i in range(12)])) == list(
            range(1, 13)
        )
        assert engine_pid(store) != first
        assert store.restarts == 1
        await store.upsert(points(3, start=12))  # and it takes writes again
        hits = await store.search([1.0, 13.0, 0.5, 0.1], Filter(equals={"project": "p"}), limit=1)
        assert hits[0].id == uuid.UUID(int=14)
    finally:
        await store.close()
    assert not psutil.pid_exists(first)


async def test_an_engine_that_keeps_dying_is_reported_not_restarted_in_a_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(edge_process, "RESTARTS_PER_MINUTE", 1)
    store = await EdgeProcessVectorStore.open(tmp_path / "m", MODEL, DIM)
    try:
        await store.upsert(points(2))
        os.kill(engine_pid(store), signal.SIGKILL)
        assert (await store.describe()).count == 2  # the first death: started again
        os.kill(engine_pid(store), signal.SIGKILL)
        with pytest.raises(Unavailable, match="ended 2 times in a minute"):
            await store.describe()
    finally:
        await store.close()


async def test_the_engine_raises_the_stores_own_errors_and_a_closed_store_refuses_calls(tmp_path: Path) -> None:
    store = await EdgeProcessVectorStore.open(tmp_path / "m", MODEL, DIM)
    with pytest.raises(ModelMismatch, match="a 2-d vector"):
        await store.upsert([Point(uuid.uuid4(), [1.0, 2.0], {})])
    with pytest.raises(ValueError, match="needs a filter"):
        await store.set_payload(Filter(), {"trust": "verified"})
    pid = engine_pid(store)
    await store.close()
    await store.close()  # idempotent
    assert not psutil.pid_exists(pid)
    with pytest.raises(Unavailable, match="closed"):
        await store.describe()
    with pytest.raises(ModelMismatch):  # the error opening raises in the engine, raised here
        await EdgeProcessVectorStore.open(tmp_path / "m", "another/model", DIM)


OWNER = """
import asyncio, sys
from pathlib import Path
from observers.mirror.edge_process import EdgeProcessVectorStore

async def main() -> None:
    store = await EdgeProcessVectorStore.open(Path(sys.argv[1]), "test/model-4d", 4)
    print(store._process.pid, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_the_engine_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path / "m")], stdout=subprocess.PIPE, cwd=Path(__file__).parents[2]
    )
    try:
        assert owner.stdout is not None
        engine = int(owner.stdout.readline())
        assert psutil.Process(engine).ppid() == owner.pid
        owner.kill()  # kill -9: no cleanup runs in the owner
        owner.wait()
        eventually_sync(lambda: not psutil.pid_exists(engine) or psutil.Process(engine).status() == "zombie")
    finally:
        owner.kill()


async def test_calls_made_at_once_are_all_answered(tmp_path: Path) -> None:
    store = await EdgeProcessVectorStore.open(tmp_path / "m", MODEL, DIM, seal_points=7)
    try:
        await asyncio.gather(*(store.upsert(points(5, start=5 * i)) for i in range(6)))
        found = await asyncio.gather(
            *(store.search([1.0, float(i), 0.5, 0.1], Filter(equals={"project": "p"}), limit=3) for i in range(30))
        )
        assert all(len(hits) == 3 for hits in found)
        await store.settle()
        assert (await store.describe()).count == 30
        assert store.shard_states()["sealed"] >= 1  # the figures the engine sends with every answer
    finally:
        await store.close()


async def test_a_seal_that_ends_between_calls_reaches_the_node_without_a_call(tmp_path: Path) -> None:
    """Status and /metrics read the figures the engine last sent: a seal ending after the last write must still
    arrive, or a node that is not written to shows a frozen shard forever."""
    store = await EdgeProcessVectorStore.open(tmp_path / "m", MODEL, DIM, seal_points=5)
    try:
        await store.upsert(points(5))  # fills the hot shard: it is frozen, and a worker seals it
        assert store.seals.sealed == 0
        await eventually(lambda: store.seals.sealed == 1 and store.shard_states()["frozen"] == 0, timeout_s=60)
        assert store.shard_states() == {"hot": 1, "frozen": 0, "sealed": 1, "outdated": 0}
    finally:
        await store.close()
