"""The worked example in docs/wire-format.md is what the signing code makes now, and it verifies by the
document's own recipe with plain ed25519 (no epibus verifier)."""

from __future__ import annotations

import base64
import re

import nacl.signing

from epibus.ops.wire_example import DOCUMENT, REGENERATE, with_example


def test_the_worked_example_is_current() -> None:
    text = DOCUMENT.read_text()
    assert with_example(text) == text, f"the example in docs/wire-format.md is out of date: run `{REGENERATE}`"


def test_the_worked_example_verifies_by_the_documented_recipe() -> None:
    text = DOCUMENT.read_text()
    subject = re.search(r"Subject: `([^`]+)`", text)
    body = re.search(r"```json\n(.+)\n```", text)
    signature = re.search(r"Epibus-Event-Signature: (\S+)", text)
    key = re.search(r"Epibus-Event-Key: (U[A-Z2-7]{55})", text)
    parts = {"subject": subject, "body": body, "signature": signature, "key": key}
    assert [name for name, found in parts.items() if found is None] == [], f"the example lost a part: run {REGENERATE}"
    assert subject is not None
    assert body is not None
    assert signature is not None
    assert key is not None
    raw = base64.b32decode(key[1] + "=" * (-len(key[1]) % 8))
    assert raw[0] == 0xA0  # an nkey user public key
    signed = b"epibus-event-v2\n" + subject[1].encode() + b"\n" + body[1].encode()
    nacl.signing.VerifyKey(raw[1:33]).verify(signed, base64.urlsafe_b64decode(signature[1] + "=="))
    shown = re.search(r"Signed bytes .*?\n\n```\n(\S+)\n```", text, re.DOTALL)
    assert shown is not None
    assert base64.b64decode(shown[1]) == signed
