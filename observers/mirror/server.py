"""The `server` vector store: qdrant-client against a Qdrant server (QDRANT_URL, REST or gRPC), or against
qdrant-client's local mode (a path, or ":memory:") in tests. The collection's metadata records the embedding
model id and dimension. All client calls run on one owned thread: local mode is not thread-safe."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc  # type: ignore[import-untyped]
import httpx
from qdrant_client import QdrantClient, models
from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

from bus.errors import ComponentFailed, ConfigError, ModelMismatch, Unavailable, error_summary
from observers.mirror.store import (
    INDEXED_FLOATS,
    INDEXED_KEYWORDS,
    CollectionInfo,
    Filter,
    Hit,
    Point,
    Vector,
    match_value,
    match_values,
    require_dimension,
)

DEFAULT_COLLECTION = "epibus"
# The layout epibus creates: original vectors on disk, int8 copies in RAM (searched, then the best candidates
# rescored on the originals), payload on disk with the filtered keys indexed, the HNSW graph on disk. A
# collection from before it kept everything in RAM and records no layout: a node refuses it until
# `epibus mirror migrate` copies it over (no store runs half one layout, half the other).
LAYOUT = "int8-ondisk-1"
OLD_LAYOUT = "in-ram"
QUANTIZATION = models.ScalarQuantization(
    scalar=models.ScalarQuantizationConfig(type=models.ScalarType.INT8, quantile=0.99, always_ram=True)
)
RESCORED = models.SearchParams(quantization=models.QuantizationSearchParams(rescore=True, oversampling=3.0))
MIGRATE_BATCH = 256
GRPC_OUTAGES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
)


def _grpc_outage(error: Exception) -> bool:
    code = getattr(error, "code", None)
    return isinstance(error, grpc.RpcError) and callable(code) and code() in GRPC_OUTAGES


def server_filter(where: Filter) -> models.Filter | None:
    must: list[Any] = [
        models.FieldCondition(key=key, match=models.MatchValue(value=match_value(value)))
        for key, value in where.equals.items()
    ]
    must += [
        models.FieldCondition(key=key, match=models.MatchAny(any=match_values(values)))
        for key, values in where.any_of.items()
    ]
    must += [
        models.FieldCondition(key=key, range=models.Range(lte=float(value))) for key, value in where.at_most.items()
    ]
    must_not: list[Any] = [
        models.FieldCondition(key=key, match=models.MatchAny(any=match_values(values)))
        for key, values in where.none_of.items()
    ]
    if not must and not must_not:
        return None
    return models.Filter(must=must or None, must_not=must_not or None)


QDRANT_API_KEY_ENV = "QDRANT_API_KEY"  # as Qdrant's own tools read it


class ServerVectorStore:
    """A VectorStore on qdrant-client. `location` is a URL (http://…:6333, or grpc with prefer_grpc), a local
    path, or ":memory:". Use `await ServerVectorStore.open(...)`."""

    def __init__(
        self,
        location: str,
        model_id: str,
        dimension: int,
        *,
        collection: str = DEFAULT_COLLECTION,
        old_layout_ok: bool = False,
    ) -> None:
        self.location = location
        self.old_layout_ok = old_layout_ok  # only `migrate` opens a collection of the old layout
        self.layout = LAYOUT
        self.model_id = model_id
        self.dimension = dimension
        self.collection = collection
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epibus-qdrant")
        self._client: QdrantClient | None = None
        self.store_id = ""
        self.real_collection = collection
        self._shared = False  # a sibling borrows its parent's client and thread, and closes neither

    @classmethod
    async def open(
        cls,
        location: str,
        model_id: str,
        dimension: int,
        *,
        collection: str = DEFAULT_COLLECTION,
        old_layout_ok: bool = False,
    ) -> ServerVectorStore:
        """Open or create the collection. Raises ModelMismatch for a collection of another model, ConfigError
        for one of the old layout (unless `old_layout_ok`, for `migrate`), Unavailable when the server does
        not answer."""
        store = cls(location, model_id, dimension, collection=collection, old_layout_ok=old_layout_ok)
        try:
            await store._call(store._open)
        except BaseException:
            await store.close()  # a refused open leaves nothing locked
            raise
        return store

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        def guarded() -> Any:
            try:
                return fn(*args, **kwargs)
            except (ModelMismatch, Unavailable, ConfigError):
                raise
            except Exception as e:
                raise self._translate(e) from e

        return await asyncio.get_running_loop().run_in_executor(self._executor, guarded)

    def _translate(self, error: Exception) -> ModelMismatch | Unavailable | ComponentFailed:
        """The one choke point for qdrant-client errors: only a server that did not answer, or answered that
        it is busy or down (5xx, 429), is an outage; a refused request (4xx) or a local-mode error is not."""
        message = " ".join(str(error).split())
        where = f"{self.location}/{self.collection}"
        if "dimension" in message.lower() or "not aligned" in message:
            return ModelMismatch(f"{self.model_id} ({self.dimension}-d)", message)
        if isinstance(error, UnexpectedResponse):
            status = error.status_code or 0
            if status >= 500 or status == 429:
                return Unavailable("qdrant", f"{where}: HTTP {status}: {message[:300]}")
            return ComponentFailed("qdrant", f"{where}: HTTP {status}: {message[:300]}")
        if isinstance(error, ResponseHandlingException):
            # qdrant-client wraps both a request that got no answer and a 2xx answer it could not parse in this
            if not isinstance(error.source, httpx.TransportError | OSError):
                return ComponentFailed("qdrant", f"{where}: unreadable answer: {error_summary(error.source)}")
            return Unavailable("qdrant", f"{where}: {type(error.source).__name__}: {message[:300]}")
        if isinstance(error, httpx.TransportError | OSError):
            return Unavailable("qdrant", f"{where}: {type(error).__name__}: {message[:300]}")
        if _grpc_outage(error):
            return Unavailable("qdrant", f"{where}: gRPC {message[:300]}")
        return ComponentFailed("qdrant", f"{where}: {error_summary(error)}")

    @property
    def _remote(self) -> bool:
        return self.location.startswith(("http://", "https://", "grpc://"))

    @property
    def client(self) -> QdrantClient:
        if self._client is None:
            raise Unavailable("qdrant", "store is closed")
        return self._client

    def _open(self) -> None:
        if self.location == ":memory:":
            self._client = QdrantClient(location=":memory:")
        elif self.location.startswith(("http://", "https://", "grpc://")):
            self._client = QdrantClient(
                url=self.location,
                prefer_grpc=self.location.startswith("grpc://"),
                timeout=10,
                api_key=os.environ.get(QDRANT_API_KEY_ENV) or None,  # a secured server; https:// for TLS
            )
        else:
            self._client = QdrantClient(path=self.location)
        # `collection` is an alias onto a real collection, so a reindex can swap a rebuilt one in atomically.
        aliases = {a.alias_name: a.collection_name for a in self.client.get_aliases().aliases}
        if self.collection in aliases or self.client.collection_exists(self.collection):
            meta = self.client.get_collection(self.collection).config.metadata or {}
            found = (meta.get("model_id"), meta.get("dimension"))
            if found != (self.model_id, self.dimension):
                raise ModelMismatch(f"{found[0]} ({found[1]}-d)", f"{self.model_id} ({self.dimension}-d)")
            self.store_id = str(meta.get("store_id", self.collection))
            self.real_collection = aliases.get(self.collection, self.collection)
            self.layout = str(meta.get("layout", OLD_LAYOUT))
            if self.layout != LAYOUT and not self.old_layout_ok:
                raise ConfigError(
                    "mirror",
                    f"Qdrant collection {self.real_collection} has the {self.layout!r} layout (vectors and payload "
                    f"in RAM); run `epibus mirror migrate` to copy it to the {LAYOUT!r} layout (every point kept)",
                )
            return
        self.real_collection = self._create_real()
        self.client.update_collection_aliases(
            change_aliases_operations=[
                models.CreateAliasOperation(
                    create_alias=models.CreateAlias(collection_name=self.real_collection, alias_name=self.collection)
                )
            ]
        )

    def _create_real(self) -> str:
        """A new real collection for this model, of the current layout, named after its store id."""
        self.store_id = str(uuid.uuid4())
        self.layout = LAYOUT
        name = f"{DEFAULT_COLLECTION}-{self.store_id[:8]}"
        self.client.create_collection(
            name,
            vectors_config=models.VectorParams(size=self.dimension, distance=models.Distance.COSINE, on_disk=True),
            quantization_config=QUANTIZATION,
            on_disk_payload=True,
            hnsw_config=models.HnswConfigDiff(m=16, ef_construct=100, on_disk=True),
            metadata={
                "model_id": self.model_id, "dimension": self.dimension, "store_id": self.store_id, "layout": LAYOUT,
            },
        )  # fmt: skip
        if self._remote:  # local mode scans; a server indexes
            for key in INDEXED_KEYWORDS:
                self.client.create_payload_index(name, key, field_schema=models.PayloadSchemaType.KEYWORD)
            for key in INDEXED_FLOATS:
                self.client.create_payload_index(name, key, field_schema=models.PayloadSchemaType.FLOAT)
        return name

    async def sibling(self) -> ServerVectorStore:
        """A new, empty real collection on the same client (local mode allows one client per path), for a
        rebuild; `swap_in` makes it the one this store's alias names."""
        other = ServerVectorStore(self.location, self.model_id, self.dimension)
        other._client, other._executor, other._shared = self._client, self._executor, True
        other.collection = other.real_collection = await self._call(other._create_real)
        return other

    async def swap_in(self, rebuilt: ServerVectorStore) -> None:
        """Point this store's alias at the rebuilt collection in one operation, then drop the old one."""
        old = self.real_collection
        await self._call(
            self.client.update_collection_aliases,
            change_aliases_operations=[
                models.DeleteAliasOperation(delete_alias=models.DeleteAlias(alias_name=self.collection)),
                models.CreateAliasOperation(
                    create_alias=models.CreateAlias(collection_name=rebuilt.real_collection, alias_name=self.collection)
                ),
            ],
        )
        self.real_collection, self.store_id = rebuilt.real_collection, rebuilt.store_id
        await self._call(self.client.delete_collection, old)

    async def migrate(self) -> int:
        """Copy every point (id, vector, payload) of an old-layout collection into a new one of the current
        layout, check that it holds the same ids, and swap it in; the old one is dropped. A collection already
        of the current layout is left as it is. Returns the points copied. Raises ComponentFailed if the copy
        lost a point (the old collection is then kept), Unavailable."""
        if self.layout == LAYOUT:
            return 0
        fresh = await self.sibling()
        copied = int(await self._call(self._copy_into, fresh.real_collection))
        before, after = set(await self.point_ids()), set(await fresh.point_ids())
        if before != after:
            await self._call(self.client.delete_collection, fresh.real_collection)
            raise ComponentFailed(
                "mirror migrate",
                f"the copy of {self.real_collection} lacks {len(before - after)} point(s); the old one is kept",
            )
        await self.swap_in(fresh)
        self.layout = LAYOUT
        return copied

    def _copy_into(self, target: str) -> int:
        copied, offset = 0, None
        while True:
            records, offset = self.client.scroll(
                self.collection, limit=MIGRATE_BATCH, offset=offset, with_payload=True, with_vectors=True
            )
            if records:
                batch = [models.PointStruct(id=r.id, vector=_plain(r.vector), payload=r.payload) for r in records]
                self.client.upsert(target, batch, wait=True)
                copied += len(records)
            if offset is None:
                return copied

    async def upsert(self, points: Sequence[Point]) -> None:
        if not points:
            return
        require_dimension(self.model_id, self.dimension, [p.vector for p in points])
        batch = [
            models.PointStruct(
                id=str(p.id),
                vector=list(p.vector),
                payload={**p.payload, "model_id": self.model_id, "dimension": self.dimension},
            )
            for p in points
        ]
        await self._call(self.client.upsert, self.collection, batch, wait=True)

    async def delete(self, ids: Sequence[uuid.UUID]) -> None:
        if ids:
            selector = models.PointIdsList(points=[str(i) for i in ids])
            await self._call(self.client.delete, self.collection, selector, wait=True)

    async def retrieve(self, ids: Sequence[uuid.UUID]) -> list[Point]:
        if not ids:
            return []
        records = await self._call(
            self.client.retrieve, self.collection, [str(i) for i in ids], with_payload=True, with_vectors=True
        )
        return [Point(uuid.UUID(str(r.id)), list(r.vector), dict(r.payload or {})) for r in records]

    async def search(self, vector: Vector, where: Filter, *, limit: int) -> list[Hit]:
        require_dimension(self.model_id, self.dimension, [vector])
        response = await self._call(
            self.client.query_points,
            self.collection,
            query=list(vector),
            query_filter=server_filter(where),
            limit=limit,
            with_payload=True,
            search_params=RESCORED if self._remote else None,  # local mode searches exactly, and says so
        )
        return [Hit(uuid.UUID(str(r.id)), float(r.score), dict(r.payload or {})) for r in response.points]

    async def set_payload(self, where: Filter, payload: Mapping[str, Any]) -> None:
        flt = server_filter(where)
        if flt is None:
            raise ValueError("set_payload needs a filter; refusing to rewrite every point")
        await self._call(self.client.set_payload, self.collection, payload=dict(payload), points=flt, wait=True)

    async def describe(self) -> CollectionInfo:
        result = await self._call(self.client.count, self.collection, exact=True)
        return CollectionInfo(self.model_id, self.dimension, int(result.count), self.store_id)

    async def point_ids(self, where: Filter | None = None) -> list[uuid.UUID]:
        return list(await self._call(self._scroll_ids, where))

    def _scroll_ids(self, where: Filter | None) -> list[uuid.UUID]:
        found: list[uuid.UUID] = []
        offset = None
        while True:
            records, offset = self.client.scroll(
                self.collection,
                scroll_filter=server_filter(where) if where is not None else None,
                limit=1024,
                offset=offset,
                with_payload=False,
                with_vectors=False,
            )
            found += [uuid.UUID(str(r.id)) for r in records]
            if offset is None:
                return found

    async def close(self) -> None:
        if self._shared:
            self._client = None
            return
        if self._client is not None:
            await self._call(self._client.close)
            self._client = None
        self._executor.shutdown(wait=True)


def _plain(vector: Any) -> list[float]:
    """The one unnamed dense vector epibus writes; anything else is not an epibus point."""
    if not isinstance(vector, list) or not all(isinstance(x, float | int) for x in vector):
        raise ComponentFailed("mirror migrate", f"a point holds {type(vector).__name__}, not one dense vector")
    return [float(x) for x in vector]
