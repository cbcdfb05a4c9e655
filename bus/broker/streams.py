"""Creating and checking the JetStream streams (EPI, EPI_DLQ) and KV buckets epibus keeps.

`ensure_streams` is idempotent and is re-run by clients after every reconnect: a server that lost its
store (or a new cluster) gets the streams back before anything is published, and a stream whose settings
drifted from what epibus needs (bus/broker/drift.py) is refused, not used."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.kv import KeyValue

from bus.broker.drift import (
    EVENT_STREAM_FIELDS,
    MANAGED_FIELDS,
    Difference,
    ManagedStream,
    automatic,
    differences,
    kv_stream_config,
    show,
)
from bus.broker.nats_errors import INSUFFICIENT_STORAGE, JS_TIMEOUT_S, NATS_OR_API_ERROR
from bus.errors import ConfigError, StreamDrift, Unavailable
from bus.identity.confinement import confined_key
from bus.model.event import MAX_EVENT_BYTES
from bus.model.watch import MAX_WATCH_DAYS, NOTICE_WINDOW_S
from bus.subjects import (
    AGENT_KEYS_BUCKET,
    DLQ_STREAM,
    DLQ_SUBJECTS,
    MESH_BUCKET,
    NODES_BUCKET,
    STREAM,
    STREAM_SUBJECTS,
    TOMBSTONES_BUCKET,
    VECTORS_STREAM,
    VECTORS_SUBJECTS,
    WATCH_STREAM,
    WATCH_SUBJECTS,
    WATCHES_BUCKET,
    kv_stream,
    kv_subject,
)

log = logging.getLogger(__name__)
# ≥ 2 min for retried publishes; 10 min lets an outbox drain after a short outage still be deduplicated by the server.
DUPLICATE_WINDOW_S = 600.0
# The largest message the event stream takes: an encoded event plus room for its headers. The server refuses
# anything bigger at publish, so no reader ever fetches a message no store would accept.
EVENT_MAX_MSG_BYTES = MAX_EVENT_BYTES + 4096
# The dead-letter stream holds a whole event message plus the reason headers; larger originals are cut to a
# prefix with their digest (bus/intake/runner.py dead_letter_copy).
DLQ_MAX_MSG_BYTES = EVENT_MAX_MSG_BYTES + 8192
# A shared vector: float32, up to 8192 dimensions, and its headers.
VECTOR_MAX_MSG_BYTES = 8192 * 4 + 4096
# A watch's notice: the claim's text (at most an event's size) and the watch's words, with room for the rest.
NOTICE_MAX_MSG_BYTES = MAX_EVENT_BYTES + 8192
# Notices of one watch about one artifact: the match and its follow-ups ("no longer trusted").
NOTICES_PER_ARTIFACT = 8


GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class StreamLimits:
    """What the streams may hold, set by the node that keeps them (`epibus up --events-max-bytes` and the
    like). The event stream refuses new events when full (discard new: memory is never dropped to make room;
    refused events stay in their publishers' outboxes); the dead-letter stream drops its oldest copies and any
    older than `dlq_max_age_s`. `max_consumers` bounds each stream's consumers (agents' slots included). The
    shared vectors' stream keeps at most `vectors_max_bytes` and drops its oldest vectors first: a node that finds
    no vector embeds the text itself. The notices' stream keeps at most `notices_max_bytes`, oldest dropped first,
    and nothing older than the notice window."""

    events_max_bytes: int = 8 * GIB
    events_max_msgs: int = -1
    dlq_max_bytes: int = 256 * MIB
    dlq_max_age_s: float = 30 * 86400.0
    max_consumers: int = 1024
    vectors_max_bytes: int = 1 * GIB
    notices_max_bytes: int = 256 * MIB

    def __post_init__(self) -> None:
        for name in ("events_max_bytes", "dlq_max_bytes", "max_consumers", "vectors_max_bytes", "notices_max_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(name.replace("_", "-"), f"{getattr(self, name)} is not a limit; at least 1")
        if self.events_max_msgs < -1 or self.events_max_msgs == 0:
            raise ConfigError("events-max-msgs", f"{self.events_max_msgs}: -1 (no limit) or at least 1")
        if self.dlq_max_age_s <= 0:
            raise ConfigError("dlq-max-age", f"{self.dlq_max_age_s}s: dead letters must age out; more than 0")


# The fields a node sets from its StreamLimits, per stream: it applies them without asking, and a client (which
# does not know the node's configuration) never compares them. The event stream's max_age is not one of them:
# an age limit would drop memory, so it stays managed (refused when changed).
LIMIT_FIELDS: dict[str, tuple[str, ...]] = {
    STREAM: ("max_bytes", "max_msgs", "max_consumers", "discard"),
    DLQ_STREAM: ("max_bytes", "max_msgs", "max_consumers", "discard", "max_age"),
    VECTORS_STREAM: ("max_bytes", "max_consumers"),
    WATCH_STREAM: ("max_bytes", "max_consumers"),
}


def _stream_config(
    name: str, subjects: tuple[str, ...], description: str, replicas: int, *, max_msg_bytes: int
) -> StreamConfig:
    return StreamConfig(
        name=name,
        subjects=list(subjects),
        description=description,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        duplicate_window=DUPLICATE_WINDOW_S,
        allow_direct=True,
        max_msg_size=max_msg_bytes,
    )


def stream_configs(replicas: int = 1, limits: StreamLimits | None = None) -> list[StreamConfig]:
    limits = limits or StreamLimits()
    events = _stream_config(STREAM, STREAM_SUBJECTS, "epibus events", replicas, max_msg_bytes=EVENT_MAX_MSG_BYTES)
    # Memory is kept until it is forgotten: nothing ages out, and a full stream refuses new events.
    events.discard, events.max_age = DiscardPolicy.NEW, 0
    events.max_bytes, events.max_msgs, events.max_consumers = (
        limits.events_max_bytes,
        limits.events_max_msgs,
        limits.max_consumers,
    )
    dlq = _stream_config(DLQ_STREAM, DLQ_SUBJECTS, "epibus dead letters", replicas, max_msg_bytes=DLQ_MAX_MSG_BYTES)
    dlq.discard, dlq.max_age, dlq.max_msgs = DiscardPolicy.OLD, limits.dlq_max_age_s, -1
    dlq.max_bytes, dlq.max_consumers = limits.dlq_max_bytes, limits.max_consumers
    vectors = _stream_config(
        VECTORS_STREAM, VECTORS_SUBJECTS, "epibus shared vectors", replicas, max_msg_bytes=VECTOR_MAX_MSG_BYTES
    )
    # One vector per text key; when full, the oldest vectors go (they are a cache: the model can make them again).
    vectors.discard, vectors.max_age, vectors.max_msgs, vectors.max_msgs_per_subject = DiscardPolicy.OLD, 0, -1, 1
    vectors.max_bytes, vectors.max_consumers = limits.vectors_max_bytes, limits.max_consumers
    notices = _stream_config(
        WATCH_STREAM, WATCH_SUBJECTS, "epibus watch notices", replicas, max_msg_bytes=NOTICE_MAX_MSG_BYTES
    )
    # A notice is told once per watch and claim for as long as it is kept: several nodes push it, the server keeps one.
    notices.discard, notices.max_age, notices.duplicate_window = DiscardPolicy.OLD, NOTICE_WINDOW_S, NOTICE_WINDOW_S
    notices.max_msgs, notices.max_msgs_per_subject = -1, NOTICES_PER_ARTIFACT
    notices.max_bytes, notices.max_consumers = limits.notices_max_bytes, limits.max_consumers
    return [events, dlq, vectors, notices]


@dataclass(frozen=True)
class BucketSpec:
    name: str
    history: int
    description: str
    ttl_s: float = 0.0  # a record older than this is dropped by the server (0: kept)
    direct: bool = False  # direct gets: the one KV read the broker can confine by key (agents read some keys only)


# A node's heartbeat is dropped this long after its last write: a node that died leaves the live set by itself.
HEARTBEAT_TTL_S = 4.0


# Every KV bucket epibus keeps, in one table: created with the configured replicas, like the streams.
BUCKETS: dict[str, BucketSpec] = {
    spec.name: spec
    for spec in (
        BucketSpec(AGENT_KEYS_BUCKET, 5, "epibus agent keys and roles"),
        BucketSpec(TOMBSTONES_BUCKET, 1, "epibus tombstones of retracted and rolled-back claims"),
        BucketSpec(MESH_BUCKET, 64, "epibus mesh: tasks, coordinators, capabilities", direct=True),
        BucketSpec(NODES_BUCKET, 1, "epibus nodes: each live node's signed heartbeat", ttl_s=HEARTBEAT_TTL_S),
        # A watch lives at most MAX_WATCH_DAYS: the server drops its record by then, stopped or not.
        BucketSpec(WATCHES_BUCKET, 1, "epibus watches: agents' standing questions", ttl_s=MAX_WATCH_DAYS * 86400.0),
    )
}


def managed_streams(replicas: int = 1, limits: StreamLimits | None = None) -> list[ManagedStream]:
    """Every stream epibus relies on, with what it needs of it: the event streams, then each bucket's."""
    events = [ManagedStream(config, EVENT_STREAM_FIELDS) for config in stream_configs(replicas, limits)]
    buckets = [
        ManagedStream(
            kv_stream_config(
                spec.name,
                spec.description,
                history=spec.history,
                replicas=replicas,
                ttl_s=spec.ttl_s,
                direct=spec.direct,
            ),
            MANAGED_FIELDS,
            bucket=spec.name,
        )
        for spec in BUCKETS.values()
    ]
    return events + buckets


