"""Hostile messages for the event stream, generated from a seed: what another agent or a raw NATS client can
publish on `epi.<project>.…`. Each comes with the category it was made from, so a failure names it."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from bus.broker.streams import EVENT_MAX_MSG_BYTES
from bus.identity.signing import AgentKey, wire_message
from bus.model.event import Envelope, encode_event
from bus.subjects import event_subject

WRONG_VALUES: list[Any] = [5, None, [], {}, "x", True, 1.5e308, -1, "", {"a": [1, {"b": None}]}]
FIELDS = ["event_id", "kind", "project", "artifact_id", "recorded_at", "body", "actor", "signature", "schema_version"]


class HostileMessage(NamedTuple):
    category: str
    subject: str
    data: bytes
    headers: dict[str, str] | None = None  # the template event's signature headers, kept as they were


class StreamFuzzer:
    """Makes hostile messages around real signed events. `make_event(text)` returns a new signed event of the
    honest agent; `impostor` signs with another key under the same agent name; `taken_ids` are event ids of
    valid events already published (for reusing one with other content)."""

    def __init__(
        self,
        rng: random.Random,
        project: str,
        make_event: Callable[..., Envelope],
        impostor: AgentKey,
        taken_ids: list[uuid.UUID],
    ) -> None:
        self.rng = rng
        self.project = project
        self.make_event = make_event
        self.impostor = impostor
        self.taken_ids = taken_ids
        self.counter = 0
        self.categories: dict[str, Callable[[], HostileMessage]] = {
            "random-bytes": self.random_bytes,
            "truncated": self.truncated,
            "wrong-type": self.wrong_type,
            "deep-nesting": self.deep_nesting,
            "huge-number": self.huge_number,
            "huge-string": self.huge_string,
            "non-utf8": self.non_utf8,
            "flipped-byte": self.flipped_byte,
            "reused-id": self.reused_id,
            "unknown-kind": self.unknown_kind,
            "subject-mismatch": self.subject_mismatch,
            "impostor-key": self.impostor_key,
            "far-future": self.far_future,
            "swapped-signature": self.swapped_signature,
        }

    def messages(self, count: int) -> Iterator[HostileMessage]:
        names = sorted(self.categories)
        for i in range(count):
            yield self.categories[names[i % len(names)]]()

    # -- helpers --------------------------------------------------------------------------------------------

    def _event(self) -> Envelope:
        self.counter += 1
        return self.make_event(f"hostile template {self.counter} {self.rng.random()}")

    def _subject(self, event: Envelope) -> str:
        return event_subject(event.project, event.kind, event.artifact_id)

    @staticmethod
    def _headers(event: Envelope) -> dict[str, str]:
        return dict(wire_message(event).headers)

    def _raw(self, event: Envelope) -> dict[str, Any]:
        raw: dict[str, Any] = json.loads(encode_event(event))
        return raw

    def _garbage_subject(self) -> str:
        return event_subject(self.project, self.rng.choice(["finding", "decision", "unknown"]), f"h{self.counter}")

    # -- categories -----------------------------------------------------------------------------------------

    def random_bytes(self) -> HostileMessage:
        self.counter += 1
        return HostileMessage("random-bytes", self._garbage_subject(), self.rng.randbytes(self.rng.randint(0, 3000)))

    def truncated(self) -> HostileMessage:
        event = self._event()
        data = encode_event(event)
        return HostileMessage(
            "truncated", self._subject(event), data[: self.rng.randint(0, len(data) - 1)], self._headers(event)
        )

    def wrong_type(self) -> HostileMessage:
        event = self._event()
        raw = self._raw(event)
        raw[self.rng.choice(FIELDS)] = self.rng.choice(WRONG_VALUES)
        return HostileMessage("wrong-type", self._subject(event), json.dumps(raw).encode(), self._headers(event))

    def deep_nesting(self) -> HostileMessage:
        self.counter += 1
        depth = self.rng.randint(1_000, 30_000)
        arrays = self.rng.random() < 0.5
        data = b"[" * depth + b"]" * depth if arrays else b'{"a":' * depth + b"1" + b"}" * depth
        return HostileMessage("deep-nesting", self._garbage_subject(), data)

    def huge_number(self) -> HostileMessage:
        event = self._event()
        digits = "9" * self.rng.randint(4_301, 20_000)
        raw = encode_event(event).decode()
        where = self.rng.choice(['"impact":', '"confidence":', '"schema_version":'])
        data = raw.replace(where, where + digits + ', "x":', 1) if where in raw else '{"event_id": ' + digits + "}"
        return HostileMessage("huge-number", self._subject(event), data.encode(), self._headers(event))

    def huge_string(self) -> HostileMessage:
        event = self._event()
        raw = self._raw(event)
        # Up to the stream's limit; past it the server refuses the publish (counted by the caller).
        raw["body"]["text"] = "x" * self.rng.randint(60_000, EVENT_MAX_MSG_BYTES + 2_000)
        return HostileMessage("huge-string", self._subject(event), json.dumps(raw).encode(), self._headers(event))

    def non_utf8(self) -> HostileMessage:
        event = self._event()
        data = bytearray(encode_event(event))
        at = data.index(b"hostile template") + self.rng.randint(0, 15)
        data[at] = self.rng.choice([0xFF, 0xC0, 0x80, 0xFE])
        return HostileMessage("non-utf8", self._subject(event), bytes(data), self._headers(event))

    def flipped_byte(self) -> HostileMessage:
        """One letter of the signed text changed: still valid JSON, no longer the signed content."""
        event = self._event()
        data = bytearray(encode_event(event))
        at = data.index(b"hostile template") + self.rng.randint(0, 15)
        data[at] = ord("Z") if data[at] != ord("Z") else ord("Q")
        return HostileMessage("flipped-byte", self._subject(event), bytes(data), self._headers(event))

    def reused_id(self) -> HostileMessage:
        """A correctly signed event that reuses a valid event's id with other content."""
        self.counter += 1
        taken = self.rng.choice(self.taken_ids)
        event = self.make_event(f"another claim under a taken id {self.counter}", event_id=taken)
        return HostileMessage("reused-id", self._subject(event), encode_event(event), self._headers(event))

    def unknown_kind(self) -> HostileMessage:
        event = self._event()
        raw = self._raw(event) | {"kind": "not_a_kind"}
        return HostileMessage(
            "unknown-kind",
            event_subject(self.project, "not_a_kind", event.artifact_id),
            _dump(raw),
            self._headers(event),
        )

    def subject_mismatch(self) -> HostileMessage:
        event = self._event()
        subject = event_subject(self.project, event.kind, f"elsewhere{self.counter}")
        return HostileMessage("subject-mismatch", subject, encode_event(event), self._headers(event))

    def impostor_key(self) -> HostileMessage:
        event = self._event()
        forged = self.impostor.sign(event.model_copy(update={"actor": self.impostor.actor, "signature": None}))
        return HostileMessage("impostor-key", self._subject(forged), encode_event(forged), self._headers(forged))

    def far_future(self) -> HostileMessage:
        event = self._event()
        when = self.rng.choice(["9999-12-31T23:59:59.999999-23:59", "2999-01-01T00:00:00Z"])
        raw = self._raw(event) | {"recorded_at": when}
        return HostileMessage("far-future", self._subject(event), _dump(raw), self._headers(event))

    def swapped_signature(self) -> HostileMessage:
        """A genuine event with another genuine event's signature headers (same agent, same key)."""
        event, other = self._event(), self._event()
        return HostileMessage("swapped-signature", self._subject(event), encode_event(event), self._headers(other))


def _dump(raw: dict[str, Any]) -> bytes:
    return json.dumps(raw).encode()
