"""Creating and checking the JetStream streams (EPI, EPI_DLQ) and KV buckets, and the agent key registry.

`ensure_streams` is idempotent and is re-run by clients after every reconnect: a server that lost its
store (or a new cluster) gets the streams back before anything is published, and a stream whose settings
drifted from what epibus needs (bus/drift.py) is refused, not used."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.kv import KeyValue

from bus.drift import (
    EVENT_STREAM_FIELDS,
    MANAGED_FIELDS,
    Difference,
    ManagedStream,
    automatic,
    differences,
    kv_stream_config,
    show,
)
from bus.errors import (
    ComponentFailed,
    ConfigError,
    Conflict,
    EpibusError,
    Forbidden,
    InvalidEvent,
    StreamDrift,
    Unavailable,
    error_summary,
)
from bus.event import MAX_EVENT_BYTES
from bus.home import NodeFollower
from bus.signing import AgentKey
from bus.subjects import (
    AGENT_KEYS_BUCKET,
    DLQ_STREAM,
    DLQ_SUBJECTS,
    MESH_BUCKET,
    NODES_BUCKET,
    STREAM,
    STREAM_SUBJECTS,
    TOMBSTONES_BUCKET,
)
from bus.tasks import cancel_and_wait
from bus.tls import nats_tls_context

log = logging.getLogger(__name__)
# ≥ 2 min for retried publishes; 10 min lets an outbox drain after a short outage still be deduplicated by the server.
DUPLICATE_WINDOW_S = 600.0
JS_TIMEOUT_S = 10.0
# The largest message the event stream takes: an encoded event plus room for its headers. The server refuses
# anything bigger at publish, so no reader ever fetches a message no store would accept.
EVENT_MAX_MSG_BYTES = MAX_EVENT_BYTES + 4096
# The dead-letter stream holds a whole event message plus the reason headers; larger originals are cut to a
# prefix with their digest (bus/runner.py dead_letter_copy).
DLQ_MAX_MSG_BYTES = EVENT_MAX_MSG_BYTES + 8192

# NATS client and JetStream errors that mean "the server did not answer": retry later.
NATS_UNAVAILABLE: tuple[type[BaseException], ...] = (
    nats.errors.ConnectionClosedError,
    nats.errors.NoServersError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.StaleConnectionError,
    nats.errors.ConnectionDrainingError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,  # publishing while reconnecting filled nats-py's pending buffer
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    TimeoutError,
    ConnectionError,
)


NATS_OR_API_ERROR: tuple[type[BaseException], ...] = (*NATS_UNAVAILABLE, nats.js.errors.APIError)
# What a loop that reads from JetStream rides out and retries: the server or a store did not answer.
RETRYABLE: tuple[type[BaseException], ...] = (Unavailable, *NATS_OR_API_ERROR)


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
        discard=DiscardPolicy.OLD,
        allow_direct=True,
        max_msg_size=max_msg_bytes,
        # Memory is kept until it is forgotten: nothing ages out, and no count or size limit discards events.
        max_age=0,
        max_msgs=-1,
        max_bytes=-1,
    )


def stream_configs(replicas: int = 1) -> list[StreamConfig]:
    return [
        _stream_config(STREAM, STREAM_SUBJECTS, "epibus events", replicas, max_msg_bytes=EVENT_MAX_MSG_BYTES),
        _stream_config(DLQ_STREAM, DLQ_SUBJECTS, "epibus dead letters", replicas, max_msg_bytes=DLQ_MAX_MSG_BYTES),
    ]


@dataclass(frozen=True)
class BucketSpec:
    name: str
    history: int
    description: str
    ttl_s: float = 0.0  # a record older than this is dropped by the server (0: kept)


# A node's heartbeat is dropped this long after its last write: a node that died leaves the live set by itself.
HEARTBEAT_TTL_S = 4.0


# Every KV bucket epibus keeps, in one table: created with the configured replicas, like the streams.
BUCKETS: dict[str, BucketSpec] = {
    spec.name: spec
    for spec in (
        BucketSpec(AGENT_KEYS_BUCKET, 5, "epibus agent keys and roles"),
        BucketSpec(TOMBSTONES_BUCKET, 1, "epibus tombstones of retracted and rolled-back claims"),
        BucketSpec(MESH_BUCKET, 64, "epibus mesh: tasks, coordinators, capabilities"),
        BucketSpec(NODES_BUCKET, 1, "epibus nodes: each live node's signed heartbeat", ttl_s=HEARTBEAT_TTL_S),
    )
}


def managed_streams(replicas: int = 1) -> list[ManagedStream]:
    """Every stream epibus relies on, with what it needs of it: the event streams, then each bucket's."""
    events = [ManagedStream(config, EVENT_STREAM_FIELDS) for config in stream_configs(replicas)]
    buckets = [
        ManagedStream(
            kv_stream_config(spec.name, spec.description, history=spec.history, replicas=replicas, ttl_s=spec.ttl_s),
            MANAGED_FIELDS,
            bucket=spec.name,
        )
        for spec in BUCKETS.values()
    ]
    return events + buckets


