"""docs/asyncapi.json is what the models generate now, and its schemas accept real events and refuse others."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from bus.identity.signing import AgentKey, wire_message
from bus.model.event import draft_event
from bus.subjects import event_subject
from epibus.ops.asyncapi import DOCUMENT, REGENERATE, document, rendered, shipped_kinds
from tests.conftest import finding


def test_the_document_in_the_repository_is_what_the_models_generate() -> None:
    assert DOCUMENT.read_text() == rendered(), f"docs/asyncapi.json is out of date: run `{REGENERATE}`"


def _validator(name: str) -> jsonschema.Draft202012Validator:
    # The whole document as the root, so the components' "#/components/schemas/…" references resolve.
    return jsonschema.Draft202012Validator({**document(), "$ref": f"#/components/schemas/{name}"})


def test_every_kind_has_a_channel_on_its_subject_with_its_body_schema() -> None:
    doc = document()
    assert set(shipped_kinds()) >= {"finding", "forgotten", "enrolment", "task", "coordinators"}
    for kind in shipped_kinds():
        channel = doc["channels"][kind]
        assert channel["address"] == event_subject("{project}", kind, "{artifact_id}")
        assert f"{kind}_event" in doc["components"]["schemas"]
        assert doc["operations"][f"send_{kind}"]["channel"] == {"$ref": f"#/channels/{kind}"}


def test_a_real_event_and_its_headers_match_the_schemas_and_a_signature_in_the_body_does_not() -> None:
    key = AgentKey.generate("alice")
    event = key.sign(draft_event("finding", finding(1), project="p", actor=key.actor, session_id="s"))
    wire = wire_message(event)
    body: dict[str, Any] = json.loads(wire.data)
    _validator("finding_event").validate(body)
    _validator("EventHeaders").validate(dict(wire.headers))
    assert not _validator("finding_event").is_valid(body | {"signature": event.signature})
    assert not _validator("finding_event").is_valid(body | {"kind": "unknown"})
    assert not _validator("finding_event").is_valid(body | {"body": {"question": "q", "impact": 0.1}})
    legacy = json.loads(wire_message(key.sign_v1(event)).data)
    _validator("LegacyEnvelope").validate(legacy)
    assert not _validator("Envelope").is_valid(legacy)
