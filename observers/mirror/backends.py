"""Choosing a vector store by name: the explicit table of backends. Backends are imported
when chosen: qdrant-client alone takes a second to import, and most commands never touch a store."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from bus.errors import ConfigError

if TYPE_CHECKING:
    from observers.mirror.edge_process import EdgeProcessVectorStore
    from observers.mirror.server import ServerVectorStore

STORES = ("edge", "server")


async def open_store(
    kind: str, location: str | Path, model_id: str, dimension: int
) -> EdgeProcessVectorStore | ServerVectorStore:
    """`edge`: a directory, run by an engine process of its own; `server`: a Qdrant URL, a local-mode path or
    ":memory:". Raises ConfigError for an unknown kind, ModelMismatch for a collection built for another model,
    Unavailable if it did not answer."""
    if kind == "edge":
        from observers.mirror.edge_process import EdgeProcessVectorStore

        return await EdgeProcessVectorStore.open(Path(location), model_id, dimension)
    if kind == "server":
        from observers.mirror.server import ServerVectorStore

        return await ServerVectorStore.open(str(location), model_id, dimension)
    raise ConfigError("vector store", f"{kind!r} is unknown", allowed=STORES)
