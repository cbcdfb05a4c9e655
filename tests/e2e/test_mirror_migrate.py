"""A node's Qdrant collection from before the int8 layout: the node refuses to run it (never half one layout,
half the other), `epibus mirror migrate` copies it over keeping every point, and the node restarted on the
migrated collection answers recall as it did before. The same for an edge mirror whose sealed shards are of an
older layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from qdrant_client import QdrantClient, models

from bus.client.client import connect
from bus.errors import ConfigError
from bus.host.server import NatsServer
from bus.model.vocab import ReceiptLevel
from epibus.node.node import Node, NodeConfig
from observers.mirror.edge import EdgeVectorStore
from observers.mirror.seal import LAYOUT as SEALED_LAYOUT
from observers.mirror.server import DEFAULT_COLLECTION, LAYOUT
from observers.mirror.shards import MANIFEST
from tests.conftest import finding
from tests.support import run_epibus

TEXTS = ["the cache is cold after every deploy", "dns lookups flap under load", "disks fill up at night"]
QUERIES = ["deploys leave the cache empty", "name resolution is unstable when busy", "storage runs out overnight"]


def collection_points(path: Path) -> dict[str, tuple[list[float], dict[str, Any]]]:
    """Every point of the aliased collection, read with qdrant-client directly (not through epibus)."""
    client = QdrantClient(path=str(path))
    try:
        records, _ = client.scroll(DEFAULT_COLLECTION, limit=1000, with_payload=True, with_vectors=True)
        return {str(r.id): (list(r.vector), dict(r.payload or {})) for r in records}  # type: ignore[arg-type]
    finally:
        client.close()


def make_old_layout(path: Path) -> None:
    """Rewrite the collection as one created before the int8 layout: vectors in RAM, no layout recorded."""
    client = QdrantClient(path=str(path))
    try:
        real = {a.alias_name: a.collection_name for a in client.get_aliases().aliases}[DEFAULT_COLLECTION]
        meta = dict(client.get_collection(real).config.metadata or {})
        records, _ = client.scroll(real, limit=1000, with_payload=True, with_vectors=True)
        old = f"{DEFAULT_COLLECTION}-old"
        client.create_collection(
            old,
            vectors_config=models.VectorParams(size=int(meta["dimension"]), distance=models.Distance.COSINE),
            metadata={k: v for k, v in meta.items() if k != "layout"},
        )
        client.upsert(old, [models.PointStruct(id=r.id, vector=r.vector, payload=r.payload) for r in records])  # type: ignore[arg-type]
        client.update_collection_aliases(
            change_aliases_operations=[
                models.DeleteAliasOperation(delete_alias=models.DeleteAlias(alias_name=DEFAULT_COLLECTION)),
                models.CreateAliasOperation(
                    create_alias=models.CreateAlias(collection_name=old, alias_name=DEFAULT_COLLECTION)
                ),
            ]
        )
        client.delete_collection(real)
    finally:
        client.close()


async def recalled(config: NodeConfig, url: str, home: Path, project: str) -> list[list[tuple[str, float]]]:
    async with Node(config), connect(url, agent="alice", home=home, outbox=False) as alice:
        answers = [(await alice.recall(q, project, k=3)).hits for q in QUERIES]
    return [[(h["artifact_id"], round(float(h["score"]), 4)) for h in hits] for hits in answers]


async def test_an_old_layout_collection_is_refused_migrated_with_every_point_and_recalled_as_before(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    qdrant = tmp_path / "qdrant"
    config = NodeConfig(
        home=tmp_path / "node", nats_url=nats_server.url, journal_url=f"sqlite:///{tmp_path / 'j.db'}",
        mirror="server", qdrant_url=str(qdrant),
    )  # fmt: skip
    async with Node(config), connect(nats_server.url, agent="alice", home=tmp_path / "a", outbox=False) as alice:
        events = [alice.event("finding", finding(text=text), project=project) for text in TEXTS]
        await alice.publish_many(events, wait_for=ReceiptLevel.indexed)
    before = await recalled(config, nats_server.url, tmp_path / "a", project)
    assert [hits[0][0] for hits in before] == [str(e.artifact_id) for e in events]
    make_old_layout(qdrant)
    points = collection_points(qdrant)
    assert len(points) == 3

    with pytest.raises(ConfigError, match=r"'in-ram' layout.*epibus mirror migrate"):
        async with Node(config):
            pass
    migrated = run_epibus(
        config.home, "mirror", "migrate", "--mirror", "server", "--qdrant-url", str(qdrant), "--json", timeout_s=120
    )
    report = json.loads(migrated.stdout)
    assert (report["moved"], report["points"], report["layout"]) == (3, 3, LAYOUT)
    after = collection_points(qdrant)
    assert after.keys() == points.keys()
    assert all(after[i][1] == points[i][1] for i in points)  # payload kept, key for key
    assert all(after[i][0] == pytest.approx(points[i][0], abs=1e-6) for i in points)
    assert await recalled(config, nats_server.url, tmp_path / "a", project) == before
    again = json.loads(run_epibus(config.home, "mirror", "migrate", "--mirror", "server", "--qdrant-url",
                                  str(qdrant), "--json", timeout_s=120).stdout)  # fmt: skip
    assert again["moved"] == 0  # already in the layout: left as it is


async def test_an_edge_mirror_of_an_older_layout_is_migrated_with_every_point_and_recalled_as_before(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    config = NodeConfig(
        home=tmp_path / "node", nats_url=nats_server.url, journal_url=f"sqlite:///{tmp_path / 'j.db'}", mirror="edge"
    )
    async with Node(config), connect(nats_server.url, agent="alice", home=tmp_path / "a", outbox=False) as alice:
        events = [alice.event("finding", finding(text=text), project=project) for text in TEXTS]
        await alice.publish_many(events, wait_for=ReceiptLevel.indexed)
    before = await recalled(config, nats_server.url, tmp_path / "a", project)
    assert [hits[0][0] for hits in before] == [str(e.artifact_id) for e in events]
    mirror = config.home / "mirror"
    meta = json.loads((mirror / "collection.json").read_text())
    old = await EdgeVectorStore.open(mirror, meta["model_id"], int(meta["dimension"]), layout=1)
    try:  # the node's points sealed in layout 1: float32 originals, a write-ahead log, every index
        assert await old.migrate() == 3
        points = {p.id: p for p in await old.retrieve(list(await old.point_ids()))}
    finally:
        await old.close()
    assert {s["layout"] for s in json.loads((mirror / MANIFEST).read_text())["shards"] if s["sealed"]} == {1}

    report = json.loads(run_epibus(config.home, "mirror", "migrate", "--json", timeout_s=120).stdout)
    assert (report["moved"], report["points"]) == (3, 3)
    shards = json.loads((mirror / MANIFEST).read_text())["shards"]
    assert {s["layout"] for s in shards if s["sealed"]} == {SEALED_LAYOUT}
    after = await recalled(config, nats_server.url, tmp_path / "a", project)
    for old_hits, new_hits in zip(before, after, strict=True):  # the same claims, in the same order
        assert [aid for aid, _ in new_hits] == [aid for aid, _ in old_hits]
        assert [score for _, score in new_hits] == pytest.approx([score for _, score in old_hits], abs=2e-3)
    store = await EdgeVectorStore.open(mirror, meta["model_id"], int(meta["dimension"]))
    try:  # every point, its payload and its id, read back from the migrated files
        kept = {p.id: p for p in await store.retrieve(list(points))}
    finally:
        await store.close()
    assert kept.keys() == points.keys()
    assert all(kept[i].payload == points[i].payload for i in points)
    assert all(kept[i].vector == pytest.approx(points[i].vector, abs=1e-3) for i in points)  # float16 originals
