"""The edge mirror's shards: a full hot shard is sealed by a worker process while the store keeps answering;
a write made during a seal reaches the sealed copy; search over sealed shards finds what exact search finds; a
process killed mid-seal, an old single-shard mirror and a forget's compaction all leave every point where it
belongs, and nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import qdrant_edge as qe

from observers.mirror.edge import MAX_FROZEN, EdgeVectorStore
from observers.mirror.seal import LAYOUT, create_shard
from observers.mirror.shards import EXPORTS, LEGACY_SHARD, MANIFEST, MERGE_FAN
from observers.mirror.store import Filter, Point
from tests.support import eventually

# Sealed shards keep original vectors as float16: a value read back within this, a cosine within the next.
FLOAT16 = 1e-3
FLOAT16_TIE = 2e-3

DIM = 16
MODEL = "test/model-16d"


def unit_vectors(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(6, DIM))
    v = centers[rng.integers(0, 6, n)] + 0.4 * rng.normal(size=(n, DIM))
    unit: np.ndarray = (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)
    return unit


@contextlib.asynccontextmanager
async def opened(path: Path, *, seal_points: int) -> AsyncIterator[EdgeVectorStore]:
    store = await EdgeVectorStore.open(path, MODEL, DIM, seal_points=seal_points)
    try:
        yield store
    finally:
        await store.close()


def points(vectors: np.ndarray, *, start: int = 0) -> list[Point]:
    return [
        Point(
            uuid.UUID(int=start + i + 1),
            [float(x) for x in vector],
            {"project": f"p{(start + i) % 3}", "trust": "unverified", "kind": "finding", "text": f"claim {start + i}"},
        )
        for i, vector in enumerate(vectors)
    ]


async def test_full_hot_shards_are_sealed_merged_by_four_and_search_finds_what_exact_search_finds(
    tmp_path: Path,
) -> None:
    async with opened(tmp_path / "m", seal_points=50) as store:
        vectors = unit_vectors(230, seed=1)
        made = points(vectors)
        for start in range(0, len(made), 25):
            await store.upsert(made[start : start + 25])
        await store.optimize()
        layout = await store.shard_layout()
        assert [s["sealed"] for s in layout[:-1]] == [True] * (len(layout) - 1)
        assert [s["points"] for s in layout] == [200, 30, 0]  # four sealed shards of 50 became one
        assert store.seals.sealed == 6  # five hot shards sealed, one merge
        assert sum(s["points"] for s in layout) == 230 == (await store.describe()).count
        assert {p.id for p in await store.retrieve([p.id for p in made])} == {p.id for p in made}
        in_p1 = np.array([i for i in range(230) if i % 3 == 1])
        for query in unit_vectors(20, seed=2):
            hits = await store.search([float(x) for x in query], Filter(equals={"project": "p1"}), limit=5)
            exact = in_p1[np.argsort(-(vectors[in_p1] @ query))[:5]]
            # Sealed shards rescore on float16 originals: a near tie may swap two hits, never lose a better one.
            found = [float(vectors[h.id.int - 1] @ query) for h in hits]
            assert found == pytest.approx([float(vectors[i] @ query) for i in exact], abs=FLOAT16_TIE)
            assert all(h.payload["project"] == "p1" for h in hits)


async def test_a_write_made_while_a_shard_is_sealed_reaches_the_sealed_copy(tmp_path: Path) -> None:
    async with opened(tmp_path / "m", seal_points=40) as store:
        made = points(unit_vectors(40, seed=3))
        await store.upsert(made)  # the hot shard is full: frozen, and its seal starts
        await eventually(lambda: store.shards.exports, interval_s=0.002)  # its points are being copied out
        await store.set_payload(Filter(equals={"text": "claim 1"}), {"trust": "contradicted"})
        await store.delete([made[2].id])
        moved = [float(x) for x in unit_vectors(1, seed=4)[0]]
        await store.upsert([Point(made[3].id, moved, made[3].payload)])
        await store.optimize()
        assert store.seals.replayed_writes == 3
        assert [s["sealed"] for s in await store.shard_layout()] == [True, False]
        kept = {p.id: p for p in await store.retrieve([p.id for p in made])}
        assert kept[made[1].id].payload["trust"] == "contradicted"
        assert made[2].id not in kept
        assert np.allclose(kept[made[3].id].vector, moved, atol=FLOAT16)
        assert (await store.describe()).count == 39


async def test_reembedding_a_sealed_point_overwrites_it_where_it_lives(tmp_path: Path) -> None:
    async with opened(tmp_path / "m", seal_points=20) as store:
        made = points(unit_vectors(30, seed=5))
        await store.upsert(made)
        await store.optimize()
        again = points(unit_vectors(30, seed=6))  # the same ids, new vectors
        await store.upsert(again)
        assert (await store.describe()).count == 30
        kept = {p.id: p for p in await store.retrieve([p.id for p in again])}
        assert all(np.allclose(kept[p.id].vector, p.vector, atol=FLOAT16) for p in again)


async def old_layout_mirror(path: Path, made: list[Point]) -> None:
    """A mirror whose sealed shards were built in layout 1 (float32 originals, a write-ahead log, every index)."""
    store = await EdgeVectorStore.open(path, MODEL, DIM, seal_points=40, layout=1)
    try:
        for start in range(0, len(made), 40):  # 130 points: three full hot shards sealed, 10 stay hot
            await store.upsert(made[start : start + 40])
            await store.settle()
        assert [s["sealed"] for s in await store.shard_layout()] == [True, True, True, False]
    finally:
        await store.close()


async def test_an_old_layout_is_reported_migrated_and_keeps_every_point_its_payload_and_its_id(
    tmp_path: Path,
) -> None:
    vectors = unit_vectors(130, seed=11)
    made = points(vectors)
    await old_layout_mirror(tmp_path / "m", made)
    manifest = json.loads((tmp_path / "m" / MANIFEST).read_text())
    assert {s.get("layout") for s in manifest["shards"] if s["sealed"]} == {1}
    store = EdgeVectorStore(tmp_path / "m", MODEL, DIM, seal_points=40)
    await store._call(store._open)  # opened without starting the background rebuild: the report is seen
    try:
        assert store.shard_states()["outdated"] == 3  # three sealed shards of 40, never silently mixed
        before = [await store.search(list(v), Filter(equals={"project": "p1"}), limit=5) for v in vectors[:12]]
        assert await store.migrate() == 130  # the three old shards rebuilt, the hot one's ten sealed
        assert store.shard_states()["outdated"] == 0
        assert await store.migrate() == 0
    finally:
        await store.close()
    manifest = json.loads((tmp_path / "m" / MANIFEST).read_text())
    assert {s["layout"] for s in manifest["shards"] if s["sealed"]} == {LAYOUT}
    async with opened(tmp_path / "m", seal_points=40) as store:  # a restart on the migrated store
        kept = {p.id: p for p in await store.retrieve([p.id for p in made])}
        assert sorted(kept) == sorted(p.id for p in made)
        for p in made:
            assert kept[p.id].payload == {**p.payload, "model_id": MODEL, "dimension": DIM}
            assert np.allclose(kept[p.id].vector, p.vector, atol=FLOAT16)
        after = [await store.search(list(v), Filter(equals={"project": "p1"}), limit=5) for v in vectors[:12]]
    for old, new in zip(before, after, strict=True):  # recall answers as it did before the migration
        assert [h.score for h in new] == pytest.approx([h.score for h in old], abs=FLOAT16_TIE)
        assert new[0].id == old[0].id


async def test_a_sealed_shard_without_a_log_keeps_its_writes_across_a_kill(tmp_path: Path) -> None:
    made = points(unit_vectors(60, seed=12))
    async with opened(tmp_path / "m", seal_points=40) as store:
        await store.upsert(made)
        await store.optimize()
    script = KILLED_AFTER_WRITES.format(path=str(tmp_path / "m"), gone=str(made[2].id))
    killed = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stderr=subprocess.PIPE)
    _, said = await asyncio.wait_for(killed.communicate(), timeout=120)
    assert killed.returncode == -signal.SIGKILL, said.decode()[-2000:]
    async with opened(tmp_path / "m", seal_points=40) as store:
        kept = {p.id: p for p in await store.retrieve([p.id for p in made])}
        assert kept[made[1].id].payload["trust"] == "contradicted"
        assert made[2].id not in kept
        assert len(kept) == 59


KILLED_AFTER_WRITES = """
import asyncio, os, signal, uuid
from pathlib import Path
from observers.mirror.edge import EdgeVectorStore
from observers.mirror.store import Filter

