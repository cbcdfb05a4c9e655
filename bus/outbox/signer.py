"""Turning a client's events into the rows it sends: a signed event as it is, an unsigned one prepared (its
bytes made) and signed, in bulk chunks on a worker thread while the previous chunk is being sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import ThreadPoolExecutor

from bus.errors import InvalidEvent
from bus.identity.signing import AgentKey, PreparedEvent
from bus.model.event import Envelope
from bus.outbox.outbox_file import OutboxRow

SIGN_CHUNK = 256  # events signed per worker-thread call in publish_many, sent while the next chunk is signed

Item = OutboxRow | PreparedEvent


class EventSigner:
    """Signs for the agent whose key is `key`. `close()` stops its worker thread."""

    def __init__(self, key: AgentKey) -> None:
        self.key = key
        self._thread: ThreadPoolExecutor | None = None

    def item(self, event: Envelope) -> Item:
        """What publishing `event` sends: a signed event's row, or an unsigned event prepared for signing (its
        bytes made, so every check that can refuse it has run). Raises InvalidEvent."""
        if event.signature is None:
            return self.key.prepare(event)
        if event.actor != self.key.actor:
            raise InvalidEvent("actor", f"{event.actor.agent_id!r} is not this client's agent {self.key.agent_id!r}")
        return OutboxRow.of(event)

    def rows(self, items: Sequence[Item]) -> list[OutboxRow]:
        """The rows of `items` in order, the prepared ones signed now. Touches only bytes and text, so it may
        run on the signing thread."""
        prepared = [item for item in items if isinstance(item, PreparedEvent)]
        signatures = iter(self.key.sign_prepared(prepared))
        return [
            item if isinstance(item, OutboxRow) else OutboxRow.prepared(item, next(signatures), self.key.public_key)
            for item in items
        ]

    async def chunks(self, items: Sequence[Item]) -> AsyncGenerator[list[OutboxRow], None]:
        """The rows of `items` in order, SIGN_CHUNK at a time. The next chunk is signed on a worker thread while
        the caller sends this one (PyNaCl releases the GIL: the second core signs)."""
        if len(items) <= SIGN_CHUNK:  # nothing to overlap: a thread hop would only add latency
            yield self.rows(items)
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epibus-sign")
        loop = asyncio.get_running_loop()
        chunks = [items[start : start + SIGN_CHUNK] for start in range(0, len(items), SIGN_CHUNK)]
        pending = [loop.run_in_executor(self._thread, self.rows, chunk) for chunk in chunks[:2]]
        try:
            for index in range(len(chunks)):
                rows = await pending[index]
                if index + 2 < len(chunks):
                    pending.append(loop.run_in_executor(self._thread, self.rows, chunks[index + 2]))
                yield rows
        finally:
            # Closed early (an error while sending): let the thread finish what it started, never leave it.
            unfinished = [future for future in pending if not future.done()]
            if unfinished:
                await asyncio.wait(unfinished)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)  # at most one chunk of signatures in progress
            self._thread = None
