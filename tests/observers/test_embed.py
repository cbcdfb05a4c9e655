"""The offline default embedding model, for real: meaning, the content-hash cache, failures."""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Sequence
from pathlib import Path

import pytest

from bus.errors import ComponentFailed, ConfigError, Unavailable
from observers.mirror.embed import DEFAULT_DIMENSION, DEFAULT_MODEL, CachedEmbedder, FastEmbedder


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> FastEmbedder:
    return FastEmbedder(tmp_path_factory.mktemp("home")).load_blocking()


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


async def test_the_default_model_loads_offline_and_embeds_meaning(model: FastEmbedder) -> None:
    assert (model.model_id, model.dimension) == (DEFAULT_MODEL, DEFAULT_DIMENSION)
    cold, paraphrase, unrelated = await model.embed(
        ["the cache is cold after every deploy", "after a deployment the cache starts empty", "bananas are yellow"]
    )
    assert all(math.isclose(math.sqrt(cosine(v, v)), 1.0, rel_tol=1e-3) for v in (cold, paraphrase, unrelated))
    assert cosine(cold, paraphrase) > 0.6 > 0.2 > cosine(cold, unrelated)


async def test_an_identical_text_is_embedded_once(model: FastEmbedder, tmp_path: Path) -> None:
    cache = CachedEmbedder(model, tmp_path / "cache.db")
    first = await cache.embed(["disk full on node 3", "disk full on node 3", "queue lag"])
    assert (cache.misses, cache.hits) == (2, 1)
    again = await cache.embed(["queue lag", "disk full on node 3"])
    assert (cache.misses, cache.hits) == (2, 3)
    assert again == [first[2], first[0]]
    cache.close()
    reopened = CachedEmbedder(model, tmp_path / "cache.db")  # persistent: read back by a new cache object
    assert await reopened.embed(["queue lag"]) == [first[2]]
    assert reopened.hits == 1
    reopened.close()


class BrokenModel:
    """An inner model that fails; the cache, not the model, is under test."""

    model_id = "broken"
    dimension = 4

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        raise Unavailable("embedder", "onnxruntime crashed")


async def test_a_failed_embedding_raises_and_caches_no_placeholder(tmp_path: Path) -> None:
    cache = CachedEmbedder(BrokenModel(), tmp_path / "cache.db")
    with pytest.raises(Unavailable, match="onnxruntime crashed"):
        await cache.embed(["anything"])
    with sqlite3.connect(tmp_path / "cache.db") as db:
        assert db.execute("SELECT count(*) FROM vectors").fetchone()[0] == 0
    cache.close()


async def test_an_unloadable_model_is_a_clear_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"EPIBUS_EMBED_MODEL.*no-such/model"):
        await FastEmbedder(tmp_path, "no-such/model").load()


class FixedModel:
    """An inner model that always answers; the cache file, not the model, is under test."""

    model_id = "fixed"
    dimension = 2

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        return [[1.0, 0.0] for _ in texts]


async def test_a_locked_cache_file_is_an_outage_that_ends_when_the_lock_does(tmp_path: Path) -> None:
    cache = CachedEmbedder(FixedModel(), tmp_path / "cache.db", busy_timeout_s=0.1)
    holder = sqlite3.connect(tmp_path / "cache.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process writing, or a disk that refuses writes for now
    try:
        with pytest.raises(Unavailable, match=r"embedding cache unavailable: .*cache\.db: database is locked"):
            await cache.embed(["a text the mirror must not dead-letter"])
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert await cache.embed(["a text the mirror must not dead-letter"]) == [[1.0, 0.0]]
    with sqlite3.connect(tmp_path / "cache.db") as db:
        assert db.execute("SELECT count(*) FROM vectors").fetchone()[0] == 1
    cache.close()


async def test_a_cache_file_that_lost_its_table_is_a_failure_not_an_outage(tmp_path: Path) -> None:
    cache = CachedEmbedder(FixedModel(), tmp_path / "cache.db")
    with sqlite3.connect(tmp_path / "cache.db") as db:
        db.execute("ALTER TABLE vectors RENAME TO something_else")
    with pytest.raises(ComponentFailed, match=r"embedding cache failed: .*no such table: vectors"):
        await cache.embed(["x"])
    cache.close()


async def test_the_cache_stays_bounded_under_repeated_publishing_and_keeps_the_newest(tmp_path: Path) -> None:
    """Waves of new texts, with the last wave's texts coming again: the file holds at most `max_texts`
    vectors, the oldest were evicted (and counted), and a text that comes again soon is still answered."""
    cache = CachedEmbedder(FixedModel(), tmp_path / "cache.db", max_texts=100)
    for wave in range(8):
        texts = [f"wave {wave} claim {i}" for i in range(40)]
        await cache.embed(texts)
        await cache.embed(texts[:10])  # a redelivery
    with sqlite3.connect(tmp_path / "cache.db") as db:  # read back through another connection
        kept = db.execute("SELECT count(*) FROM vectors").fetchone()[0]
    assert kept == 100
    assert cache.evicted == 8 * 40 - 100
    assert cache.hits == 8 * 10
    assert await cache.count_cached([f"wave 7 claim {i}" for i in range(40)]) == 40
    assert await cache.count_cached([f"wave 0 claim {i}" for i in range(40)]) == 0
    cache.close()
