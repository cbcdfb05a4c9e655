"""Getting a client's signed rows to JetStream: through the local outbox and its forwarder (receipts from the
forwarder's PubAcks, or read from the shared outbox), or straight to JetStream with retries, and the awaited
compare-and-set send. Failures come back as Unavailable saying what is safe to do next."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from nats.js.api import PubAck

from bus.client.connection import Connection
from bus.errors import Unavailable
from bus.model.vocab import ReceiptLevel
from bus.outbox.forwarder import Forwarder
from bus.outbox.outbox import Outbox
from bus.outbox.outbox_file import OutboxRow
from bus.outbox.publish import MAX_PUBLISH_ATTEMPTS, Receipt, retrying_unavailable, send_chunks, send_one
from bus.outbox.receipts import await_acks
from bus.outbox.signer import EventSigner, Item


class Dispatch:
    """Sends on `connection`; with an outbox path, through the outbox. `open()` before sending, and run
    `forwarder.run()` while the client lives (when not offline)."""

    def __init__(
        self,
        connection: Connection,
        signer: EventSigner,
        outbox: Path | None,
        *,
        max_in_flight: int,
        only_own_rows: bool,
    ) -> None:
        self.connection = connection
        self.signer = signer
        self.publish_timeout_s = connection.publish_timeout_s
        self.max_in_flight = max_in_flight
        # A client's forwarder sends the rows it added (and orphans); a node drains everyone's.
        self.only_own_rows = only_own_rows
        self.outbox_path = outbox
        self.outbox: Outbox | None = None
        self.forwarder: Forwarder | None = None

    async def open(self, stack: contextlib.AsyncExitStack, *, offline: bool) -> None:
        """Open the outbox (closed by `stack`) and, unless offline, make its forwarder (its leases given back
        by `stack`)."""
        if self.outbox_path is None:
            return
        self.outbox = await Outbox(self.outbox_path).open()
        stack.push_async_callback(self.outbox.close)
        if offline:
            return
        self.forwarder = Forwarder(
            self.outbox,
            self.connection.js_if_connected,
            before_send=self.connection.prepare,
            max_in_flight=self.max_in_flight,
            timeout_s=self.publish_timeout_s,
            only_own_rows=self.only_own_rows,
        )
        stack.push_async_callback(self.outbox.release_leases)

    def wake(self) -> None:
        """A connection was made: the forwarder sends what waits."""
        if self.forwarder is not None:
            self.forwarder.wake()

    async def through_outbox(self, rows: list[OutboxRow], timeout_s: float) -> list[Receipt]:
        """Make the rows durable, then wait up to timeout_s for their PubAcks: `published` receipts for those
        acknowledged, `outboxed` for the rest (a forwarder sends them later)."""
        assert self.outbox is not None
        forwarder = self.forwarder  # None when offline: the rows wait for a node's forwarder
        # Register before the rows exist, or a forwarder mid-drain could send them unobserved.
        futures = {row.event_id: forwarder.sent(row.event_id) for row in rows} if forwarder is not None else {}
        acks: dict[str, tuple[int, bool]] = {}
        try:
            await self.outbox.add(rows)
            self.wake()
            if self.connection.connected:
                acks = await await_acks(futures, self.outbox, timeout_s)
        finally:
            for future in futures.values():
                future.cancel()  # no-op when done; an unsent row keeps its place in the outbox
        receipts = []
        for row in rows:
            event_id = uuid.UUID(row.event_id)
            if row.event_id in acks:
                seq, duplicate = acks[row.event_id]
                receipts.append(Receipt(event_id, row.subject, ReceiptLevel.published, seq, duplicate))
            else:
                receipts.append(Receipt(event_id, row.subject, ReceiptLevel.outboxed))
        return receipts

    async def direct(self, items: Sequence[Item]) -> list[Receipt]:
        """Send straight to JetStream, each chunk as soon as it is signed; rows without a PubAck are retried
        (tenacity, same Nats-Msg-Id)."""
        acks: dict[str, PubAck] = {}
        rows: list[OutboxRow] = []  # signed so far, in order
        async with contextlib.aclosing(self.signer.chunks(items)) as chunks:
            try:
                async for attempt in retrying_unavailable():
                    with attempt:
                        await self._send_attempt(_unacknowledged(rows, chunks, acks), acks, len(items))
            except Unavailable as e:
                raise Unavailable(
                    "nats",
                    f"{len(items) - len(acks)} of {len(items)} events not acknowledged after {MAX_PUBLISH_ATTEMPTS} "
                    f"attempts ({e.cause}); publishing the same events again is safe (ids dedupe)",
                ) from e
        return [
            Receipt(
                uuid.UUID(r.event_id),
                r.subject,
                ReceiptLevel.published,
                acks[r.event_id].seq,
                bool(acks[r.event_id].duplicate),
            )
            for r in rows
        ]

    async def _send_attempt(self, chunks: AsyncIterator[list[OutboxRow]], acks: dict[str, PubAck], total: int) -> None:
        """One attempt of `direct`: the PubAcks go into `acks`. Raises Unavailable while some are missing,
        Conflict or a refusal as it is (retrying the same bytes cannot help)."""
        if not self.connection.connected:
            raise Unavailable("nats", "not connected")
        await self.connection.prepare()
        results = await send_chunks(
            self.connection.js, chunks, max_in_flight=self.max_in_flight, timeout_s=self.publish_timeout_s
        )
        for event_id, result in results.items():
            if isinstance(result, PubAck):
                acks[event_id] = result
            elif not isinstance(result, Unavailable):
                raise result
        if len(acks) < total:
            raise Unavailable("nats", f"{total - len(acks)} event(s) got no PubAck")

    async def expecting(self, row: OutboxRow, expected_headers: dict[str, str], timeout_s: float | None) -> Receipt:
        """The awaited compare-and-set send: raises Conflict (never retried blindly), retries only Unavailable
        with the same Nats-Msg-Id. Bypasses the outbox: a stale expectation must fail now, not after an outage."""
        async for attempt in retrying_unavailable():
            with attempt:
                await self.connection.prepare()
                ack = await send_one(
                    self.connection.js,
                    row,
                    timeout_s=timeout_s or self.publish_timeout_s,
                    extra_headers=dict(expected_headers),
                )
        return Receipt(uuid.UUID(row.event_id), row.subject, ReceiptLevel.published, ack.seq, bool(ack.duplicate))

    async def depth(self) -> int:
        return await self.outbox.depth() if self.outbox is not None else 0


async def _unacknowledged(
    rows: list[OutboxRow], chunks: AsyncIterator[list[OutboxRow]], acks: dict[str, PubAck]
) -> AsyncIterator[list[OutboxRow]]:
    """What an attempt sends: the rows signed before it and not acknowledged, then the chunks still being
    signed (kept in `rows` for the next attempt)."""
    if rows:
        yield [row for row in rows if row.event_id not in acks]
    async for chunk in chunks:
        rows.extend(chunk)
        yield chunk
