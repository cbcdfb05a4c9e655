"""Embed once per fleet: a node that embeds a claim's text shares the vector on `epivec.<text key>` (stream
EPI_VEC, the newest vector per key), and any other node, or one catching up, takes it instead of running the model.

A vector is taken only when it is for the model this node runs (model id and dimension, both signed), of the
right length, and signed by a registered node's key over its subject, model, dimension and bytes; anything else
is refused, counted, and the text embedded here. One taken vector in `check_every` (and the first from each
signer) is embedded again here and compared: a signer whose vector does not match is distrusted for the rest of
the process. Sharing is an optimisation: a stream that cannot be read or written costs the model's time, never
a vector."""

from __future__ import annotations

import asyncio
import logging
import math
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg

from bus.broker.nats_errors import JS_TIMEOUT_S, NATS_OR_API_ERROR, message_gone
from bus.errors import InvalidEvent, Unavailable
from bus.identity.signing import AgentKey, verify_document
from bus.subjects import (
    SIGNATURE_HEADER,
    SIGNER_KEY_HEADER,
    VECTOR_DIMENSION_HEADER,
    VECTOR_MODEL_HEADER,
    VECTORS_STREAM,
    vector_subject,
)
from observers.mirror.embed import Embedder, text_key

log = logging.getLogger(__name__)
READ_OR_WRITE_FAILED: tuple[type[BaseException], ...] = (*NATS_OR_API_ERROR, Unavailable)

VECTOR_PURPOSE = "epibus shared vector"
CHECK_EVERY = 64  # one taken vector in this many is embedded again here and compared
MATCH_COSINE = 0.999  # one model on two CPUs differs in the last bits of a float, never by more than this
FETCH_CONCURRENCY = 32  # direct gets in flight at once
LOOKUP_TIMEOUT_S = 2.0  # a lookup that takes longer costs more than the model would
PAUSE_AFTER_FAILURE_S = 30.0  # after the stream failed to answer, texts go to the model for this long


@dataclass
class SharingStats:
    """What sharing did on this node: for metrics, status and the benchmark."""

    shared: int = 0  # vectors this node put on the stream
    taken: int = 0  # vectors it took instead of embedding
    refused: int = 0  # vectors it would not take: forged, another model, malformed, or failing their check
    checked: int = 0  # taken vectors it embedded again to compare
    share_failures: int = 0  # vectors it could not put on the stream
    read_failures: int = 0  # lookups the stream did not answer (the texts were embedded here)
    last_problem: str | None = None


def vector_document(subject: str, model_id: str, dimension: int, data: bytes) -> bytes:
    """What a node signs: the subject (so a vector cannot be moved to another text), model, dimension, bytes."""
    return f"{subject}\n{model_id}\n{dimension}\n".encode() + data


def pack(vector: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(vector)}f", *vector)


