"""One vector-store suite, every backend: each case runs on qdrant-edge (one hot shard, and shards sealed
every three points), qdrant-client's local mode (a collection of the current layout, and one of the old layout
with vectors and payload in RAM, as a store opens it for `epibus mirror migrate`) and, where a Docker engine
answers, a real Qdrant server."""

from __future__ import annotations

import contextlib
import itertools
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from bus.errors import ConfigError, ModelMismatch, Unavailable
from bus.model.ids import new_event_id, point_id
from observers.mirror.backends import open_store
from observers.mirror.edge_process import EdgeProcessVectorStore
from observers.mirror.server import DEFAULT_COLLECTION, LAYOUT, ServerVectorStore
from observers.mirror.store import Filter, Point, VectorStore

DIM = 8
MODEL = "test/model-8d"
# Opens the collection of the fixture's store again, for another model id and dimension.
Reopen = Callable[[str, int], Awaitable[VectorStore]]


def docker_engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0


def create_old_layout(path: Path, model_id: str, dimension: int) -> None:
    """An empty collection as epibus created it before the int8 layout: vectors in RAM, no layout recorded."""
    from qdrant_client import QdrantClient, models

    client = QdrantClient(path=str(path))
    try:
        client.create_collection(
            "epibus-old",
            vectors_config=models.VectorParams(size=dimension, distance=models.Distance.COSINE),
            metadata={"model_id": model_id, "dimension": dimension, "store_id": "old-store"},
        )
        alias = models.CreateAlias(collection_name="epibus-old", alias_name=DEFAULT_COLLECTION)
        client.update_collection_aliases(change_aliases_operations=[models.CreateAliasOperation(create_alias=alias)])
    finally:
        client.close()


@pytest.fixture(params=["edge", "edge-sealed", "server-local", "server-local-old", "server-docker"])
async def store_and_reopen(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[VectorStore, Reopen]]:
    """(store, reopen) where reopen(model_id, dim) opens the same collection again (None if not possible)."""
    kind = request.param
    with contextlib.ExitStack() as stack:
        if kind == "server-docker":
            if not docker_engine_answers():
                pytest.skip("no Docker engine: the real Qdrant server case runs only where `docker info` answers")
            from testcontainers.qdrant import QdrantContainer

            container = QdrantContainer("qdrant/qdrant:v1.13.0")
            container.start()
            stack.callback(container.stop)  # stopped last, after the store is closed, and if the setup fails
            location: str = f"http://{container.get_container_host_ip()}:{container.exposed_rest_port}"
            backend = "server"
        elif kind.startswith("edge"):
            location, backend = str(tmp_path / "edge"), "edge"
        else:
            location, backend = str(tmp_path / "local"), "server"
        if kind == "edge-sealed":  # every few points a shard is sealed by a worker while the case goes on
            store: VectorStore = await EdgeProcessVectorStore.open(Path(location), MODEL, DIM, seal_points=3)
        elif kind == "server-local-old":
            create_old_layout(Path(location), MODEL, DIM)
            store = await ServerVectorStore.open(location, MODEL, DIM, old_layout_ok=True)
        else:
            store = await open_store(backend, location, MODEL, DIM)

        async def reopen(model_id: str, dimension: int) -> VectorStore:
            await store.close()
            if kind == "server-local-old":
                return await ServerVectorStore.open(location, model_id, dimension, old_layout_ok=True)
            return await open_store(backend, location, model_id, dimension)

        yield store, reopen
        await store.close()


def vector(seed: int) -> list[float]:
    import math

    raw = [math.sin(seed * (i + 1)) + 1.1 for i in range(DIM)]
    norm = math.sqrt(sum(x * x for x in raw))
    return [x / norm for x in raw]


def point(seed: int, **payload: object) -> tuple[uuid.UUID, Point]:
    event_id = new_event_id()
    base = {"event_id": str(event_id), "project": "p", "kind": "finding", "trust": "unverified", "impact": 0.5}
    return event_id, Point(point_id(event_id), vector(seed), base | payload)