def limits_total_mib(limits: StreamLimits | None) -> int:
    """The bytes the event, dead-letter, vector and notice streams reserve, in MiB (the buckets reserve nothing)."""
    chosen = limits or StreamLimits()
    reserved = chosen.events_max_bytes + chosen.dlq_max_bytes + chosen.vectors_max_bytes + chosen.notices_max_bytes
    return reserved // MIB


# A node checks its streams this often while it stays connected, and at every reconnect.
DRIFT_CHECK_EVERY_S = 15.0
Found = list[tuple[ManagedStream, StreamConfig, list[Difference]]]


async def ensure_streams(
    js: JetStreamContext, *, replicas: int | None = None, repair: bool = False, limits: StreamLimits | None = None
) -> dict[str, list[Difference]]:
    """Create EPI and EPI_DLQ (and, for a node, the KV buckets) when missing, and compare every existing one
    with the configuration epibus needs. Returns what was changed, by stream.

    A difference in any managed field is drift: StreamDrift names each one and nothing is changed, unless
    `repair` restores the managed configuration. Applied without asking (logged): a node's configured
    replicas and limits (a client, `replicas=None`, never changes them nor counts them as drift) and a message
    size limit on a stream that has none (`bus.broker.drift.automatic`). Raises StreamDrift, Unavailable,
    ConfigError (the server refused to restore a setting)."""
    try:
        async with asyncio.timeout(JS_TIMEOUT_S):
            found = await _compare(js, replicas, limits)
            drifted = {
                stream.name: [(d.field, d.text(first=i == 0)) for i, d in enumerate(refused)]
                for stream, _, diffs in found
                if (refused := [d for d in diffs if not _applied_unasked(d, stream)])
            }
            if drifted and not repair:
                raise StreamDrift(drifted)
            changed: dict[str, list[Difference]] = {}
            for stream, current, diffs in found:
                if diffs:
                    await _restore(js, stream, current, diffs)
                    changed[stream.name] = diffs
            return changed
    except NATS_OR_API_ERROR as e:
        if isinstance(e, nats.js.errors.APIError) and e.err_code == INSUFFICIENT_STORAGE:
            raise ConfigError(
                "events-max-gib",
                f"the streams' byte limits ({limits_total_mib(limits)} MiB) are more than the server may store "
                "(JetStream takes at most 75% of the free disk under its store): lower `epibus up --events-max-gib`, "
                "`--dlq-max-mib`, `--vectors-max-mib` and `--notices-max-mib`, or give the node a larger disk",
            ) from e
        # An APIError here is the server not being ready (e.g. just restarted, no JetStream leader yet).
        raise Unavailable("nats", f"cannot ensure streams: {type(e).__name__} {e}") from e