# A node checks its streams this often while it stays connected, and at every reconnect.
DRIFT_CHECK_EVERY_S = 15.0
Found = list[tuple[ManagedStream, StreamConfig, list[Difference]]]


async def ensure_streams(
    js: JetStreamContext, *, replicas: int | None = None, repair: bool = False
) -> dict[str, list[Difference]]:
    """Create EPI and EPI_DLQ (and, for a node, the KV buckets) when missing, and compare every existing one
    with the configuration epibus needs. Returns what was changed, by stream.

    A difference in any managed field is drift: StreamDrift names each one and nothing is changed, unless
    `repair` restores the managed configuration. Applied without asking (logged): a node's configured
    replicas (`replicas=None`, a client, never changes them nor counts them as drift) and a message size limit
    on a stream that has none (`bus.drift.automatic`). Raises StreamDrift, Unavailable, ConfigError (the
    server refused to restore a setting)."""
    try:
        async with asyncio.timeout(JS_TIMEOUT_S):
            found = await _compare(js, replicas)
            drifted = {
                stream.name: [(d.field, d.text(first=i == 0)) for i, d in enumerate(refused)]
                for stream, _, diffs in found
                if (refused := [d for d in diffs if not (d.field == "num_replicas" or automatic(d))])
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
        # An APIError here is the server not being ready (e.g. just restarted, no JetStream leader yet).
        raise Unavailable("nats", f"cannot ensure streams: {type(e).__name__} {e}") from e


async def _compare(js: JetStreamContext, replicas: int | None) -> Found:
    found: Found = []
    for stream in managed_streams(replicas or 1):
        try:
            info = await js.stream_info(stream.name)
        except nats.js.errors.NotFoundError:
            if stream.bucket is None:
                await js.add_stream(stream.config)
            elif replicas is not None:  # a client leaves a missing bucket to open_bucket, on first use
                await open_bucket(js, stream.bucket, replicas=replicas)
            continue
        if replicas is None:
            stream.config.num_replicas = info.config.num_replicas
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
        )
    if replicas is not None:
        info = await js.stream_info(f"KV_{name}")
        if info.config.num_replicas != replicas:
            log.warning("bucket %s has %s replicas; setting %d", name, info.config.num_replicas, replicas)
            info.config.num_replicas = replicas
            await js.update_stream(info.config)
    return kv


WRONG_LAST_SEQUENCE = 10071


def translate_publish_error(error: BaseException, subject: str) -> EpibusError:
    """The one choke point from nats-py publish errors to epibus errors (Conflict is never retried blindly)."""
    if isinstance(error, nats.js.errors.APIError) and error.err_code == WRONG_LAST_SEQUENCE:
        return Conflict(subject, f"JetStream refused it: {error.description} (err_code {error.err_code})")
    if isinstance(error, NATS_UNAVAILABLE) or (isinstance(error, nats.js.errors.APIError) and error.code in (503, 408)):
        return Unavailable("nats", f"publish to {subject}: {type(error).__name__} {error}".strip())
    if isinstance(error, nats.js.errors.APIError):
        return InvalidEvent(
            f"message on {subject}", f"refused by JetStream: {error.description} (err_code {error.err_code})"
        )
    if isinstance(error, nats.errors.MaxPayloadError):
        return InvalidEvent(f"message on {subject}", "is larger than the server's max payload")
    # Not an outage: retrying would fail the same way, so say what it was instead of waiting for it.
    return ComponentFailed("nats", f"publish to {subject}: {error_summary(error)}")


CONNECT_ERRORS: tuple[type[BaseException], ...] = (*NATS_UNAVAILABLE, OSError)
# ...and the server refusing the connection (nats-py raises a plain Error quoting it).
CONNECT_OR_REFUSED: tuple[type[BaseException], ...] = (*CONNECT_ERRORS, nats.errors.Error)


