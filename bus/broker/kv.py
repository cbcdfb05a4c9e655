"""Reading and compare-and-set on a KV bucket, the one place that knows nats-py's KV errors: an absent key (also
a deleted or purged one) is None, and a write that lost its race is a Conflict with lost_race set, so callers
decide whether to read again and retry. Deadlines and other NATS errors stay with the caller's nats_call."""

from __future__ import annotations

import nats.js.errors
from nats.js.kv import KeyValue

from bus.errors import Conflict, Unavailable


async def read_entry(kv: KeyValue, key: str) -> KeyValue.Entry | None:
    """The key's current entry, or None when it has none (never written, deleted or purged)."""
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return None
    if entry.revision is None:
        raise Unavailable("nats", f"KV get {key}: the answer carried no revision")
    return entry


async def compare_and_set(kv: KeyValue, key: str, value: bytes, *, last: int | None, what: str) -> int:
    """Write `value` only if the key's revision is still `last` (None: only if the key has no value now,
    deleted keys included). Returns the new revision. Raises Conflict(lost_race=True) when another write got
    there first: the caller reads again and decides; it never retries the same revision blindly."""
    try:
        if last is None:
            return await kv.create(key, value)
        return await kv.update(key, value, last=last)
    except nats.js.errors.KeyWrongLastSequenceError as e:
        expected = "absent" if last is None else f"at revision {last}"
        raise Conflict(what, f"it is no longer {expected}: another write got there first", lost_race=True) from e
    except nats.js.errors.KeyNotFoundError as e:
        if last is not None:
            raise
        # nats-py's create, refused because the key has a value, reads it to tell a deleted key from a live one;
        # in a cluster that read may reach a replica the other write has not reached yet ("not found"). The
        # create lost all the same: a node enrolling at the same instant as another must not die of it.
        raise Conflict(what, "it is no longer absent: another write got there first", lost_race=True) from e


async def create_if_absent(kv: KeyValue, key: str, value: bytes, *, what: str) -> int | None:
    """Write `value` if the key has none: the new revision, or None when it already had one."""
    try:
        return await compare_and_set(kv, key, value, last=None, what=what)
    except Conflict:
        return None
