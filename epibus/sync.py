"""The sync facade for scripts: each call wraps one asyncio.run around a connect → publish → close.

from epibus import sync
receipt = sync.publish("finding", {"text": "…", "impact": 0.5, "confidence": 0.8, "subject": "x"}, project="demo")
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bus.client.client import connect
from bus.model.vocab import EpistemicSource, ReceiptLevel
from bus.outbox.publish import Receipt


def publish(
    kind: str,
    body: dict[str, Any],
    *,
    project: str,
    artifact_id: str | None = None,
    source: EpistemicSource | str | None = None,
    agent: str | None = None,
    nats_url: str | None = None,
    home: Path | str | None = None,
    outbox: bool = True,
    wait_for: ReceiptLevel = ReceiptLevel.published,
    timeout_s: float = 10.0,
) -> Receipt:
    """Publish one event; see EpibusClient.publish for the receipt levels and errors."""
    (receipt,) = publish_many(
        [(kind, body)],
        project=project,
        artifact_ids=[artifact_id],
        source=source,
        agent=agent,
        nats_url=nats_url,
        home=home,
        outbox=outbox,
        wait_for=wait_for,
        timeout_s=timeout_s,
    )
    return receipt


def publish_many(
    items: Sequence[tuple[str, dict[str, Any]]],
    *,
    project: str,
    artifact_ids: Sequence[str | None] | None = None,
    source: EpistemicSource | str | None = None,
    agent: str | None = None,
    nats_url: str | None = None,
    home: Path | str | None = None,
    outbox: bool = True,
    wait_for: ReceiptLevel = ReceiptLevel.published,
    timeout_s: float = 10.0,
) -> list[Receipt]:
    """Publish (kind, body) pairs as one batch; every event is validated before any is written."""
    targets = list(artifact_ids) if artifact_ids is not None else [None] * len(items)

    async def run() -> list[Receipt]:
        async with connect(nats_url, agent=agent, home=home, outbox=outbox, publish_timeout_s=timeout_s) as client:
            events = [
                client.event(kind, body, project=project, artifact_id=target, source=source)
                for (kind, body), target in zip(items, targets, strict=True)
            ]
            return await client.publish_many(events, wait_for=wait_for, timeout_s=timeout_s)

    return asyncio.run(run())
