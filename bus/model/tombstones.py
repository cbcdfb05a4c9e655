"""Tombstones, in one place: a retracted or rolled-back claim leaves one, keyed by the claim's normalised content
hash, and a later claim with the same content is flagged previously_retracted. This module owns the hash, the
record and its key in the KV bucket (pure: no NATS here); bus/services/tombstone_registry.py reads and writes the
bucket, and the journal keeps its own table of them (observers/schema.py), derived by the same state rule."""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass

from bus.errors import MalformedRecord
from bus.subjects import PROJECT_PATTERN, TOMBSTONES_BUCKET, kv_subject

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
