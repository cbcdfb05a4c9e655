"""`epibus mirror migrate`: move a node's mirror to the layout whose RAM does not grow with its size (original
vectors and payload on disk, int8 copies in RAM), keeping every point. Run with the node stopped."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from bus.errors import ConfigError
from bus.host.home import epibus_home, read_node_info
from epibus.cli.common import HomeOpt, JsonOpt, console, emit_json, handles_errors, run, table

mirror_app = typer.Typer(help="The node's vector mirror, offline: move it to the current layout.")


@mirror_app.command("migrate")
@handles_errors
def migrate(
    mirror: Annotated[str, typer.Option("--mirror", help="The node's mirror: edge | server.")] = "edge",
    qdrant_url: Annotated[
        str | None, typer.Option("--qdrant-url", envvar="QDRANT_URL", help="The server mirror's Qdrant.")
    ] = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Move the mirror to the current layout: an edge mirror's points still searched from RAM go to sealed
    shards; a Qdrant collection from before the int8 layout is copied to a new one (same ids, vectors and
    payload), checked and swapped in. Nothing is embedded again. A mirror already in the layout is left as it
    is. The node must be stopped: it refuses to run an old server collection, and one store has one owner."""
    where = epibus_home(home)
    node = read_node_info(where)
    if node is not None and node.alive():
        raise ConfigError("mirror", f"the node under {where} runs (pid {node.pid}); stop it, then migrate")
    started = time.perf_counter()
    result = run(_migrate(mirror, qdrant_url, where))
    result["seconds"] = round(time.perf_counter() - started, 1)
    if as_json:
        emit_json({"ok": True, **result})
        return
    rows = [[result["mirror"], result["location"], result["points"], result["moved"], result["layout"]]]
    console.print(table("epibus mirror migrate", ["mirror", "location", "points", "moved", "layout"], rows))


async def _migrate(kind: str, qdrant_url: str | None, home: Any) -> dict[str, Any]:
    from observers.mirror.edge import EdgeVectorStore
    from observers.mirror.embed import FastEmbedder
    from observers.mirror.seal import LAYOUT as SEALED_LAYOUT
    from observers.mirror.server import LAYOUT, ServerVectorStore

    model = await FastEmbedder(home).load()  # the node's model: the store is opened for it, as the node does
    try:
        if kind == "edge":
            edge = await EdgeVectorStore.open(home / "mirror", model.model_id, model.dimension)
            try:
                moved = await edge.migrate()
                points = (await edge.describe()).count
            finally:
                await edge.close()
            return {"mirror": kind, "location": str(home / "mirror"), "points": points, "moved": moved,
                    "layout": f"sealed shards, layout {SEALED_LAYOUT}"}  # fmt: skip
        if kind == "server":
            if not qdrant_url:
                raise ConfigError("--qdrant-url", "the server mirror's Qdrant is not named; give --qdrant-url URL")
            server = await ServerVectorStore.open(qdrant_url, model.model_id, model.dimension, old_layout_ok=True)
            try:
                moved = await server.migrate()
                points = (await server.describe()).count
            finally:
                await server.close()
            return {"mirror": kind, "location": qdrant_url, "points": points, "moved": moved, "layout": LAYOUT}
        raise ConfigError("--mirror", f"{kind!r} is unknown", allowed=["edge", "server"])
    finally:
        model.close()
