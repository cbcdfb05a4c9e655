"""The one error tree of epibus, split by what the caller does next.

Every error's str() is one line: what went wrong and how to fix it."""

from __future__ import annotations

import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


class EpibusError(Exception):
    """Root of every error epibus raises on purpose."""

    def __str__(self) -> str:
        # One line, always: driver messages (psycopg, nats) can span several.
        return " ".join(super().__str__().split())

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors cross processes (the mirror's engine answers its node with them): rebuilt with their fields and
        # message, whatever arguments their __init__ takes.
        return (_rebuilt, (type(self), self.args, self.__dict__))


def _rebuilt(cls: type[EpibusError], args: tuple[Any, ...], fields: dict[str, Any]) -> EpibusError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(fields)
    return error


class InvalidEvent(EpibusError, ValueError):
    """An event (or a field of one) failed validation; nothing was written."""

    def __init__(self, field: str, problem: str, *, allowed: Iterable[str] | None = None) -> None:
        self.field = field
        self.problem = problem
        self.allowed = tuple(allowed) if allowed is not None else None
        message = f"{field}: {problem}"
        if self.allowed is not None:
            message += " not in {" + ", ".join(self.allowed) + "}"
        super().__init__(message)


class MalformedRecord(InvalidEvent):
    """A KV record epibus cannot understand (bad bytes, the wrong shape, content its key contradicts). Readers
    quarantine it: counted, logged once, skipped past; nothing acts on it."""

    def __init__(self, bucket: str, key: str, revision: int | None, reason: str) -> None:
        self.bucket = bucket
        self.key = key
        self.revision = revision
        # What a hostile record holds (a key or field name) reaches logs and terminals: printable text only.
        self.reason = _printable(reason, 500)
        where = f"{bucket} key {_printable(key, 300)}" + (f" (revision {revision})" if revision is not None else "")
        super().__init__(
            where, f"{self.reason}; it is skipped: rewrite it, or delete it with `nats kv del {bucket} {key}`"
        )


def _printable(text: str, limit: int) -> str:
    return "".join(c if c.isprintable() else "?" for c in " ".join(text.split())[:limit])


class IllegalTransition(EpibusError):
    """A state change that the transition table does not allow."""

    def __init__(self, artifact_id: str, current: str, requested: str, reason: str, *, what: str = "artifact") -> None:
        self.artifact_id = artifact_id
        self.current = current
        self.requested = requested
        self.reason = reason
        super().__init__(f"{what} {artifact_id}: {current} -> {requested} is illegal: {reason}")


class Forbidden(EpibusError, PermissionError):
    """The acting agent is not one that may do this (e.g. a decision by an agent that is not a coordinator)."""

    def __init__(self, agent: str, action: str, target: str, rule: str) -> None:
        self.agent = agent
        self.action = action
        self.target = target
        self.rule = rule
        super().__init__(f"agent {agent!r} may not {action} {target}: {rule}")


class Conflict(EpibusError):
    """Another writer got there first (expected sequence or revision); re-read and retry deliberately."""

    def __init__(
        self, what: str, detail: str, fix: str = "re-read the current state and retry", *, lost_race: bool = False
    ) -> None:
        self.what = what
        self.detail = detail
        self.lost_race = lost_race  # a compare-and-set another writer won: re-reading and deciding again is safe
        super().__init__(f"conflict on {what}: {detail}; {fix}")


class NotFound(EpibusError, LookupError):
    """The thing asked for does not exist in the store that was asked."""

    def __init__(self, what: str, key: str, hint: str = "") -> None:
        self.what = what
        self.key = key
        self.hint = hint
        super().__init__(f"{what} {key!r} not found" + (f"; {hint}" if hint else ""))


class AmbiguousId(EpibusError, LookupError):
    """An id prefix that more than one id starts with: the matches are listed, a longer prefix picks one."""

    def __init__(self, field: str, prefix: str, what: str, where: str, matches: Sequence[str], more: bool) -> None:
        self.field = field
        self.prefix = prefix
        self.what = what
        self.where = where
        self.matches = tuple(matches)
        self.more = more
        listed = ", ".join(self.matches) + (", …" if more else "")
        super().__init__(
            f"{field}={prefix!r} is ambiguous: {'more than ' if more else ''}{len(self.matches)} {what}s {where} "
            f"start with it ({listed}); give more characters"
        )


class Unavailable(EpibusError):
    """A component did not answer in time or refused the connection; retrying later may succeed."""

    def __init__(self, component: str, cause: str) -> None:
        self.component = component
        self.cause = cause
        super().__init__(f"{component} unavailable: {cause}")


class DiskFull(Unavailable):
    """A store did not write: the filesystem under it has less free space than the reserve. Nothing was lost;
    an observer holds its events and resumes by itself once space returns."""

    def __init__(self, writer: str, path: str, free_bytes: int, reserve_bytes: int) -> None:
        self.writer = writer
        self.path = path
        self.free_bytes = free_bytes
        self.reserve_bytes = reserve_bytes
        super().__init__(
            writer,
            f"disk full: {path} has {_mib(free_bytes)} free, below the reserve of {_mib(reserve_bytes)}; "
            "free space there or lower EPIBUS_DISK_RESERVE_MB",
        )


class StoreDamaged(Unavailable):
    """A store's files are damaged (a torn page, a cut file): what it holds cannot be read until it is rebuilt
    from the stream. Not the event's fault, so observers hold events instead of dead-lettering them."""

    def __init__(self, store: str, path: str, damage: str, remedy: str) -> None:
        self.store = store
        self.path = path
        self.damage = damage
        self.remedy = remedy
        Exception.__init__(self, f"{store} damaged: {path}: {damage}; {remedy}")
        self.component = store
        self.cause = damage


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.0f} MiB"