async def test_point_ids_are_proven_against_storage(store_and_reopen: tuple[VectorStore, Reopen]) -> None:
    store, _ = store_and_reopen
    event_id, p = point(1)
    await store.upsert([p])
    (found,) = await store.retrieve([point_id(event_id)])  # the id is derived again, not remembered
    assert found.id == point_id(event_id)
    assert found.payload["event_id"] == str(event_id)
    assert (found.payload["model_id"], found.payload["dimension"]) == (MODEL, DIM)  # recorded on every point
    assert (await store.describe()).count == 1


async def test_reembedding_never_duplicates_a_point(
    store_and_reopen: tuple[VectorStore, Reopen],
) -> None:  # re-embedding must never duplicate a point
    store, _ = store_and_reopen
    event_id, p = point(2)
    for _ in range(3):
        await store.upsert([p])
    await store.upsert([Point(point_id(event_id), vector(3), {**p.payload, "trust": "verified"})])
    assert (await store.describe()).count == 1
    (found,) = await store.retrieve([point_id(event_id)])
    assert found.payload["trust"] == "verified"
    assert await store.point_ids() == [point_id(event_id)]


async def test_delete_is_proven_by_reading_back(
    store_and_reopen: tuple[VectorStore, Reopen],
) -> None:  # a delete that reports success is not proof
    store, _ = store_and_reopen
    kept, gone = point(4), point(5)
    await store.upsert([kept[1], gone[1]])
    await store.delete([point_id(gone[0]), uuid.uuid4()])  # an absent id is not an error
    assert await store.retrieve([point_id(gone[0])]) == []
    assert [p.id for p in await store.retrieve([point_id(kept[0])])] == [point_id(kept[0])]
    assert (await store.describe()).count == 1
    hits = await store.search(vector(5), Filter(), limit=10)
    assert point_id(gone[0]) not in {h.id for h in hits}


async def test_search_filters_and_ranks(store_and_reopen: tuple[VectorStore, Reopen]) -> None:
    store, _ = store_and_reopen
    points = [
        point(i, project="p" if i % 2 else "q", trust="verified" if i % 3 else "contradicted") for i in range(1, 13)
    ]
    await store.upsert([p for _, p in points])
    hits = await store.search(vector(5), Filter(equals={"project": "p"}, none_of={"trust": ["contradicted"]}), limit=20)
    expected = {p.id for _, p in points if p.payload["project"] == "p" and p.payload["trust"] != "contradicted"}
    assert {h.id for h in hits} == expected
    assert hits[0].id == points[4][1].id  # the query vector is point 5's own
    assert all(a.score >= b.score for a, b in itertools.pairwise(hits))
    anyof = await store.search(vector(1), Filter(any_of={"trust": ["contradicted"]}), limit=20)
    assert {h.payload["trust"] for h in anyof} == {"contradicted"}
    low = await store.search(vector(1), Filter(at_most={"impact": 0.4}), limit=20)
    assert low == []  # every point has impact 0.5
    assert len(await store.search(vector(1), Filter(at_most={"impact": 0.5}), limit=20)) == len(points)


async def test_boolean_filters_are_refused_not_silently_empty(store_and_reopen: tuple[VectorStore, Reopen]) -> None:
    store, _ = store_and_reopen
    with pytest.raises(ValueError, match="boolean"):
        await store.search(vector(1), Filter(equals={"forgotten": False}), limit=3)


async def test_nothing_matched_is_an_empty_list(store_and_reopen: tuple[VectorStore, Reopen]) -> None:
    store, _ = store_and_reopen
    assert await store.search(vector(1), Filter(equals={"project": "nobody"}), limit=5) == []


