"""The `edge` vector store as a node runs it: qdrant-edge in a process of its own, asked over a pipe.

qdrant-edge holds the interpreter lock in every call (loading a sealed shard: hundreds of milliseconds; a search
over many shards: milliseconds), so in the node's process it stalls the event loop that serves every request. In
its own process (`python -m observers.mirror.engine`) it stalls only itself, and a store written through mmap that
dies of SIGBUS takes down the engine, not the node: the next call starts a new engine on the same files.

The pipe carries length-prefixed pickles between this process and the child it started (nothing else can write
to it). Each call is answered with its result or its error, and the engine's shard states and seal figures."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from bus.errors import Unavailable
from bus.host.server_guard import SPAWNER, die_with_parent
from observers.mirror.edge import SEAL_POINTS, SealStats
from observers.mirror.store import CollectionInfo, Filter, Hit, Point, Vector, require_dimension

log = logging.getLogger(__name__)

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 30
# The engine's methods a node may call; each returns what EdgeVectorStore's does.
METHODS = frozenset(
    {"upsert", "upsert_packed", "delete", "retrieve", "search", "set_payload", "describe", "point_ids",
     "shard_layout", "settle", "optimize", "compact", "migrate"}
)  # fmt: skip
# Calls that wait for worker processes (a seal, a merge, a compaction): minutes at a large store.
UNBOUNDED = frozenset({"settle", "optimize", "compact", "migrate"})
CALL_TIMEOUT_S = 120.0
START_TIMEOUT_S = 60.0
RESTARTS_PER_MINUTE = 3  # an engine that keeps dying is reported, not restarted in a loop


def encode_frame(message: object) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message, or raises asyncio.IncompleteReadError when the other side closed its end."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes is larger than any message")
    return pickle.loads(await reader.readexactly(size))


class EngineGone(Exception):
    """The engine process ended while a call waited (its exit status says why)."""


class EdgeProcessVectorStore:
    """A VectorStore on qdrant-edge, run by an engine process. Use `await EdgeProcessVectorStore.open(...)`."""

    def __init__(self, path: Path, model_id: str, dimension: int, *, seal_points: int = SEAL_POINTS) -> None:
        self.path = path
        self.model_id = model_id
        self.dimension = dimension
        self.seal_points = seal_points
        self.store_id = ""
        self.seals = SealStats()
        self.restarts = 0
        self._states: dict[str, int] = {"hot": 0, "frozen": 0, "sealed": 0, "outdated": 0}
        self._process: subprocess.Popen[bytes] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._starting = asyncio.Lock()
        self._deaths: list[float] = []
        self._closed = False
        self._stopping = False  # this side is ending the engine: its end is not news
        self._ended = "not started"

    @classmethod
    async def open(
        cls, path: Path, model_id: str, dimension: int, *, seal_points: int = SEAL_POINTS
    ) -> EdgeProcessVectorStore:
        """Start the engine and open the store in it. Raises what opening raises there (ModelMismatch,
        StoreDamaged, Unavailable) and Unavailable if the engine did not start."""
        store = cls(path, model_id, dimension, seal_points=seal_points)
        await store._start()
        return store

    # -- the engine process -----------------------------------------------------------------------------------

    async def _start(self) -> None:
        command = [sys.executable, "-m", "observers.mirror.engine"]
        try:
            process = SPAWNER.run(
                lambda: subprocess.Popen(
                    command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=die_with_parent(),
                    env=os.environ | {"PYTHONUNBUFFERED": "1"},
                )
            )  # fmt: skip
        except OSError as e:  # out of processes or memory: may pass
            raise Unavailable("qdrant-edge", f"{self.path}: cannot start the mirror engine: {e}") from e
        assert process.stdin is not None
        assert process.stdout is not None
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=MAX_FRAME_BYTES)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), process.stdout)
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, process.stdin)
        self._writer = asyncio.StreamWriter(transport, protocol, None, loop)
        self._process = process
        self._reading = loop.create_task(self._read_replies(reader, process), name=f"edge engine {self.path}")
        opening = {"path": str(self.path), "model_id": self.model_id, "dimension": self.dimension,
                   "seal_points": self.seal_points}  # fmt: skip
        opened = False
        try:
            self.store_id = await self._ask("open", (opening,), {}, timeout_s=START_TIMEOUT_S)
            opened = True
        finally:
            if not opened:  # refused, timed out or cancelled: no engine is left running without a caller
                await self._stop_process()

    async def _read_replies(self, reader: asyncio.StreamReader, process: subprocess.Popen[bytes]) -> None:
        """Hand each reply to its call; when the engine's end closes, fail every call still waiting."""
        try:
            while True:
                call_id, ok, value, state = await read_frame(reader)
                self._states, self.seals = state["shards"], SealStats(**state["seals"])
                waiting = self._waiting.pop(call_id, None)
                if waiting is None or waiting.done():
                    continue  # its caller gave up (a timeout): the answer has no reader
                if ok:
                    waiting.set_result(value)
                else:
                    waiting.set_exception(value)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, pickle.UnpicklingError, EOFError) as e:
            why = self._ended = await asyncio.to_thread(_exit_status, process)
            if not self._closed and not self._stopping:
                log.error("the mirror engine of %s ended (%s): %s", self.path, why, type(e).__name__)
            for waiting in self._waiting.values():
                if not waiting.done():
                    waiting.set_exception(EngineGone(why))
            self._waiting.clear()

    async def _ask(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, timeout_s: float | None) -> Any:
        if self._writer is None or self._reading is None or self._reading.done():
            raise EngineGone(self._ended)
        call_id = next(self._ids)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = answer
        try:
            self._writer.write(encode_frame((call_id, method, args, kwargs)))
            await self._writer.drain()
            async with asyncio.timeout(timeout_s):
                return await answer
        except (ConnectionError, RuntimeError) as e:  # the pipe closed under the write
            raise EngineGone(f"its pipe closed: {e}") from e
        except TimeoutError as e:
            raise Unavailable(
                "qdrant-edge", f"{self.path}: the engine did not answer {method} in {timeout_s:g} s"
            ) from e
        finally:
            self._waiting.pop(call_id, None)

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One call to the engine; an engine that died is started again (bounded) and the call made once more."""
        if self._closed:
            raise Unavailable("qdrant-edge", f"{self.path}: store is closed")
        timeout_s = None if method in UNBOUNDED else CALL_TIMEOUT_S
        try:
            return await self._ask(method, args, kwargs, timeout_s=timeout_s)
        except EngineGone as gone:
            if self._closed:
                raise Unavailable("qdrant-edge", f"{self.path}: store is closed") from gone
            await self._restart(str(gone))
            try:
                return await self._ask(method, args, kwargs, timeout_s=timeout_s)
            except EngineGone as again:
                raise Unavailable("qdrant-edge", f"{self.path}: the mirror engine ended ({again})") from again

    async def _restart(self, why: str) -> None:
        async with self._starting:
            if self._reading is not None and not self._reading.done():
                return  # another call restarted it already
            now = time.monotonic()
            self._deaths = [t for t in self._deaths if now - t < 60] + [now]
            if len(self._deaths) > RESTARTS_PER_MINUTE:
                raise Unavailable(
                    "qdrant-edge",
                    f"{self.path}: the mirror engine ended {len(self._deaths)} times in a minute (last: {why}); "
                    "see the node's log for its error",
                )
            await self._stop_process()
            log.warning("starting the mirror engine of %s again (it ended: %s)", self.path, why)
            await self._start()
            self.restarts += 1

    async def _stop_process(self) -> None:
        self._stopping = True
        try:
            await self._end_process()
        finally:
            self._stopping = False

    async def _end_process(self) -> None:
        process, self._process = self._process, None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if process is not None and process.poll() is None:
            try:
                await asyncio.wait_for(asyncio.to_thread(process.wait), timeout=30)
            except TimeoutError:
                log.error("the mirror engine of %s did not stop in 30 s; killing it", self.path)
                process.kill()
                await asyncio.to_thread(process.wait)
        if self._reading is not None:
            await asyncio.wait([self._reading])
            self._reading = None

    # -- the VectorStore ----------------------------------------------------------------------------------------

    async def upsert(self, points: Sequence[Point]) -> None:
        if points:
            require_dimension(self.model_id, self.dimension, [p.vector for p in points])
            # float32, as the engine stores them: half the bytes of pickled floats, and lossless for what it keeps
            vectors = np.asarray([p.vector for p in points], dtype=np.float32)
            await self._call("upsert_packed", [p.id for p in points], vectors, [dict(p.payload) for p in points])

    async def delete(self, ids: Sequence[uuid.UUID]) -> None:
        if ids:
            await self._call("delete", list(ids))

    async def retrieve(self, ids: Sequence[uuid.UUID]) -> list[Point]:
        return list(await self._call("retrieve", list(ids))) if ids else []

    async def search(self, vector: Vector, where: Filter, *, limit: int) -> list[Hit]:
        return list(await self._call("search", list(vector), _plain(where), limit=limit))

    async def set_payload(self, where: Filter, payload: Mapping[str, Any]) -> None:
        await self._call("set_payload", _plain(where), dict(payload))

    async def describe(self) -> CollectionInfo:
        info: CollectionInfo = await self._call("describe")
        return info

    async def point_ids(self, where: Filter | None = None) -> list[uuid.UUID]:
        return list(await self._call("point_ids", _plain(where) if where is not None else None))

    def shard_states(self) -> dict[str, int]:
        """How many shards are hot, frozen and sealed, as the engine said in its last answer."""
        return dict(self._states)

    async def shard_layout(self) -> list[dict[str, Any]]:
        return list(await self._call("shard_layout"))

    async def settle(self) -> None:
        await self._call("settle")

    async def optimize(self) -> bool:
        return bool(await self._call("optimize"))

    async def compact(self) -> int:
        return int(await self._call("compact"))

    async def migrate(self) -> int:
        return int(await self._call("migrate"))

    async def close(self) -> None:
        """Close the store in the engine (it flushes and ends), then wait for the process. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._reading is not None and not self._reading.done():
            try:
                await self._ask("close", (), {}, timeout_s=CALL_TIMEOUT_S)
            except (EngineGone, Unavailable) as e:
                log.error("the mirror engine of %s did not close its store: %s", self.path, e)
        await self._stop_process()


def _plain(where: Filter) -> Filter:
    """A filter of plain dicts and lists: what pickles whatever mappings the caller built it from."""
    return Filter(
        equals=dict(where.equals),
        any_of={k: list(v) for k, v in where.any_of.items()},
        none_of={k: list(v) for k, v in where.none_of.items()},
        at_most=dict(where.at_most),
    )


def _exit_status(process: subprocess.Popen[bytes]) -> str:
    try:
        code = process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return "still running, its pipe closed"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit status {code}"


def state_of(seals: SealStats, shards: dict[str, int]) -> dict[str, Any]:
    """What every reply carries besides its result: the engine's shards by state and its seal figures."""
    return {"shards": shards, "seals": asdict(seals)}
