"""The one translation from nats-py and JetStream errors to epibus errors: which errors mean "the server did not
answer" (retry later), what a failed publish was, and the broker's permission refusals, which nats-py reports
only to error_cb while the refused call times out."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from bus.errors import ComponentFailed, Conflict, EpibusError, Forbidden, InvalidEvent, Unavailable, error_summary

# The deadline of one JetStream API call (stream info, KV get, a publish's PubAck).
JS_TIMEOUT_S = 10.0

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

CONNECT_ERRORS: tuple[type[BaseException], ...] = (*NATS_UNAVAILABLE, OSError)
# ...and the server refusing the connection (nats-py raises a plain Error quoting it).
CONNECT_OR_REFUSED: tuple[type[BaseException], ...] = (*CONNECT_ERRORS, nats.errors.Error)


WRONG_LAST_SEQUENCE = 10071
STREAM_FULL = 10077  # a stream with discard new at its byte or message limit
STORAGE_FULL = 10023  # "insufficient resources": the server's JetStream storage limit (max_file_store) is reached
INSUFFICIENT_STORAGE = 10047  # creating a stream whose byte limit the server cannot reserve
SEQUENCE_NOT_FOUND = 10043  # deleting a message already deleted
DELETE_FAILED = 10057  # ...or one purged ("no message found"); also a real store failure, told apart by its text


def message_gone(error: BaseException) -> bool:
    """Whether a refused `delete_msg` means the message is already gone (another node erased it first), which
    makes an erase idempotent; any other refusal is a failure."""
    if isinstance(error, nats.js.errors.NotFoundError):
        return True
    if not isinstance(error, nats.js.errors.APIError):
        return False
    return error.err_code == SEQUENCE_NOT_FOUND or (
        error.err_code == DELETE_FAILED and "no message found" in (error.description or "")
    )


def translate_publish_error(error: BaseException, subject: str) -> EpibusError:
    """The one choke point from nats-py publish errors to epibus errors (Conflict is never retried blindly)."""
    if isinstance(error, nats.js.errors.APIError) and error.err_code == WRONG_LAST_SEQUENCE:
        return Conflict(subject, f"JetStream refused it: {error.description} (err_code {error.err_code})")
    if isinstance(error, nats.js.errors.APIError) and error.err_code == STREAM_FULL:
        return Unavailable(
            "nats",
            f"publish to {subject}: the stream is full ({error.description}); the event waits in the outbox: the "
            "operator raises `epibus up --events-max-gib/--events-max-msgs`, or forgets and erases what is not needed",
        )
    if isinstance(error, nats.js.errors.APIError) and error.err_code == STORAGE_FULL:
        return Unavailable(
            "nats",
            f"publish to {subject}: the server's JetStream storage is full ({error.description}); `epibus health` on "
            "its node names the disk and its free space; free space there (an outboxed event is sent once there is "
            "room)",
        )
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


PERMISSIONS_VIOLATION = "permissions violation"
MAX_VIOLATIONS_KEPT = 32
# The broker's permission refusals per connection, as nats-py reports them (to error_cb, lowercased): the call
# that was refused only times out, so whoever translates that timeout asks here first.
_VIOLATIONS: weakref.WeakKeyDictionary[NatsClient, list[str]] = weakref.WeakKeyDictionary()
_NAMES: weakref.WeakKeyDictionary[NatsClient, str] = weakref.WeakKeyDictionary()


def _refuses(violation: str, wanted: str, start: str) -> bool:
    quoted = violation.lower().rsplit(" to ", 1)[-1]
    return quoted.startswith(f'"{start}') and quoted.endswith(f'{wanted}"')


def _forbidden(nc: NatsClient, subject: str, violation: str) -> Forbidden:
    return Forbidden(
        _NAMES.get(nc, "this connection"),
        "use",
        subject,
        f"the broker refused it ({violation.strip()}): the subject is outside the agent's projects or "
        "permissions (`epibus agent list` shows them; an admin changes them with `epibus agent add`), or "
        "the agent went over its publish budget and is suspended for up to a minute (`epibus stats`), or the "
        "node's disk is full and it takes no publishes until space is freed (`epibus health` names the disk)",
    )


def broker_refusal(js_or_nc: JetStreamContext | NatsClient, subject: str, *, prefix: str = "") -> Forbidden | None:
    """A Forbidden for `subject` (a message or JetStream API subject; with `prefix`, any subject starting with
    `prefix` and ending with `subject`) if the broker reported refusing it on this connection, else None."""
    nc = _connection(js_or_nc)
    wanted, start = subject.lower(), prefix.lower()
    for violation in reversed(_VIOLATIONS.get(nc, [])):
        if _refuses(violation, wanted, start):
            return _forbidden(nc, subject, violation)
    return None


@dataclass(eq=False)  # each watch is itself: kept in a set by identity
class _Watch:
    subject: str
    prefix: str
    task: asyncio.Task[object]
    refusal: Forbidden | None = None


_WATCHES: weakref.WeakKeyDictionary[NatsClient, set[_Watch]] = weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def refused_at_once(
    js_or_nc: JetStreamContext | NatsClient, subject: str, *, prefix: str = ""
) -> AsyncIterator[None]:
    """Around a call the broker may refuse: the server says so at once, but nats-py tells only error_cb and lets
    the call wait for its deadline. A refusal of `subject` (see broker_refusal) seen while the body runs cancels
    it and raises that Forbidden instead, so a refused agent hears why in milliseconds, not after 10 s."""
    nc = _connection(js_or_nc)
    task = asyncio.current_task()
    assert task is not None  # an async context manager runs in a task
    watch = _Watch(subject, prefix, task)
    watches = _WATCHES.setdefault(nc, set())
    watches.add(watch)
    try:
        yield
    except asyncio.CancelledError:
        # ours only (as asyncio.timeout decides): any other cancellation propagates untouched
        if watch.refusal is not None and task.uncancel() == 0:
            raise watch.refusal from None
        raise
    finally:
        watches.discard(watch)


def _connection(js_or_nc: JetStreamContext | NatsClient) -> NatsClient:
    return js_or_nc._nc if isinstance(js_or_nc, JetStreamContext) else js_or_nc  # nats-py keeps its connection there


def is_authorization_error(error: BaseException) -> bool:
    """nats-py reports a refused connection as AuthorizationError or as a plain Error quoting the server."""
    return isinstance(error, nats.errors.AuthorizationError) or "authorization violation" in str(error).lower()


def name_connection(nc: NatsClient, agent_id: str) -> None:
    """The agent a connection authenticates as, for the refusals the broker reports on it."""
    _NAMES[nc] = agent_id


def remember_violation(nc: NatsClient, error: BaseException) -> None:
    """Keep a permission refusal nats-py reported to error_cb, for broker_refusal to find (bounded per connection)."""
    if PERMISSIONS_VIOLATION in str(error).lower():
        kept = _VIOLATIONS.setdefault(nc, [])
        kept[:] = [*kept[-(MAX_VIOLATIONS_KEPT - 1) :], str(error)]
        for watch in _WATCHES.get(nc, set()):
            if watch.refusal is None and _refuses(str(error), watch.subject.lower(), watch.prefix.lower()):
                watch.refusal = _forbidden(nc, watch.subject, str(error))
                watch.task.cancel()


@contextlib.asynccontextmanager
async def nats_call(what: str, *, timeout_s: float = JS_TIMEOUT_S) -> AsyncIterator[None]:
    """The choke point of a call to NATS or JetStream: it must finish within `timeout_s`, and whatever means the
    server did not answer (or refused the API call) surfaces as Unavailable("nats", "<what>: <error>")."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except NATS_OR_API_ERROR as e:
        raise Unavailable("nats", f"{what}: {type(e).__name__} {e}") from e
