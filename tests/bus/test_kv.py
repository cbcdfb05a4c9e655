"""Compare-and-set on a real KV bucket, the one helper the registry, the mesh store and the fleet hub share:
absent (never written, deleted) is None, a stale revision is a lost race, and nothing it refused was written."""

from __future__ import annotations

import nats
import pytest

from bus.broker.kv import compare_and_set, create_if_absent, read_entry
from bus.errors import Conflict
from bus.host.server import NatsServer


async def test_compare_and_set_writes_only_on_the_current_revision(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        kv = await nc.jetstream().create_key_value(bucket="cas", history=5)
        assert await read_entry(kv, "k") is None
        first = await compare_and_set(kv, "k", b"one", last=None, what="k")
        with pytest.raises(Conflict) as lost:
            await compare_and_set(kv, "k", b"again", last=None, what="k")
        assert lost.value.lost_race
        second = await compare_and_set(kv, "k", b"two", last=first, what="k")
        with pytest.raises(Conflict, match="no longer at revision"):
            await compare_and_set(kv, "k", b"stale", last=first, what="k")
        entry = await kv.get("k")  # read back through nats-py, not the helper
        assert (entry.value, entry.revision) == (b"two", second)
    finally:
        await nc.close()


async def test_a_deleted_key_reads_as_absent_and_can_be_created_again(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        kv = await nc.jetstream().create_key_value(bucket="cas2", history=5)
        assert await create_if_absent(kv, "k", b"one", what="k") is not None
        assert await create_if_absent(kv, "k", b"two", what="k") is None
        assert (await kv.get("k")).value == b"one"
        await kv.delete("k")
        assert await read_entry(kv, "k") is None
        assert await create_if_absent(kv, "k", b"three", what="k") is not None
        assert (await kv.get("k")).value == b"three"
    finally:
        await nc.close()