def unpack(data: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


@dataclass(frozen=True)
class Taken:
    vector: list[float]
    signer: str


class FleetEmbedder:
    """An Embedder that asks the fleet's shared vectors before its model, and shares what its model made."""

    def __init__(
        self,
        model: Embedder,
        js: Callable[[], JetStreamContext],
        key: AgentKey,
        is_node_key: Callable[[str], Awaitable[bool]],
        *,
        check_every: int = CHECK_EVERY,
    ) -> None:
        self.model = model
        self._js = js
        self._key = key
        self._is_node_key = is_node_key
        self.check_every = check_every
        self.stats = SharingStats()
        self._distrusted: set[str] = set()
        self._checked_signers: set[str] = set()
        self._since_check = 0
        self._paused_until = 0.0

    @property
    def model_id(self) -> str:
        return self.model.model_id

    @property
    def dimension(self) -> int:
        return self.model.dimension

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One vector per text: taken from the fleet where a trusted one exists, else made by the model (and
        shared). Raises what the model raises."""
        by_key = {text_key(self.model_id, text): text for text in texts}
        taken = await self._take(list(by_key))
        made = await self._embed_checked(by_key, taken)
        await self._share(made)
        vectors = {key: found.vector for key, found in taken.items()} | made
        return [vectors[text_key(self.model_id, text)] for text in texts]

    async def _embed_checked(self, by_key: dict[str, str], taken: dict[str, Taken]) -> dict[str, list[float]]:
        """The model's vectors for the keys not taken, and for a sample of the taken ones, which are compared:
        a signer that fails its check loses every vector it gave (they are embedded here too)."""
        sample = self._sample(taken)
        todo = [key for key in by_key if key not in taken] + sample
        made = dict(zip(todo, await self.model.embed([by_key[k] for k in todo]), strict=True)) if todo else {}
        for key in sample:
            self.stats.checked += 1
            if cosine(taken[key].vector, made[key]) < MATCH_COSINE:
                self._distrust(taken[key].signer, f"its vector of {key[:12]}… does not match this node's model")
        dropped = [key for key, found in taken.items() if found.signer in self._distrusted]
        for key in dropped:
            taken.pop(key)
        again = [key for key in dropped if key not in made]
        if again:
            made |= dict(zip(again, await self.model.embed([by_key[k] for k in again]), strict=True))
        self.stats.taken += len(taken)
        return {key: vector for key, vector in made.items() if key not in sample or key in dropped}

    def _sample(self, taken: dict[str, Taken]) -> list[str]:
        """The first vector from each signer, then one in `check_every`."""
        sample: list[str] = []
        for key, found in taken.items():
            self._since_check += 1
            if found.signer not in self._checked_signers or self._since_check >= self.check_every:
                self._checked_signers.add(found.signer)
                self._since_check = 0
                sample.append(key)
        return sample

    def _distrust(self, signer: str, why: str) -> None:
        if signer not in self._distrusted:
            log.error("shared vectors signed by %s… are no longer taken: %s", signer[:12], why)
        self._distrusted.add(signer)
        self._refuse(f"{signer[:12]}…: {why}")

    def _refuse(self, why: str) -> None:
        self.stats.refused += 1
        self.stats.last_problem = why

    async def _take(self, keys: list[str]) -> dict[str, Taken]:
        if asyncio.get_running_loop().time() < self._paused_until:
            return {}
        limit = asyncio.Semaphore(FETCH_CONCURRENCY)

        async def one(key: str) -> tuple[str, Taken | None]:
            async with limit:
                return key, await self._lookup(key)

        found = await asyncio.gather(*(one(key) for key in keys))
        return {key: taken for key, taken in found if taken is not None}

    async def _lookup(self, key: str) -> Taken | None:
        subject = vector_subject(key)
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                msg = await self._js().get_last_msg(VECTORS_STREAM, subject, direct=True)
        except nats.js.errors.NotFoundError:
            return None
        except READ_OR_WRITE_FAILED as e:
            self.stats.read_failures += 1
            self.stats.last_problem = f"reading {VECTORS_STREAM}: {type(e).__name__} {e}"
            if self._paused_until < asyncio.get_running_loop().time():
                log.warning("shared vectors unreadable (%s); embedding here for %.0f s", e, PAUSE_AFTER_FAILURE_S)
            self._paused_until = asyncio.get_running_loop().time() + PAUSE_AFTER_FAILURE_S
            return None
        try:
            return await self._admit(subject, msg)
        except InvalidEvent as e:
            self._refuse(f"{subject}: {e}")
            return None

    async def _admit(self, subject: str, msg: RawStreamMsg) -> Taken | None:
        """The vector of a message, if this node may take it. Raises InvalidEvent for a forged or malformed one;
        None for another model's (not an attack: the fleet runs several)."""
        headers = msg.headers or {}
        data = msg.data or b""
        if headers.get(VECTOR_MODEL_HEADER) != self.model_id or headers.get(VECTOR_DIMENSION_HEADER) != str(
            self.dimension
        ):
            return None
        if len(data) != 4 * self.dimension:
            raise InvalidEvent("vector", f"{len(data)} bytes, not {4 * self.dimension} ({self.dimension} floats)")
        signer = headers.get(SIGNER_KEY_HEADER, "")
        if signer in self._distrusted:
            return None
        if not signer or not await self._is_node_key(signer):
            raise InvalidEvent("signer", f"{signer[:12] or 'nobody'}… is not a registered node's key")
        verify_document(
            signer, VECTOR_PURPOSE, vector_document(subject, self.model_id, self.dimension, data),
            headers.get(SIGNATURE_HEADER, ""),
        )  # fmt: skip
        vector = unpack(data)
        if not all(math.isfinite(x) for x in vector):
            raise InvalidEvent("vector", "holds a value that is not a finite number")
        return Taken(vector, signer)

    async def _share(self, made: dict[str, list[float]]) -> None:
        """Put what the model made on the stream, each signed. A failure is counted and logged: the vectors are
        this node's all the same, other nodes embed those texts themselves."""
        if not made:
            return
        results = await asyncio.gather(*(self._put(key, vector) for key, vector in made.items()))
        failed = [problem for problem in results if problem is not None]
        self.stats.shared += len(results) - len(failed)
        if failed:
            self.stats.share_failures += len(failed)
            self.stats.last_problem = failed[0]
            log.warning("%d of %d vectors not shared with the fleet: %s", len(failed), len(results), failed[0])

    async def _put(self, key: str, vector: list[float]) -> str | None:
        subject = vector_subject(key)
        data = pack(vector)
        signature = self._key.sign_document(
            VECTOR_PURPOSE, vector_document(subject, self.model_id, self.dimension, data)
        )
        headers = {
            VECTOR_MODEL_HEADER: self.model_id,
            VECTOR_DIMENSION_HEADER: str(self.dimension),
            SIGNER_KEY_HEADER: self._key.public_key,
            SIGNATURE_HEADER: signature,
        }
        try:
            async with asyncio.timeout(JS_TIMEOUT_S):
                await self._js().publish(subject, data, stream=VECTORS_STREAM, headers=headers)
        except READ_OR_WRITE_FAILED as e:
            return f"{type(e).__name__} {e}"
        return None

    async def erase(self, texts: Sequence[str]) -> int:
        """Erase the shared vectors of these texts from the stream (a vector is a copy of its text): returns how
        many there were. Idempotent. Raises Unavailable."""
        found = await self._shared_of(texts)
        for seq in found:
            try:
                async with asyncio.timeout(JS_TIMEOUT_S):
                    await self._js().delete_msg(VECTORS_STREAM, seq)  # erases: overwritten on disk
            except NATS_OR_API_ERROR as e:
                if message_gone(e):
                    continue  # gone meanwhile (another node's erase)
                raise Unavailable(VECTORS_STREAM, f"cannot erase a shared vector: {type(e).__name__} {e}") from e
        return len(found)

    async def count_shared(self, texts: Sequence[str]) -> int:
        """How many of these texts have a vector on the stream (reads the stream back after an erase). Raises
        Unavailable."""
        return len(await self._shared_of(texts))

    async def _shared_of(self, texts: Sequence[str]) -> list[int]:
        """The stream sequences of these texts' shared vectors (those that have one). Raises Unavailable."""
        found: list[int] = []
        for key in sorted({text_key(self.model_id, text) for text in texts}):
            try:
                async with asyncio.timeout(JS_TIMEOUT_S):
                    msg = await self._js().get_last_msg(VECTORS_STREAM, vector_subject(key))
            except nats.js.errors.NotFoundError:
                continue
            except NATS_OR_API_ERROR as e:
                raise Unavailable(VECTORS_STREAM, f"cannot read shared vectors: {type(e).__name__} {e}") from e
            found.append(msg.seq or 0)
        return found
