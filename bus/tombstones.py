"""Tombstones, in one place: a retracted or rolled-back claim leaves one, keyed by the claim's normalised content
hash, and a later claim with the same content is flagged previously_retracted. This module owns the hash, the
record, its key in the KV bucket clients check before publishing, and that bucket's reader and writer; the journal
keeps its own table of them (observers/schema.py), derived by the same state rule."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from bus.errors import MalformedRecord
from bus.nats_errors import JS_TIMEOUT_S, nats_call
from bus.records import Quarantine
from bus.streams import open_bucket
from bus.subjects import PROJECT_PATTERN, TOMBSTONES_BUCKET, kv_stream, kv_subject

FLAG_PREVIOUSLY_RETRACTED = "previously_retracted"
CONTENT_HASH_PATTERN = re.compile(r"^[0-9a-f]{64}$")


@functools.lru_cache(maxsize=512)  # a batch asks it of each claim up to three times (load, decide, flags)
def content_hash(text: str) -> str:
    """The tombstone key of a claim: sha256 of its words, lowercased, punctuation and spacing ignored."""
    words = re.findall(r"\w+", text.lower())
    return hashlib.sha256(" ".join(words).encode()).hexdigest()


@dataclass(frozen=True)
class Tombstone:
    content_hash: str
    artifact_id: str
    event_id: str
    reason: str  # "retracted" or "rolled_back"


def tombstone_key(project: str, digest: str) -> str:
    """The tombstones bucket key of a content hash in a project: `<project>.<content hash>`."""
    return f"{project}.{digest}"


def decode_tombstone_key(subject: str, *, project: str) -> str:
    """The content hash of an `epibus_tombstones` record of `project`, from its KV stream subject
    (`$KV.epibus_tombstones.<project>.<hash>`). The registry reads keys only: a claim is tombstoned by its key,
    whatever the value says. Raises MalformedRecord."""
    prefix = kv_subject(TOMBSTONES_BUCKET, "")
    key = subject.removeprefix(prefix)
    parts = key.split(".")
    if not subject.startswith(prefix) or len(parts) != 2 or not PROJECT_PATTERN.fullmatch(parts[0]):
        raise MalformedRecord(TOMBSTONES_BUCKET, key, None, "is not a key of the form <project>.<content hash>")
    if parts[0] != project:
        raise MalformedRecord(TOMBSTONES_BUCKET, key, None, f"belongs to project {parts[0]}, not {project}")
    if not CONTENT_HASH_PATTERN.fullmatch(parts[1]):
        raise MalformedRecord(TOMBSTONES_BUCKET, key, None, "does not end in a content hash (64 lowercase hex)")
    return parts[1]


class TombstoneRegistry:
    """Content hashes of retracted and rolled-back claims per project, in a KV bucket `<project>.<hash>`."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._kv: KeyValue | None = None
        self.quarantine = Quarantine("tombstone registry")

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await open_bucket(self._js, TOMBSTONES_BUCKET)
        return self._kv

    async def hashes(self, project: str, *, timeout_s: float = JS_TIMEOUT_S) -> set[str]:
        """Every tombstoned content hash of a project, in one request (the keys of the KV stream). A key that
        is not `<project>.<content hash>` is quarantined and left out: it can flag or refuse nothing."""
        async with nats_call(f"tombstones of {project}", timeout_s=timeout_s):
            await self._bucket()
            info = await self._js.stream_info(
                kv_stream(TOMBSTONES_BUCKET), subjects_filter=kv_subject(TOMBSTONES_BUCKET, f"{project}.>")
            )
        found: set[str] = set()
        for subject in info.state.subjects or {}:
            try:
                found.add(decode_tombstone_key(subject, project=project))
            except MalformedRecord as e:
                self.quarantine.add(e)
        return found

    async def record(self, project: str, tombstone: Tombstone) -> None:
        value = json.dumps(
            {"artifact_id": tombstone.artifact_id, "event_id": tombstone.event_id, "reason": tombstone.reason}
        ).encode()
        async with nats_call("recording a tombstone"):
            kv = await self._bucket()
            await kv.put(tombstone_key(project, tombstone.content_hash), value)
