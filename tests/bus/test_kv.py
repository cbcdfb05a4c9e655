"""Compare-and-set on a real KV bucket, the one helper the registry, the mesh store and the fleet hub share:
absent (never written, deleted) is None, a stale revision is a lost race, and nothing it refused was written."""

from __future__ import annotations

import nats
import nats.js.errors
import pytest
from nats.js.kv import KeyValue

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


class LaggingReplica(KeyValue):
    """The bucket as a node in a cluster may see it: its reads reach a replica the last write has not reached."""

    async def _get(self, key: str, revision: int | None = None) -> KeyValue.Entry:
        raise nats.js.errors.KeyNotFoundError


async def test_a_create_refused_whose_check_reads_a_lagging_replica_is_a_lost_race(nats_server: NatsServer) -> None:
    """nats-py's create reads the key after a refusal; "not found" there (a replica behind) is still a lost race,
    not an outage: three nodes enrolling their keys at once must not die of it."""
    nc = await nats.connect(nats_server.url)
    try:
        kv = await nc.jetstream().create_key_value(bucket="cas3", history=5)
        await kv.create("k", b"one")
        lagging = LaggingReplica(name="cas3", stream="KV_cas3", pre="$KV.cas3.", js=nc.jetstream(), direct=False)
        with pytest.raises(Conflict) as lost:
            await compare_and_set(lagging, "k", b"two", last=None, what="k")
        assert lost.value.lost_race
        assert await create_if_absent(lagging, "k", b"two", what="k") is None
        assert (await kv.get("k")).value == b"one"  # read back through nats-py: nothing was written
    finally:
        await nc.close()
