"""Decoding the KV records epibus reads, and quarantining those it cannot. A decoder returns its typed value
or raises MalformedRecord, whatever the bytes are; a reader that meets one puts it in its Quarantine
(counted, logged once) and goes on past it.

The bus's two buckets are decoded here; the mesh bucket's records are decoded in mesh.store."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from bus.errors import MalformedRecord, validation_message
from bus.model.auth import PUBLIC_KEY_PATTERN, Enrolment, first_use_enrolment
from bus.subjects import AGENT_KEYS_BUCKET

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


def decode_json(model: type[M], data: bytes, *, bucket: str, key: str, revision: int | None) -> M:
    """The record as `model`. Raises MalformedRecord for anything else: not UTF-8, not JSON, nested or sized
    past the parser's limits, or JSON of another shape."""
    try:
        return model.model_validate_json(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0] if e.error_count() else None
        where = ".".join(str(p) for p in first["loc"]) if first and first["loc"] else ""
        problem = (
            f"{where}: {validation_message(first)}"
            if first and where
            else (validation_message(first) if first else str(e))
        )
        raise MalformedRecord(bucket, key, revision, f"holds no valid {model.__name__} ({problem})") from e
    except (ValueError, RecursionError) as e:  # the parser's own limits, should a validator reach them
        raise MalformedRecord(bucket, key, revision, f"holds no valid {model.__name__} ({type(e).__name__})") from e


def decode_enrolment(data: bytes, *, key: str, revision: int | None) -> Enrolment:
    """The enrolment an `epibus_agents` record holds for agent `key`. A record of an older epibus holds only
    the public key bound on first use: it reads as an agent of every project, its own owner. Raises
    MalformedRecord, also for a record naming another agent than its key."""
    if data[:1] == b"{":
        enrolment = decode_json(Enrolment, data, bucket=AGENT_KEYS_BUCKET, key=key, revision=revision)
        if enrolment.agent_id != key:
            raise MalformedRecord(AGENT_KEYS_BUCKET, key, revision, f"enrols {enrolment.agent_id!r}, not {key!r}")
        return enrolment
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise MalformedRecord(AGENT_KEYS_BUCKET, key, revision, "is not an ASCII public key") from None
    if not PUBLIC_KEY_PATTERN.fullmatch(text):
        raise MalformedRecord(
            AGENT_KEYS_BUCKET, key, revision, f"holds {text[:24]!r}, not a public key (U followed by 55 base32)"
        )
    try:
        return first_use_enrolment(key, text, enrolled_at=datetime.fromtimestamp(0, UTC))
    except ValidationError as e:  # the key is no agent id
        raise MalformedRecord(AGENT_KEYS_BUCKET, key, revision, "is not an agent id") from e


def decode_agent_key(data: bytes, *, key: str, revision: int | None) -> str:
    """The public key an `epibus_agents` record binds to agent `key`. Raises MalformedRecord."""
    return decode_enrolment(data, key=key, revision=revision).public_key


@dataclass(frozen=True)
class QuarantinedRecord:
    bucket: str
    key: str
    revision: int | None
    reason: str

    def as_json(self) -> dict[str, Any]:
        return {"bucket": self.bucket, "key": self.key, "revision": self.revision, "reason": self.reason}


class Quarantine:
    """The records one reader skipped because it could not understand them. Each is counted and logged
    (WARNING, with bucket, key and revision) once, however often the reader meets it again."""

    def __init__(self, reader: str) -> None:
        self.reader = reader
        self._records: dict[tuple[str, str, int | None], QuarantinedRecord] = {}

    def add(self, error: MalformedRecord) -> bool:
        """Remember a record that did not decode. True the first time this reader meets it."""
        ident = (error.bucket, error.key, error.revision)
        if ident in self._records:
            return False
        self._records[ident] = QuarantinedRecord(error.bucket, error.key, error.revision, error.reason)
        log.warning("%s: quarantined %s", self.reader, error)
        return True

    @property
    def count(self) -> int:
        return len(self._records)

    @property
    def records(self) -> list[QuarantinedRecord]:
        return list(self._records.values())
