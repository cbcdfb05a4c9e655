"""One publish from a client, end to end: the receipt level checked, every event checked and turned into a row
(nothing written if one fails), linked claims and flags checked, the rows delivered (through the outbox, or
straight to JetStream, or alone with compare-and-set for a superseding claim), then confirmed to the level."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from bus.client.dispatch import Dispatch
from bus.client.prechecks import PublishChecks
from bus.model.event import Envelope
from bus.model.vocab import ReceiptLevel
from bus.outbox.publish import Receipt
from bus.outbox.receipts import confirmed, wanted_level
from bus.outbox.signer import Item


class PublishPipeline:
    """The publishes of one client, offline (outbox only) or not."""

    def __init__(self, checks: PublishChecks, dispatch: Dispatch, *, offline: bool) -> None:
        self.checks = checks
        self.dispatch = dispatch
        self.connection = dispatch.connection
        self.signer = dispatch.signer
        self.offline = offline
        self.publish_timeout_s = dispatch.publish_timeout_s

    async def publish_many(
        self, events: Sequence[Envelope], *, wait_for: ReceiptLevel | str, timeout_s: float | None, strict: bool
    ) -> list[Receipt]:
        """See EpibusClient.publish_many."""
        outbox = self.dispatch.outbox
        level = wanted_level(wait_for, outbox=outbox is not None, offline=self.offline)
        items = [self.item(event) for event in events]
        self.checks.refuse_batch(events)
        guard = await self.checks.links(events)
        flags = await self.checks.flags(events, strict=strict)
        deadline_s = timeout_s if timeout_s is not None else self.publish_timeout_s * max(1.0, len(events) / 2000)
        if guard is not None:
            receipts = [await self.expecting(events[0], guard, timeout_s)]
        elif outbox is not None:
            rows = self.signer.rows(items)
            receipts = await self.dispatch.through_outbox(rows, 0.0 if level is ReceiptLevel.outboxed else deadline_s)
        else:
            receipts = await self.dispatch.direct(items)
        receipts = [replace(r, flags=flags[str(r.event_id)]) if flags.get(str(r.event_id)) else r for r in receipts]
        nc = self.connection.nc_if_connected
        return await confirmed(receipts, level, nc, signer=self.connection.key, deadline_s=deadline_s)

    def item(self, event: Envelope) -> Item:
        """What publishing `event` sends (see EventSigner.item), once this agent may publish in its project.
        Raises InvalidEvent or Forbidden."""
        item = self.signer.item(event)
        self.checks.admit(event)
        return item

    async def expecting(self, event: Envelope, expected_headers: dict[str, str], timeout_s: float | None) -> Receipt:
        """See EpibusClient.publish_expecting."""
        (row,) = self.signer.rows([self.item(event)])
        return await self.dispatch.expecting(row, expected_headers, timeout_s)
