"""The AsyncAPI 3.0 document of the event stream, generated from the kind registry, the envelope model, the
subjects and the headers: `python -m epibus.ops.asyncapi` writes docs/asyncapi.json, `--check` says whether the
file is current. Every registered kind is one channel, with its body model's JSON schema."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import bus.model.authority  # noqa: F401 - registers the enrolment kind
import mesh.events  # noqa: F401 - registers the mesh's task and coordinators kinds
from bus.identity.signing import EVENT_DOMAIN, SIGNATURE_PATTERN
from bus.model.event import LEGACY_SCHEMA_VERSION, MAX_EVENT_BYTES, SCHEMA_VERSION, Envelope
from bus.model.kinds import kind_names, require_kind
from bus.model.vocab import DeadLetterReason
from bus.subjects import (
    ARTIFACT_PATTERN,
    DLQ_CONSUMER,
    DLQ_ERROR,
    DLQ_REASON,
    DLQ_STREAM,
    DLQ_STREAM_SEQ,
    DLQ_SUBJECT,
    EVENT_KEY_HEADER,
    EVENT_SIGNATURE_HEADER,
    KIND_PATTERN,
    MSG_ID_HEADER,
    PROJECT_PATTERN,
    STREAM,
    dlq_subject,
    event_subject,
)

DOCUMENT = Path(__file__).resolve().parents[2] / "docs" / "asyncapi.json"
REF = "#/components/schemas/{model}"
REGENERATE = "python -m epibus.ops.asyncapi"
SHIPPED_PACKAGES = frozenset({"bus", "observers", "mesh", "epibus"})
SIGNED_BYTES = f"{EVENT_DOMAIN.decode().strip()!r} + LF + subject + LF + body"


def _add_schemas(into: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """Move a pydantic schema's $defs into the shared components; two different models under one name raise."""
    for name, definition in schema.pop("$defs", {}).items():
        if into.setdefault(name, definition) != definition:
            raise ValueError(f"two different schemas are named {name}; rename one of the models")
    return schema


def _envelope_schemas(schemas: dict[str, Any]) -> None:
    envelope = _add_schemas(schemas, Envelope.model_json_schema(ref_template=REF))
    # Each kind's channel names its body model; the base model's empty schema would refuse every body.
    del schemas["Body"]
    envelope["properties"]["body"] = {"type": "object", "description": "The body of the event's kind."}
    current = json.loads(json.dumps(envelope))
    del current["properties"]["signature"]
    current["properties"]["schema_version"] = {"const": SCHEMA_VERSION, "title": "Schema Version", "type": "integer"}
    current["required"] = [*current["required"], "schema_version"]
    current["description"] = (
        f"An event as sent: the message body, JSON in UTF-8 (at most {MAX_EVENT_BYTES} bytes). Its signature is "
        f"not in it: it travels in the {EVENT_SIGNATURE_HEADER} header, over {SIGNED_BYTES}."
    )
    current["title"] = "Envelope"
    schemas["Envelope"] = current
    legacy = json.loads(json.dumps(envelope))
    legacy["properties"]["schema_version"] = {
        "const": LEGACY_SCHEMA_VERSION,
        "title": "Schema Version",
        "type": "integer",
    }
    legacy["properties"]["signature"] = {"pattern": SIGNATURE_PATTERN.pattern, "type": "string", "title": "Signature"}
    legacy["required"] = [*legacy["required"], "signature"]
    legacy["title"] = "LegacyEnvelope"
    legacy["description"] = (
        "An event in the legacy format (schema_version 1), still read and verified, never written: the signature "
        "is a member, over the canonical JSON (sorted keys, no whitespace) of every other member."
    )
    schemas["LegacyEnvelope"] = legacy
    schemas["EventHeaders"] = {
        "type": "object",
        "title": "EventHeaders",
        "description": "NATS headers of an event message (schema_version 2).",
        "required": [EVENT_SIGNATURE_HEADER, EVENT_KEY_HEADER],
        "properties": {
            EVENT_SIGNATURE_HEADER: {
                "type": "string",
                "pattern": SIGNATURE_PATTERN.pattern,
                "description": f"ed25519 signature, unpadded base64url, over {SIGNED_BYTES} (the body as sent).",
            },
            EVENT_KEY_HEADER: {
                "type": "string",
                "pattern": r"^U[A-Z2-7]{55}$",
                "description": "The signing nkey user public key; must equal actor.public_key and the key "
                "registered to actor.agent_id.",
            },
            MSG_ID_HEADER: {"type": "string", "description": "The event_id: JetStream drops a resent event."},
        },
    }


