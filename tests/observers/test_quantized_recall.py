"""Sealed shards search int8 copies of the vectors and rescore the best candidates on the originals: on real
model vectors, recall ranks as exact search does. A fixed corpus (the recall suite's paraphrase pairs among
1,500 generated claims), every point in sealed shards, compared with exact cosine search over the originals."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path

import numpy as np
import pytest

from observers.mirror.edge import EdgeVectorStore
from observers.mirror.embed import FastEmbedder
from observers.mirror.store import Filter, Point
from tests.observers.test_mirror import TOPICS

SUBJECTS = ["the cache", "the scheduler", "the billing job", "the login service", "the message queue",
            "the build farm", "the metrics pipeline", "the search cluster", "the payment gateway",
            "the mobile app", "the backup agent", "the dns resolver"]  # fmt: skip
TROUBLES = ["leaks memory", "drops requests", "times out", "reports stale numbers", "retries forever",
            "fills the disk", "loses its config", "double-charges users", "blocks the event loop",
            "skips records", "logs secrets", "ignores its deadline"]  # fmt: skip
WHEN = ["after a deploy", "at midnight", "under heavy load", "when a node restarts", "during failover",
        "on the first request", "when the network flaps", "after a schema change", "on weekends",
        "when the queue is full", "during backups"]  # fmt: skip
PROJECTS = ("alpha", "beta", "gamma")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> FastEmbedder:
    return FastEmbedder(tmp_path_factory.mktemp("models")).load_blocking()


def corpus() -> list[str]:
    generated = [f"{s} {t} {w}" for s, t, w in itertools.product(SUBJECTS, TROUBLES, WHEN)][:1500]
    return list(TOPICS) + generated


async def sealed_store(path: Path, texts: list[str], vectors: np.ndarray) -> EdgeVectorStore:
    # 500 points a shard: past qdrant-edge's full-scan threshold, so the graph is walked, not scanned
    store = await EdgeVectorStore.open(path, "local/all-MiniLM-L6-v2-int8", vectors.shape[1], seal_points=500)
    made = [
        Point(uuid.UUID(int=i + 1), [float(x) for x in v], {"project": PROJECTS[i % 3], "text": texts[i]})
        for i, v in enumerate(vectors)
    ]
    for start in range(0, len(made), 200):
        await store.upsert(made[start : start + 200])
    await store.optimize()
    layout = await store.shard_layout()
    assert all(s["sealed"] for s in layout[:-1])
    assert layout[-1]["points"] == 0  # every point is in a sealed shard
    return store


async def test_quantized_search_ranks_the_paraphrase_pairs_and_a_fixed_set_as_exact_search_does(
    model: FastEmbedder, tmp_path: Path
) -> None:
    texts = corpus()
    vectors = np.array(await model.embed(texts), dtype=np.float32)
    store = await sealed_store(tmp_path / "m", texts, vectors)
    try:
        for paraphrase in TOPICS.values():
            query = np.array((await model.embed([paraphrase]))[0], dtype=np.float32)
            hits = await store.search([float(x) for x in query], Filter(), limit=10)
            exact_first = texts[int(np.argmax(vectors @ query))]
            assert hits[0].payload["text"] == exact_first, paraphrase

        queries = [f"{s} {t}" for s, t in zip(SUBJECTS, TROUBLES, strict=True)]  # a fixed set, no exact twin
        query_vectors = np.array(await model.embed(queries), dtype=np.float32)
        found, top_ones = 0, 0
        for i, query in enumerate(query_vectors):
            project = PROJECTS[i % 3]  # with the safe door's kind of filter: a third of the points
            members = np.array([j for j in range(len(texts)) if j % 3 == i % 3])
            exact = members[np.argsort(-(vectors[members] @ query))[:10]]
            hits = await store.search([float(x) for x in query], Filter(equals={"project": project}), limit=10)
            got = [h.id.int - 1 for h in hits]
            found += len(set(got) & set(exact.tolist()))
            top_ones += got[0] == exact[0]
            # rescored on the originals: each score is the exact cosine, not the int8 estimate
            assert [h.score for h in hits] == pytest.approx((vectors[got] @ query).tolist(), abs=1e-4)
        assert top_ones == len(queries)
        assert found / (10 * len(queries)) >= 0.95
    finally:
        await store.close()