async def test_a_status_change_reaches_the_payload(
    store_and_reopen: tuple[VectorStore, Reopen],
) -> None:  # or safe recall shows a retracted item
    store, _ = store_and_reopen
    target, other = point(6, artifact_id="a1"), point(7, artifact_id="a2")
    await store.upsert([target[1], other[1]])
    await store.set_payload(Filter(equals={"artifact_id": "a1"}), {"trust": "rolled_back", "lifecycle": "active"})
    (found,) = await store.retrieve([point_id(target[0])])
    assert found.payload["trust"] == "rolled_back"
    assert found.payload["impact"] == 0.5
    (untouched,) = await store.retrieve([point_id(other[0])])
    assert untouched.payload["trust"] == "unverified"
    with pytest.raises(ValueError, match="needs a filter"):
        await store.set_payload(Filter(), {"trust": "x"})


async def test_model_mismatch_is_refused(
    store_and_reopen: tuple[VectorStore, Reopen],
) -> None:  # never mix vectors of two models
    store, reopen = store_and_reopen
    with pytest.raises(ModelMismatch, match="5-d"):
        await store.upsert([Point(uuid.uuid4(), [0.1] * 5, {})])
    with pytest.raises(ModelMismatch):
        await store.search([0.1] * 5, Filter(), limit=1)
    with pytest.raises(ModelMismatch, match="test/model-8d"):
        await reopen("other/model", DIM)
    with pytest.raises(ModelMismatch):
        await reopen(MODEL, DIM * 2)


async def test_points_survive_reopening(store_and_reopen: tuple[VectorStore, Reopen]) -> None:
    store, reopen = store_and_reopen
    event_id, p = point(8)
    await store.upsert([p])
    again = await reopen(MODEL, DIM)
    try:
        assert [x.id for x in await again.retrieve([point_id(event_id)])] == [point_id(event_id)]
    finally:
        await again.close()


async def test_outage_is_not_an_empty_result(
    store_and_reopen: tuple[VectorStore, Reopen],
) -> None:  # broken must not look like no matches
    store, _ = store_and_reopen
    await store.close()
    with pytest.raises(Unavailable):
        await store.search(vector(1), Filter(), limit=3)


async def test_an_unknown_backend_lists_the_allowed_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="allowed: edge, server"):
        await open_store("faiss", tmp_path, MODEL, DIM)


async def test_migrating_keeps_every_point_its_payload_and_its_id(
    store_and_reopen: tuple[VectorStore, Reopen],
) -> None:
    store, _ = store_and_reopen
    assert isinstance(store, EdgeProcessVectorStore | ServerVectorStore)
    made = dict(point(40 + i, subject=f"s{i}", impact=i / 10) for i in range(7))
    await store.upsert(list(made.values()))
    if isinstance(store, ServerVectorStore):  # the old layout is copied whole; the current one is left as it is
        expected = 0 if store.layout == LAYOUT else 7
        assert await store.migrate() == expected
        assert store.layout == LAYOUT
    else:  # an edge mirror seals the points it searched from RAM: none is left unsealed
        unsealed = sum(s["points"] for s in await store.shard_layout() if not s["sealed"])
        assert await store.migrate() == unsealed
        assert sum(s["points"] for s in await store.shard_layout() if not s["sealed"]) == 0
    assert await store.migrate() == 0  # nothing is left to move
    found = {p.id: p for p in await store.retrieve([point_id(e) for e in made])}
    assert sorted(found) == sorted(point_id(e) for e in made)  # read back by the ids derived again
    for event_id, before in made.items():
        after = found[point_id(event_id)]
        assert after.payload == {**before.payload, "model_id": MODEL, "dimension": DIM}
        # an edge mirror's sealed shards keep original vectors as float16 (3 significant digits)
        assert after.vector == pytest.approx(before.vector, abs=1e-3)
    assert (await store.describe()).count == 7
    for event_id, before in made.items():  # still searchable by meaning
        (top,) = await store.search(before.vector, Filter(equals={"project": "p"}), limit=1)
        assert top.id == point_id(event_id)