async def main() -> None:
    store = await EdgeVectorStore.open(Path("{path}"), "test/model-16d", 16, seal_points=40)
    assert [s["sealed"] for s in await store.shard_layout()] == [True, False]
    await store.set_payload(Filter(equals={{"text": "claim 1"}}), {{"trust": "contradicted"}})
    await store.delete([uuid.UUID("{gone}")])
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush of our own: what the store answered is on disk

asyncio.run(main())
"""


KILLED_MID_SEAL = """
import asyncio, os, signal, sys, uuid
from observers.mirror.edge import MAX_FROZEN, EdgeVectorStore
from observers.mirror.store import Point

async def main() -> None:
    store = await EdgeVectorStore.open(__import__("pathlib").Path(sys.argv[1]), "test/model-16d", 16, seal_points=30)
    await store.upsert([Point(uuid.UUID(int=i + 1), [1.0] + [i / 60] * 15, {"project": "p"}) for i in range(60)])
    while store._sealing is not None and not store._sealing.done() and not list(store.path.glob("build-*")):
        await asyncio.sleep(0.01)
    print("sealing", flush=True)
    await asyncio.sleep(0.3)  # the worker is building
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


async def test_a_process_killed_mid_seal_leaves_every_point_and_no_worker(tmp_path: Path) -> None:
    path = tmp_path / "m"
    killed = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", KILLED_MID_SEAL, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "sealing" in killed.stdout
    for _ in range(100):  # the worker gets the parent-death signal
        workers = [p for p in psutil.process_iter(["cmdline"]) if str(path) in " ".join(p.info["cmdline"] or [])]
        if not workers:
            break
        await asyncio.sleep(0.05)
    assert workers == []
    async with opened(path, seal_points=30) as store:
        assert (await store.describe()).count == 60
        await store.optimize()
        assert {p.id for p in await store.retrieve([uuid.UUID(int=i + 1) for i in range(60)])} == {
            uuid.UUID(int=i + 1) for i in range(60)
        }
        listed = {s["name"] for s in json.loads((path / MANIFEST).read_text())["shards"]}
        on_disk = {p.name for p in path.iterdir() if p.is_dir()} - {EXPORTS}
        assert on_disk == listed  # no unfinished build, no frozen shard left beside its sealed copy
        assert list((path / EXPORTS).iterdir()) == []