async def open_nats(
    servers: Sequence[str],
    *,
    name: str,
    timeout_s: float,
    follow: NodeFollower | None = None,
    key: AgentKey | None = None,
    **callbacks: Any,
) -> NatsClient:
    """A reconnecting NATS connection, or Unavailable (naming the last connection error) if none is made
    within timeout_s. Connection errors go to `error_cb` if given, never to nats-py's traceback logging.
    With `follow`, every failed attempt asks where the local node runs now and reconnects there if it moved.
    With `key`, the connection authenticates with that nkey and receives on its own inboxes only; a server that
    does not know the key raises Forbidden. TLS (CA, client certificate) comes from the environment: see
    `bus.tls.nats_tls_context`."""
    tls = nats_tls_context()
    nc = NatsClient()
    errors: list[BaseException] = []  # only the last: an outage of hours fails an attempt every second
    user_error_cb = callbacks.pop("error_cb", None)

    async def remember(error: Exception) -> None:
        errors[:] = [error]
        if PERMISSIONS_VIOLATION in str(error).lower():
            violations = _VIOLATIONS.setdefault(nc, [])
            violations[:] = [*violations[-(MAX_VIOLATIONS_KEPT - 1) :], str(error)]
        moved = follow.moved() if follow is not None and not nc.is_closed else None
        if moved:
            log.warning("the local node now runs at %s; reconnecting there", ", ".join(moved))
            nc.set_server_pool(moved)  # the next reconnect attempt uses it
        if user_error_cb is not None:
            await user_error_cb(error)

    credentials = key.nats_credentials if key is not None else {}
    connecting = asyncio.ensure_future(
        nc.connect(
            servers=list(servers),
            name=name,
            connect_timeout=max(1, int(timeout_s)),
            reconnect_time_wait=1,
            max_reconnect_attempts=-1,  # keep trying; the outbox holds events meanwhile
            error_cb=remember,
            tls=tls,
            **credentials,
            **callbacks,
        )
    )
    try:
        async with asyncio.timeout(timeout_s):
            while not connecting.done():
                # A refused key is not an outage: stop at once instead of retrying until the timeout.
                await asyncio.wait({connecting}, timeout=0.05)
                if not nc.is_connected and errors and is_authorization_error(errors[-1]):
                    await cancel_and_wait([connecting])
                    raise errors[-1]
            await connecting
    except CONNECT_OR_REFUSED as e:
        with contextlib.suppress(*CONNECT_OR_REFUSED):  # closing a half-open client; nothing to lose
            await nc.close()
        last = errors[-1] if errors else e
        if is_authorization_error(last) or is_authorization_error(e):
            who = key.agent_id if key is not None else "(no key)"
            raise Forbidden(
                who,
                "connect to",
                ", ".join(servers),
                "the server requires an enrolled key; an admin enrols it: "
                f"epibus agent add {who} --key {key.public_key if key else 'PUBLIC_KEY'} --project P",
            ) from e
        if not isinstance(e, CONNECT_ERRORS):
            raise
        raise Unavailable(
            "nats", f"cannot connect to {', '.join(servers)}: {type(last).__name__} {last}; is the server running?"
        ) from e
    return nc


PERMISSIONS_VIOLATION = "permissions violation"
MAX_VIOLATIONS_KEPT = 32
# The broker's permission refusals per connection, as nats-py reports them (to error_cb, lowercased): the call
# that was refused only times out, so whoever translates that timeout asks here first.
_VIOLATIONS: weakref.WeakKeyDictionary[NatsClient, list[str]] = weakref.WeakKeyDictionary()


def broker_refusal(js_or_nc: JetStreamContext | NatsClient, subject: str, *, prefix: str = "") -> Forbidden | None:
    """A Forbidden for `subject` (a message or JetStream API subject; with `prefix`, any subject starting with
    `prefix` and ending with `subject`) if the broker reported refusing it on this connection, else None."""
    nc = js_or_nc._nc if isinstance(js_or_nc, JetStreamContext) else js_or_nc  # nats-py keeps its connection there
    wanted, start = subject.lower(), prefix.lower()
    for violation in reversed(_VIOLATIONS.get(nc, [])):
        quoted = violation.lower().rsplit(" to ", 1)[-1]
        if quoted.startswith(f'"{start}') and quoted.endswith(f'{wanted}"'):
            return Forbidden(
                "this agent", "use", subject, f"the broker refused it ({violation}); ask an admin for the project"
            )
    return None


def is_authorization_error(error: BaseException) -> bool:
    """nats-py reports a refused connection as AuthorizationError or as a plain Error quoting the server."""
    return isinstance(error, nats.errors.AuthorizationError) or "authorization violation" in str(error).lower()


def requires_authentication(nc: NatsClient) -> bool:
    """Whether the server this connection reached authenticates its clients (a node manages its streams then)."""
    return bool(nc._server_info.get("auth_required"))
