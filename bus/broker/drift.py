"""What epibus needs of a stream's configuration, field by field, and how a stream differs from it.

A stream or KV bucket whose settings were changed behind epibus's back (by hand, by another tool, by an
attacker) is not silently put back: `bus.broker.streams.ensure_streams` refuses it naming every difference found
here, and `epibus streams repair` restores it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from bus.subjects import kv_stream, kv_subject

# Settings that decide what a stream keeps, what it admits, who may remove messages and where messages go.
# Not managed: description, metadata, compression, placement, first_seq and publish features (atomic and
# batched publishes), which change none of that.
MANAGED_FIELDS: tuple[str, ...] = (
    "subjects",
    "retention",
    "storage",
    "discard",
    "discard_new_per_subject",
    "max_age",
    "max_msgs",
    "max_bytes",
    "max_msg_size",
    "max_msgs_per_subject",
    "max_consumers",
    "duplicate_window",
    "num_replicas",
    "no_ack",
    "sealed",
    "deny_delete",
    "deny_purge",
    "allow_rollup_hdrs",
    "allow_direct",
    "republish",
    "subject_transform",
    "sources",
    "mirror",
    "consumer_limits",
)
# Per-message TTL would let a publisher make its own event vanish from the stream after the stores took it.
# Not managed on KV buckets: nats-py turns it on there in some versions and not in others.
EVENT_STREAM_FIELDS: tuple[str, ...] = (*MANAGED_FIELDS, "allow_msg_ttl")

# The server spells "no limit" as -1 or 0, and nats-py a field the server left out as None.
_LIMITS = frozenset({"max_msgs", "max_bytes", "max_msg_size", "max_msgs_per_subject", "max_consumers"})
_FLAGS = frozenset(
    {"discard_new_per_subject", "no_ack", "sealed", "deny_delete", "deny_purge", "allow_rollup_hdrs", "allow_direct"}
    | {"allow_msg_ttl"}
)
_SHOWN_CHARS = 200  # a hostile stream's subjects or republish target reach logs and terminals: keep them short


class Difference(NamedTuple):
    """One managed setting that differs, both sides normalised (see `normal`)."""

    field: str
    current: Any
    wanted: Any

    def text(self, *, first: bool = False) -> str:
        needs = "epibus needs" if first else "needs"
        return f"{self.field}={show(self.field, self.current)} ({needs} {show(self.field, self.wanted)})"


@dataclass(frozen=True)
class ManagedStream:
    """A stream epibus relies on: the configuration it needs and which of its fields are compared.
    `bucket`: the KV bucket the stream holds (created through nats-py's KV API), or None for an event stream."""

    config: StreamConfig
    fields: tuple[str, ...]
    bucket: str | None = None

    @property
    def name(self) -> str:
        assert self.config.name is not None
        return self.config.name


def differences(current: StreamConfig, wanted: ManagedStream) -> list[Difference]:
    """Every managed field whose normalised value on the server differs from what epibus needs, in
    `wanted.fields` order."""
    found = []
    for field in wanted.fields:
        have, need = normal(field, getattr(current, field)), normal(field, getattr(wanted.config, field))
        if have != need:
            found.append(Difference(field, have, need))
    return found


def normal(field: str, value: Any) -> Any:
    """One spelling per meaning, in plain JSON types: "no limit" is -1 (0 for max_age), an unset flag False,
    enums their value, nested settings dicts, nothing None."""
    if field in _LIMITS:
        return -1 if value in (None, 0, -1) else int(value)
    if field in ("max_age", "duplicate_window"):
        return float(value or 0)
    if field == "num_replicas":
        return int(value or 1)
    if field in _FLAGS:
        return bool(value)
    if field == "subjects":
        return sorted(value or [])
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list):
        return [item.as_dict() if hasattr(item, "as_dict") else item for item in value] or None
    if hasattr(value, "as_dict"):
        return value.as_dict() or None  # consumer limits with nothing set are no limits
    return value


def show(field: str, value: Any) -> str:
    if field == "max_age" and value == 0:
        return "0: keep forever"
    if field in ("max_age", "duplicate_window"):
        return f"{value}s"
    if field in _LIMITS and value == -1:
        return "-1: no limit"
    if field == "subjects":
        text = ",".join(value)
    elif isinstance(value, dict | list):
        text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    elif value is None:
        text = "none"
    else:
        text = str(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "…"


def automatic(difference: Difference, *, bucket: bool) -> bool:
    """An older epibus made its streams before they had a message size limit: a stream with none is brought
    to the limit without asking, since a limit only refuses future oversized publishes and removes nothing
    stored. Likewise direct gets on a bucket that needs them (made before agents' reads were confined by key):
    they only add a way to read one key. Any other size, and every other field, is drift."""
    if difference.field == "allow_direct":
        return bucket and difference.current is False and difference.wanted is True
    return difference.field == "max_msg_size" and difference.current == -1 and difference.wanted != -1


# nats-py's create_key_value (nats/js/client.py) gives a bucket's stream a 2-minute duplicate window.
KV_DUPLICATE_WINDOW_S = 120.0


def kv_stream_config(
    bucket: str, description: str, *, history: int, replicas: int, ttl_s: float = 0.0, direct: bool = False
) -> StreamConfig:
    """The stream behind a KV bucket as nats-py's create_key_value makes it for epibus (no size limits; direct
    gets where `direct`, so the broker can confine reads by key; a TTL, `ttl_s`, only on the nodes bucket):
    compared against, never used to create the bucket."""
    return StreamConfig(
        name=kv_stream(bucket),
        description=description,
        subjects=[kv_subject(bucket, ">")],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        duplicate_window=min(KV_DUPLICATE_WINDOW_S, ttl_s) if ttl_s else KV_DUPLICATE_WINDOW_S,
        discard=DiscardPolicy.NEW,
        allow_direct=direct,
        allow_rollup_hdrs=True,
        deny_delete=True,
        max_age=ttl_s,
        max_msgs=-1,
        max_bytes=-1,
        max_msg_size=-1,
        max_consumers=-1,
        max_msgs_per_subject=history,
    )