def write_legacy_mirror(path: Path, old: list[Point]) -> list[Point]:
    """A mirror as epibus wrote it before sealed shards: every point in one shard. Returns the points."""
    path.mkdir()
    legacy = create_shard(path / LEGACY_SHARD, DIM, sealed=False)
    legacy.update(qe.UpdateOperation.upsert_points([qe.Point(str(p.id), list(p.vector), dict(p.payload)) for p in old]))
    legacy.flush()
    legacy.close()
    (path / "collection.json").write_text(json.dumps({"model_id": MODEL, "dimension": DIM, "store_id": "old"}))
    return old


async def test_an_old_single_shard_mirror_opens_with_its_points_and_takes_new_ones(tmp_path: Path) -> None:
    path = tmp_path / "m"
    old = write_legacy_mirror(path, points(unit_vectors(12, seed=7)))
    async with opened(path, seal_points=20) as store:
        assert (await store.describe()).count == 12
        await store.upsert(points(unit_vectors(12, seed=8), start=100))
        await store.optimize()
        assert (await store.describe()).count == 24
        assert not (path / LEGACY_SHARD).exists()  # sealed, and listed under its new name
        hits = await store.search(old[0].vector, Filter(equals={"project": old[0].payload["project"]}), limit=1)
        assert [h.id for h in hits] == [old[0].id]