def _applied_unasked(difference: Difference, stream: ManagedStream) -> bool:
    if difference.field == "num_replicas" or difference.field in LIMIT_FIELDS.get(stream.name, ()):
        return True
    return automatic(difference, bucket=stream.bucket is not None)


def node_settings_of(stream: ManagedStream, current: StreamConfig) -> None:
    """Compare a stream as one that does not know the node's configuration: take its replicas and limits as
    they are (what a client and `doctor` do)."""
    stream.config.num_replicas = current.num_replicas
    for name in LIMIT_FIELDS.get(stream.name, ()):
        setattr(stream.config, name, getattr(current, name))


async def _compare(js: JetStreamContext, replicas: int | None, limits: StreamLimits | None) -> Found:
    found: Found = []
    for stream in managed_streams(replicas or 1, limits):
        try:
            info = await js.stream_info(stream.name)
        except nats.js.errors.NotFoundError:
            if stream.bucket is None:
                await js.add_stream(stream.config)
            elif replicas is not None:  # a client leaves a missing bucket to open_bucket, on first use
                await open_bucket(js, stream.bucket, replicas=replicas)
            continue
        if replicas is None:
            node_settings_of(stream, info.config)
        found.append((stream, info.config, differences(info.config, stream)))
    return found


async def _restore(js: JetStreamContext, stream: ManagedStream, current: StreamConfig, diffs: list[Difference]) -> None:
    """The stream's own configuration with the managed fields put back (what epibus does not manage stays)."""
    for diff in diffs:
        setattr(current, diff.field, getattr(stream.config, diff.field))
    try:
        await js.update_stream(current)
    except nats.js.errors.APIError as e:
        if e.code in (408, 503):
            raise
        fields = ", ".join(d.field for d in diffs)
        raise ConfigError(
            f"stream {stream.name}",
            f"JetStream refused to restore {fields}: {e.description} (err_code {e.err_code}); a setting the server "
            "cannot undo in place needs the stream recreated with epibus's configuration and its messages copied in",
        ) from e
    for diff in diffs:
        was, now = show(diff.field, diff.current), show(diff.field, diff.wanted)
        log.warning("stream %s: %s was %s, now %s", stream.name, diff.field, was, now)


