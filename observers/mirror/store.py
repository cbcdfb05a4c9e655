"""The vector-store port: where mirror points live, and the only seam between the mirror and a backend.
Every write is idempotent by point id; every backend passes tests/conformance/test_store.py."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from bus.errors import ModelMismatch

Vector = Sequence[float]
Scalar = str | int | float | bool


# What rebuilds a damaged mirror, named wherever damage is found.
MIRROR_REMEDY = "rebuild it from the stream with `epibus reindex`"


@dataclass(frozen=True)
class Point:
    id: uuid.UUID
    vector: Vector
    payload: Mapping[str, Any]


@dataclass(frozen=True)
class Hit:
    id: uuid.UUID
    score: float  # cosine similarity, higher is closer
    payload: Mapping[str, Any]


@dataclass(frozen=True)
class Filter:
    """All conditions must hold. `equals`: field == value; `any_of`: field is one of the values;
    `none_of`: field is none of the values (a missing field counts as none of them); `at_most`: a numeric
    field is at most the value."""

    equals: Mapping[str, Scalar] = field(default_factory=dict)
    any_of: Mapping[str, Sequence[Scalar]] = field(default_factory=dict)
    none_of: Mapping[str, Sequence[Scalar]] = field(default_factory=dict)
    at_most: Mapping[str, float] = field(default_factory=dict)  # numeric field <= value


def require_dimension(model_id: str, dimension: int, vectors: Sequence[Vector]) -> None:
    """Raise ModelMismatch before a backend sees a vector of the wrong length (qdrant-client's local mode
    would answer a wrong-sized query with a bare numpy error)."""
    for vector in vectors:
        if len(vector) != dimension:
            raise ModelMismatch(f"{model_id} ({dimension}-d)", f"a {len(vector)}-d vector")


def match_value(value: Scalar) -> Any:
    """Exact matches are on keywords and integers. Booleans are refused: qdrant-edge does not match them
    (a stored False never equals a filter's False), so a filter on one would silently match nothing."""
    if isinstance(value, bool):
        raise ValueError("boolean payload filters are not portable across backends; filter on a keyword instead")
    return value if isinstance(value, str | int) else str(value)


def match_values(values: Sequence[Scalar]) -> Any:
    return [match_value(v) for v in values]


@dataclass(frozen=True)
class CollectionInfo:
    model_id: str
    dimension: int
    count: int
    store_id: str  # made when the collection is created: mirrors sharing one store share one consumer


# Payload fields the mirror filters on; backends index them. Only these: an index on a field no filter names
# (event_id, actor: one value a point) cost a sealed shard ~300 bytes of RAM and ~100 of disk a point.
INDEXED_KEYWORDS = ("project", "kind", "artifact_id", "trust", "lifecycle", "resolution")
INDEXED_FLOATS: tuple[str, ...] = ()


class VectorStore(Protocol):
    """Where mirror points live. Every write is idempotent by point id. A store that did not answer raises
    Unavailable; one built for another embedding model raises ModelMismatch."""

    async def upsert(self, points: Sequence[Point]) -> None:
        """Write or overwrite. Raises ModelMismatch if a vector's length is not the collection's dimension."""

    async def delete(self, ids: Sequence[uuid.UUID]) -> None:
        """Deleting an absent id is not an error; callers prove deletes with retrieve()."""

    async def retrieve(self, ids: Sequence[uuid.UUID]) -> list[Point]:
        """The points that exist among `ids`, with vectors and payloads; absent ids are left out."""

    async def search(self, vector: Vector, where: Filter, *, limit: int) -> list[Hit]:
        """The closest points that match `where`, best first. An empty list means nothing matched."""

    async def set_payload(self, where: Filter, payload: Mapping[str, Any]) -> None:
        """Merge `payload` into every point matching `where` (state transitions reach the mirror this way)."""

    async def describe(self) -> CollectionInfo:
        """The collection's embedding model id, dimension and point count."""

    async def point_ids(self, where: Filter | None = None) -> list[uuid.UUID]:
        """Every point id matching `where` (all when None): reconciliation and lookups by payload."""

    async def close(self) -> None:
        """Flush and release the store; idempotent. Any later call raises Unavailable."""