async def test_an_old_mirror_past_the_seal_size_is_sealed_at_open_with_every_point_its_payload_and_id(
    tmp_path: Path,
) -> None:
    """A mirror from before sealed shards held every point in one shard, in RAM: it is moved to sealed shards
    when it opens, with no write to set it off, and `migrate` seals whatever is left in RAM on demand."""
    path = tmp_path / "m"
    old = write_legacy_mirror(path, points(unit_vectors(45, seed=11)))
    async with opened(path, seal_points=20) as store:
        await store.settle()
        assert [(s["sealed"], s["points"]) for s in await store.shard_layout()] == [(True, 45), (False, 0)]
        kept = {p.id: p for p in await store.retrieve([p.id for p in old])}
        assert {i: (p.payload["text"], p.payload["project"]) for i, p in kept.items()} == {
            p.id: (p.payload["text"], p.payload["project"]) for p in old
        }
        assert all(np.allclose(kept[p.id].vector, p.vector, atol=FLOAT16) for p in old)
        await store.upsert(points(unit_vectors(5, seed=12), start=100))
        assert await store.migrate() == 5
        assert [s["sealed"] for s in await store.shard_layout()] == [True, True, False]
        assert await store.migrate() == 0  # nothing left in RAM: nothing moves
    assert not (path / LEGACY_SHARD).exists()


async def test_compaction_leaves_no_byte_of_a_deleted_point_in_any_shard(tmp_path: Path) -> None:
    path = tmp_path / "m"
    store = await EdgeVectorStore.open(path, MODEL, DIM, seal_points=20)
    marker = "a-secret-that-must-go-" + uuid.uuid4().hex
    try:
        made = points(unit_vectors(50, seed=9))
        made[5] = Point(made[5].id, made[5].vector, {**made[5].payload, "text": marker})
        made[45] = Point(made[45].id, made[45].vector, {**made[45].payload, "text": marker + "-hot"})
        await store.upsert(made[:40])
        await store.optimize()
        await store.upsert(made[40:])  # these stay in the hot shard
        assert [s["sealed"] for s in await store.shard_layout()] == [True, False]
        await store.delete([made[5].id, made[45].id])
        assert await store.compact() == 48
        assert await store.retrieve([made[5].id, made[45].id]) == []
    finally:
        await store.close()
    holding = [f for f in path.rglob("*") if f.is_file() and marker.encode() in f.read_bytes()]
    assert holding == []


async def test_the_store_answers_while_a_worker_seals(tmp_path: Path) -> None:
    async with opened(tmp_path / "m", seal_points=30) as store:
        made = points(unit_vectors(30, seed=10))
        await store.upsert(made)
        answered = 0
        while store._sealing is not None and not store._sealing.done():
            hits = await store.search(made[0].vector, Filter(equals={"project": "p0"}), limit=1)
            assert [h.id for h in hits] == [made[0].id]
            answered += 1
            await asyncio.sleep(0.01)
        assert answered > 0
        assert store.seals.sealed == 1


def test_the_worker_is_our_own_interpreter_and_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "observers.mirror.seal"], capture_output=True, text=True, env=dict(os.environ)
    )
    assert done.returncode == 1
    assert "usage: python -m observers.mirror.seal POINTS_DIR TARGET_DIR" in done.stderr


@pytest.mark.slow  # a dozen seals by worker processes
async def test_a_writer_faster_than_the_seals_is_held_so_frozen_shards_and_shard_count_stay_bounded(
    tmp_path: Path,
) -> None:
    vectors = unit_vectors(240, seed=11)
    async with opened(tmp_path / "m", seal_points=20) as store:
        most_frozen = 0
        for start in range(0, 240, 20):  # each write fills a hot shard: far faster than a worker seals one
            await store.upsert(points(vectors[start : start + 20], start=start))
            most_frozen = max(most_frozen, len(store.shards.frozen()))
        await store.settle()
        layout = await store.shard_layout()
        assert most_frozen < MAX_FROZEN  # each write returned with fewer shards waiting than the limit
        assert store.seals.writes_held_s > 0
        # 12 hot shards' points: merged by four as they came, so no tier holds MERGE_FAN sealed shards
        sealed_sizes = sorted(s["points"] for s in layout if s["sealed"])
        assert all(sealed_sizes.count(size) < MERGE_FAN for size in set(sealed_sizes)), layout
        assert sum(s["points"] for s in layout) == 240
        assert sorted(p.id.int for p in await store.retrieve([uuid.UUID(int=i + 1) for i in range(240)])) == list(
            range(1, 241)
        )