async def open_bucket(js: JetStreamContext, name: str, *, replicas: int | None = None, create: bool = True) -> KeyValue:
    """The bucket, created from its spec when missing (`create=False`: BucketNotFoundError instead). A node
    passes its replicas and an existing bucket is brought to them; a client passes None and never changes
    them. Raises nats errors: callers translate them at their own choke point."""
    spec = BUCKETS[name]
    if spec.direct and replicas is None and confined_key(js) is not None:
        # A confined agent may not ask for stream info (a subjects filter in its body would list every project's
        # keys); it reads by direct get, scoped to its projects' keys. A node made the bucket.
        return KeyValue(name=name, stream=kv_stream(name), pre=kv_subject(name, ""), js=js, direct=True)
    try:
        kv = await js.key_value(name)
    except nats.js.errors.BucketNotFoundError:
        if not create:
            raise
        return await js.create_key_value(
            bucket=name,
            history=spec.history,
            storage=StorageType.FILE,
            replicas=replicas or 1,
            description=spec.description,
            ttl=spec.ttl_s or None,
            direct=spec.direct,
        )
    if replicas is not None:
        info = await js.stream_info(kv_stream(name))
        if info.config.num_replicas != replicas:
            log.warning("bucket %s has %s replicas; setting %d", name, info.config.num_replicas, replicas)
            info.config.num_replicas = replicas
            await js.update_stream(info.config)
    return kv
