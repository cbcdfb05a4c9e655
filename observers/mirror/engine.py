"""The mirror engine: the process that runs a node's edge store (qdrant-edge), answering its node over a pipe.

    python -m observers.mirror.engine     # started by observers.mirror.edge_process, never by hand

The first message opens the store; each later one is a call of EdgeVectorStore, answered with its result or
its error, and the shard states and seal figures as they stand; a change of those figures between calls (a
seal that ends while nothing is asked) is sent on its own, as the answer to no call (id 0). Calls run
concurrently, in the order they came, as they would in the node's own loop. The engine ends when its node
closes the store, when its node closes the pipe, or when its node dies (the parent-death signal)."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import sys
from pathlib import Path
from typing import Any

from bus.errors import ComponentFailed, error_summary
from observers.mirror.edge import EdgeVectorStore
from observers.mirror.edge_process import METHODS, encode_frame, read_frame, state_of

log = logging.getLogger("observers.mirror.engine")
STATE_EVERY_S = 0.5  # how often the engine looks for figures its node has not been sent
UNASKED = 0  # the call id of a frame that answers no call: figures that changed between calls


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    store: EdgeVectorStore | None = None
    calls: set[asyncio.Task[None]] = set()
    sent: list[dict[str, Any]] = []  # the figures last sent to the node

    def state() -> dict[str, Any]:
        shards = store.shard_states() if store is not None else {"hot": 0, "frozen": 0, "sealed": 0, "outdated": 0}
        return state_of(store.seals, shards) if store is not None else {"shards": shards, "seals": {}}

    def reply(call_id: int, ok: bool, value: object) -> None:
        sent[:] = [state()]
        writer.write(encode_frame((call_id, ok, value, sent[0])))

    async def send_changes() -> None:
        """A seal ends between calls: without this its node would show it only after its next call."""
        while True:
            await asyncio.sleep(STATE_EVERY_S)
            if store is not None and sent and state() != sent[0]:
                reply(UNASKED, True, None)
                await writer.drain()

    async def answer(call_id: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            assert store is not None
            value = await getattr(store, method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - not swallowed: raised again in the node, as it was raised here
            reply(call_id, False, crossing(e))
        else:
            reply(call_id, True, value)
        await writer.drain()

    reporting = asyncio.get_running_loop().create_task(send_changes())
    try:
        while True:
            try:
                call_id, method, args, kwargs = await read_frame(reader)
            except asyncio.IncompleteReadError:
                return  # the node closed its end: close the store and end
            if method == "open":
                try:
                    (opening,) = args
                    store = await EdgeVectorStore.open(
                        Path(opening["path"]), opening["model_id"], opening["dimension"],
                        seal_points=opening["seal_points"],
                    )  # fmt: skip
                except Exception as e:  # noqa: BLE001 - the node raises it
                    reply(call_id, False, crossing(e))
                    await writer.drain()
                    return
                reply(call_id, True, store.store_id)
                await writer.drain()
            elif method == "close":
                for task in calls:  # a seal being waited for is not waited for: the next open seals again
                    task.cancel()
                await asyncio.gather(*calls, return_exceptions=True)
                await _close(store)
                store = None
                reply(call_id, True, None)
                await writer.drain()
                return
            elif method in METHODS and store is not None:
                task = asyncio.get_running_loop().create_task(answer(call_id, method, args, kwargs))
                calls.add(task)
                task.add_done_callback(calls.discard)
            else:
                reply(call_id, False, ValueError(f"{method!r} is not a call of the mirror engine"))
                await writer.drain()
    finally:
        reporting.cancel()
        for task in calls:
            task.cancel()
        await asyncio.gather(reporting, *calls, return_exceptions=True)
        await _close(store)


def crossing(error: Exception) -> Exception:
    """The error as the node can rebuild it: itself when it pickles both ways, else a ComponentFailed saying it."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - replaced by an error that says what it was
        return ComponentFailed("qdrant-edge", error_summary(error))
    return error


async def _close(store: EdgeVectorStore | None) -> None:
    if store is not None:
        await store.close()


async def main() -> None:
    # Frames go to the pipe the node reads; anything else that writes to stdout (a library's print) goes to
    # stderr instead, where the node's log is.
    frames = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 30)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, frames)
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    await serve(reader, writer)
    writer.close()


if __name__ == "__main__":
    os.umask(0o077)  # every file the engine (and its seal workers) creates is owner-only from the start
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s mirror engine: %(message)s")
    asyncio.run(main())