def _kind_parts(kind: str, schemas: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    body = require_kind(kind).body
    body_schema = _add_schemas(schemas, body.model_json_schema(ref_template=REF))
    name = body.__name__
    if schemas.setdefault(name, body_schema) != body_schema:
        raise ValueError(f"two different body models are named {name}; rename one")
    event_schema = {
        "title": f"{kind} event",
        "allOf": [
            {"$ref": REF.format(model="Envelope")},
            {"type": "object", "properties": {"kind": {"const": kind}, "body": {"$ref": REF.format(model=name)}}},
        ],
    }
    schemas[f"{kind}_event"] = event_schema
    message = {
        "name": kind,
        "title": f"{kind} event",
        "summary": (body.__doc__ or f"A {kind} event.").split("\n")[0].strip(),
        "contentType": "application/json",
        "headers": {"$ref": REF.format(model="EventHeaders")},
        "payload": {"$ref": REF.format(model=f"{kind}_event")},
    }
    channel = {
        "address": event_subject("{project}", kind, "{artifact_id}"),
        "title": f"{kind} events",
        "description": f"Stream {STREAM}. Transition: {str(require_kind(kind).transition).lower()}.",
        "parameters": {
            "project": {"$ref": "#/components/parameters/project"},
            "artifact_id": {"$ref": "#/components/parameters/artifact_id"},
        },
        "messages": {
            kind: {"$ref": f"#/components/messages/{kind}"},
            "legacy": {"$ref": "#/components/messages/legacy"},
        },
    }
    return message, channel


def _dead_letters() -> tuple[dict[str, Any], dict[str, Any]]:
    reasons = [r.value for r in DeadLetterReason]
    headers: dict[str, dict[str, Any]] = {
        name: {"type": "string"} for name in (DLQ_REASON, DLQ_ERROR, DLQ_SUBJECT, DLQ_STREAM_SEQ, DLQ_CONSUMER)
    }
    headers[DLQ_REASON]["enum"] = reasons
    for name in (EVENT_SIGNATURE_HEADER, EVENT_KEY_HEADER):
        headers[name] = {"type": "string", "description": "Kept from the refused message, for `epibus dlq replay`."}
    message = {
        "name": "dead_letter",
        "title": "dead letter",
        "summary": "A message a consumer refused or gave up on, as received, with the reason.",
        "headers": {"type": "object", "properties": headers, "required": [DLQ_REASON, DLQ_SUBJECT]},
        "payload": {"type": "string", "format": "binary"},
    }
    channel = {
        "address": dlq_subject("{consumer}", "{reason}"),
        "title": "dead letters",
        "description": f"Stream {DLQ_STREAM}.",
        "parameters": {
            "consumer": {"description": "The consumer that refused it."},
            "reason": {"enum": reasons},
        },
        "messages": {"dead_letter": {"$ref": "#/components/messages/dead_letter"}},
    }
    return message, channel


def shipped_kinds() -> list[str]:
    """The registered kinds epibus itself defines: a kind an application (or a test) registers in the same
    process is its own, not part of the repository's document."""
    return [k for k in kind_names() if require_kind(k).body.__module__.split(".")[0] in SHIPPED_PACKAGES]


def document() -> dict[str, Any]:
    """The AsyncAPI document, built from the models and names as they are now."""
    schemas: dict[str, Any] = {}
    _envelope_schemas(schemas)
    messages: dict[str, Any] = {
        "legacy": {
            "name": "legacy",
            "title": "legacy event",
            "summary": "An event written before schema_version 2: no signature headers, the signature inside.",
            "contentType": "application/json",
            "payload": {"$ref": REF.format(model="LegacyEnvelope")},
        }
    }
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for kind in shipped_kinds():
        messages[kind], channels[kind] = _kind_parts(kind, schemas)
        for action in ("send", "receive"):
            operations[f"{action}_{kind}"] = {"action": action, "channel": {"$ref": f"#/channels/{kind}"}}
    messages["dead_letter"], channels["dead_letters"] = _dead_letters()
    operations["receive_dead_letters"] = {"action": "receive", "channel": {"$ref": "#/channels/dead_letters"}}
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "epibus event stream",
            "version": str(SCHEMA_VERSION),
            "description": "Signed epistemic events on NATS JetStream. The wire format is described in "
            "docs/wire-format.md; this document is generated by `" + REGENERATE + "`.",
        },
        "defaultContentType": "application/json",
        "servers": {
            "node": {
                "host": "127.0.0.1:4222",
                "protocol": "nats",
                "description": "An epibus node's embedded nats-server; clients authenticate with their nkey.",
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {
            "schemas": dict(sorted(schemas.items())),
            "messages": messages,
            "parameters": {
                "project": {"description": f"The project slug, matching {PROJECT_PATTERN.pattern}."},
                "artifact_id": {"description": f"The artifact id, matching {ARTIFACT_PATTERN.pattern}."},
                "kind": {"description": f"An event kind, matching {KIND_PATTERN.pattern}."},
            },
        },
    }


def rendered() -> str:
    return json.dumps(document(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epibus.ops.asyncapi", description=__doc__)
    parser.add_argument("--output", type=Path, default=DOCUMENT, help="Where to write (default docs/asyncapi.json).")
    parser.add_argument("--check", action="store_true", help="Exit 1 when the file differs from the models.")
    args = parser.parse_args(argv)
    text = rendered()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date; regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
