"""The worked example of docs/wire-format.md, made by the real signing code from a fixed key, event id and
time (ed25519 is deterministic, so it never changes unless the format does). `python -m epibus.ops.wire_example`
rewrites the example between its markers in the document; `--check` says whether it is current."""

from __future__ import annotations

import argparse
import base64
import hashlib
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import nkeys

from bus.identity.signing import AgentKey, event_signed_bytes, wire_message
from bus.model.event import draft_event
from bus.subjects import EVENT_SIGNATURE_HEADER, MSG_ID_HEADER

DOCUMENT = Path(__file__).resolve().parents[2] / "docs" / "wire-format.md"
BEGIN = "<!-- example:begin (python -m epibus.ops.wire_example) -->"
END = "<!-- example:end -->"
REGENERATE = "python -m epibus.ops.wire_example"
EVENT_ID = uuid.UUID("019a0f3c-8e00-7000-8000-00000000e0b1")
RECORDED_AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def example_key() -> AgentKey:
    """A key anyone can rebuild (never use it for anything): its seed is sha256 of a fixed phrase."""
    raw = hashlib.sha256(b"epibus wire-format example key").digest()
    return AgentKey("example-agent", nkeys.encode_seed(raw, nkeys.PREFIX_BYTE_USER))


def example_markdown() -> str:
    key = example_key()
    body = {"text": "The cache is cold after a deploy.", "impact": 0.4, "confidence": 0.7, "subject": "cache"}
    draft = draft_event(
        "finding", body, project="demo", actor=key.actor, session_id="s1", event_id=EVENT_ID, recorded_at=RECORDED_AT
    )
    event = key.sign(draft)
    wire = wire_message(event)
    signed = event_signed_bytes(wire.subject, wire.data)
    signature = base64.urlsafe_b64decode(wire.headers[EVENT_SIGNATURE_HEADER] + "==")
    headers = "\n".join(f"{name}: {value}" for name, value in wire.headers.items())
    return "\n".join(
        [
            BEGIN,
            "The agent `example-agent` (its seed is the SHA-256 of `epibus wire-format example key`, encoded as an",
            "nkey user seed: never use it) publishes a finding in project `demo`.",
            "",
            f"Subject: `{wire.subject}`",
            "",
            "Headers (with `Nats-Msg-Id` set to the event id):",
            "",
            "```",
            headers,
            f"{MSG_ID_HEADER}: {event.event_id}",
            "```",
            "",
            f"Body ({len(wire.data)} bytes, shown as UTF-8; these bytes exactly):",
            "",
            "```json",
            wire.data.decode(),
            "```",
            "",
            f"Signed bytes ({len(signed)} bytes: prefix, subject, newline, body), base64:",
            "",
            "```",
            base64.b64encode(signed).decode(),
            "```",
            "",
            f"Ed25519 public key (32 bytes, hex), from the nkey: `{_raw_public_key(key.public_key).hex()}`",
            "",
            f"Signature (64 bytes, hex): `{signature.hex()}`",
            "",
            END,
        ]
    )


def _raw_public_key(public_key: str) -> bytes:
    return base64.b32decode(public_key + "=" * (-len(public_key) % 8))[1:33]


def with_example(text: str) -> str:
    """The document with its example block replaced by the current one."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + example_markdown() + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description=__doc__)
    parser.add_argument("--check", action="store_true", help="Exit 1 when the document's example is not current.")
    args = parser.parse_args(argv)
    text = DOCUMENT.read_text()
    current = with_example(text)
    if args.check:
        if current != text:
            print(f"the example in {DOCUMENT} is out of date; regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    DOCUMENT.write_text(current)
    print(f"wrote the example into {DOCUMENT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