class ComponentFailed(EpibusError):
    """A component answered, but failed or refused this request, and asking again later will not help (a bug,
    a request it rejects). Not an outage: a consumer spends deliveries on it and then dead-letters the event
    with this message, instead of waiting forever as it does for Unavailable."""

    def __init__(self, component: str, cause: str) -> None:
        self.component = component
        self.cause = cause
        super().__init__(f"{component} failed: {cause}")


class ModelMismatch(EpibusError):
    """Vectors from one embedding model were offered to a collection built for another."""

    def __init__(self, expected: str, got: str) -> None:
        self.expected = expected
        self.got = got
        super().__init__(f"embedding model mismatch: collection has {expected}, got {got}; reindex first")


class ConfigError(EpibusError, ValueError):
    """Configuration is missing or names something that does not exist."""

    def __init__(self, setting: str, problem: str, *, allowed: Iterable[str] | None = None) -> None:
        self.setting = setting
        self.problem = problem
        self.allowed = tuple(allowed) if allowed is not None else None
        message = f"{setting}: {problem}"
        if self.allowed is not None:
            message += " (allowed: " + ", ".join(self.allowed) + ")"
        super().__init__(message)


class StreamDrift(ConfigError):
    """A stream or KV bucket epibus relies on is configured otherwise than epibus needs (changed by hand, by
    another tool or by an attacker). Nothing was changed; `epibus streams repair` restores it."""

    def __init__(self, drifted: Mapping[str, Sequence[tuple[str, str]]]) -> None:
        # drifted: stream name -> (field, "field=current (needs wanted)") for each difference
        self.fields = {stream: [field for field, _ in found] for stream, found in drifted.items()}
        self.setting = ", ".join(drifted)
        self.problem = "; ".join(
            f"stream {stream} drifted: " + ", ".join(text for _, text in found) for stream, found in drifted.items()
        )
        self.allowed = None
        them = "it" if len(drifted) == 1 else "them"
        EpibusError.__init__(self, f"{self.problem}; run `epibus streams repair` to restore {them}")


def error_summary(error: BaseException, *, limit: int = 1024) -> str:
    """One line for a failure that is a bug rather than an outage: its type, message and the line that raised
    it, so a dead letter or a log line says where to look without a traceback."""
    where = ""
    frames = traceback.extract_tb(error.__traceback__)
    if frames:
        last = frames[-1]
        where = f" (at {Path(last.filename).name}:{last.lineno} in {last.name})"
    return " ".join(f"{type(error).__name__}: {error}{where}".split())[:limit]


class LimitReached(EpibusError):
    """A configured limit refused the request: nothing was done. Carries the limit's name, its number and what
    frees room (waiting, closing something, or an operator raising the limit)."""

    def __init__(self, limit: str, allowed: int, detail: str, fix: str) -> None:
        self.limit = limit
        self.allowed = allowed
        self.detail = detail
        super().__init__(f"limit {limit} ({allowed}) reached: {detail}; {fix}")


def validation_message(error: Mapping[str, object]) -> str:
    """A pydantic error's message as a person reads it: without the "Value error, " a validator's ValueError
    gets in front of its own words."""
    return str(error.get("msg", "")).removeprefix("Value error, ").removeprefix("Assertion failed, ")
