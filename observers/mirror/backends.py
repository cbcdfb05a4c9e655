"""Choosing a vector store by name: the explicit table of backends (STYLE: Interfaces)."""

from __future__ import annotations

from pathlib import Path

from bus.errors import ConfigError
from observers.mirror.edge import EdgeVectorStore
from observers.mirror.server import ServerVectorStore

STORES = {"edge": EdgeVectorStore, "server": ServerVectorStore}


async def open_store(
    kind: str, location: str | Path, model_id: str, dimension: int
) -> EdgeVectorStore | ServerVectorStore:
    """`edge`: a directory; `server`: a Qdrant URL, a local-mode path or ":memory:". Raises ConfigError for
    an unknown kind, ModelMismatch for a collection built for another model, Unavailable if it did not answer."""
    if kind == "edge":
        return await EdgeVectorStore.open(Path(location), model_id, dimension)
    if kind == "server":
        return await ServerVectorStore.open(str(location), model_id, dimension)
    raise ConfigError("vector store", f"{kind!r} is unknown", allowed=sorted(STORES))
