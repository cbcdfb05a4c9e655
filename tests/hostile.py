"""Hostile KV records: values a reader must turn into a typed error (and skip), never a crash. Shared by the
quarantine tests and any fuzz test that writes raw records into epibus's buckets. Also the request bodies no
request service of a node accepts (`hostile_requests`), for the tests that send them raw."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

from nats.js import JetStreamContext

from bus.subjects import JOURNAL_LOOKUP, PROVE_FORGOTTEN, RECALL, REINDEX, VERIFY

HUGE_NUMBER = "9" * 5000  # past Python's 4300-digit int/str conversion limit
DEEP_NESTING = "[" * 30000  # past any JSON parser's recursion limit


class Hostile(NamedTuple):
    name: str
    value: bytes


def hostile_payloads() -> list[Hostile]:
    """Values no KV record type of epibus accepts: not JSON, the wrong JSON, or JSON built to break a parser."""
    return [
        Hostile("empty", b""),
        Hostile("not-json", b"{not json"),
        Hostile("json-list", b"[1, 2, 3]"),
        Hostile("json-null", b"null"),
        Hostile("json-string", b'"a string"'),
        Hostile("wrong-types", json.dumps({"proposal": 5, "state": [], "steps": "x", "agent": 7}).encode()),
        Hostile("deep-nesting", DEEP_NESTING.encode()),
        Hostile("deep-object", ('{"a":' * 30000).encode()),
        Hostile("huge-number", f'{{"steps": {HUGE_NUMBER}}}'.encode()),
        Hostile("non-utf8", b'{"proposal": "\xff\xfe\xfd"}'),
        Hostile("nul-bytes", b"\x00" * 64),
    ]


def hostile_task_records(good: dict[str, Any]) -> list[Hostile]:
    """Task records that parse but must not be believed, derived from `good` (a task record as the mesh bucket
    holds it, with at least one step): no steps, a state its steps contradict, a history whose steps do not
    follow each other, content that belongs under another key, a huge number inside the payload."""
    proposal = good["proposal"]
    first = good["steps"][0]
    broken_chain = [first, first | {"from_state": "working", "to_state": "completed"}]
    return [
        Hostile("steps-empty", _json(good | {"steps": []})),
        Hostile("state-not-last-step", _json(good | {"state": "acknowledged"})),
        Hostile("broken-chain", _json(good | {"steps": broken_chain, "state": "completed"})),
        Hostile("other-project", _json(good | {"proposal": proposal | {"project": "someone-else"}})),
        Hostile("other-task-id", _json(good | {"proposal": proposal | {"task_id": "not-this-key"}})),
        Hostile(
            "huge-number-in-payload",
            _json(good | {"proposal": proposal | {"payload": {"n": 0}}}).replace(
                b'{"n": 0}', b'{"n": ' + HUGE_NUMBER.encode() + b"}"
            ),
        ),
    ]


def all_hostile_task_records(good: dict[str, Any]) -> list[Hostile]:
    return hostile_payloads() + hostile_task_records(good)


def _json(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode()


async def put_raw(js: JetStreamContext, bucket: str, key: str, value: bytes) -> int:
    """Write a value as any nats-py client could, around every epibus check. Returns its revision."""
    kv = await js.key_value(bucket)
    return int(await kv.put(key, value))


class HostileRequest(NamedTuple):
    name: str
    body: bytes
    field: str  # what the refusal must name: the error starts with `<field>=` or `<field> is missing`


NOT_UTF8 = b'{"project": "\xff\xfe\xfd"}'
HUGE = 900_000  # characters: a body just under nats-server's 1 MiB max_payload


def hostile_requests(subject: str) -> list[HostileRequest]:
    """Request bodies no node accepts on one request subject (RECALL, VERIFY, PROVE_FORGOTTEN, REINDEX or
    JOURNAL_LOOKUP), each with the field its refusal must name. None of them may go unanswered."""
    if subject == JOURNAL_LOOKUP:  # its request is a bare JSON list of event ids
        return _lookup_requests()
    return _OBJECT_BODIES + _REQUESTS[subject]()


def _body(value: object) -> bytes:
    return json.dumps(value).encode()


_OBJECT_BODIES = [  # refused by every service whose request is a JSON object
    HostileRequest("empty", b"", "body"),
    HostileRequest("not-json", b"{not json", "body"),
    HostileRequest("not-utf8", NOT_UTF8, "body"),
    HostileRequest("json-list", b"[1]", "body"),
    HostileRequest("json-empty-list", b"[]", "body"),
    HostileRequest("json-null", b"null", "body"),
    HostileRequest("json-string", b'"recall"', "body"),
    HostileRequest("deep-nesting", ("[" * 30000).encode(), "body"),
    HostileRequest("unknown-field", b'{"bogus": 1}', "bogus"),
]


def _recall_requests() -> list[HostileRequest]:
    good: dict[str, object] = {"query": "x", "project": "p", "k": 5}
    return [
        HostileRequest("k-negative", _body(good | {"k": -5}), "k"),
        HostileRequest("k-zero", _body(good | {"k": 0}), "k"),
        HostileRequest("k-too-many", _body(good | {"k": 1_000_000}), "k"),
        HostileRequest("k-infinite", b'{"query": "x", "project": "p", "k": 1e999}', "k"),
        HostileRequest("k-nan", b'{"query": "x", "project": "p", "k": NaN}', "k"),
        HostileRequest("k-bool", _body(good | {"k": True}), "k"),
        HostileRequest("k-string", _body(good | {"k": "5"}), "k"),
        HostileRequest("k-float", _body(good | {"k": 5.0}), "k"),
        HostileRequest("k-huge-number", b'{"query": "x", "project": "p", "k": ' + b"9" * 5000 + b"}", "body"),
        HostileRequest("query-missing", _body({"project": "p"}), "query"),
        HostileRequest("query-blank", _body(good | {"query": "   "}), "query"),
        HostileRequest("query-huge", _body(good | {"query": "x" * HUGE}), "query"),
        HostileRequest("query-number", _body(good | {"query": 5}), "query"),
        HostileRequest("project-not-a-slug", _body(good | {"project": "Not A Slug"}), "project"),
        HostileRequest("project-wildcard", _body(good | {"project": "p.>"}), "project"),
        HostileRequest("kinds-not-a-list", _body(good | {"kinds": "finding"}), "kinds"),
        HostileRequest("kinds-bad-name", _body(good | {"kinds": ["Not a kind"]}), "kinds[0]"),
        HostileRequest("kinds-too-many", _body(good | {"kinds": ["finding"] * 10_000}), "kinds"),
        HostileRequest("as-of-naive", _body(good | {"as_of": "2024-01-01T00:00:00"}), "as_of"),
        HostileRequest("as-of-garbage", _body(good | {"as_of": "yesterday"}), "as_of"),
        HostileRequest(
            "as-of-past-the-last-utc-day", _body(good | {"as_of": "9999-12-31T23:59:59.999999-23:59"}), "as_of"
        ),
        HostileRequest("as-of-before-the-first-utc-day", _body(good | {"as_of": "0001-01-01T00:00:00+23:59"}), "as_of"),
        HostileRequest("audit-string", _body(good | {"audit": "yes"}), "audit"),
        HostileRequest("include-resolved-number", _body(good | {"include_resolved": 1}), "include_resolved"),
        HostileRequest("extra-field", _body(good | {"bogus": "x"}), "bogus"),
    ]


def _verify_requests() -> list[HostileRequest]:
    return [
        HostileRequest("project-number", _body({"project": 5}), "project"),
        HostileRequest("project-not-a-slug", _body({"project": "../etc"}), "project"),
        HostileRequest("project-huge", _body({"project": "a" * HUGE}), "project"),
        HostileRequest("repair-string", _body({"repair": "yes"}), "repair"),
        HostileRequest("repair-number", _body({"repair": 1}), "repair"),
        HostileRequest("extra-field", _body({"project": None, "repair": False, "bogus": []}), "bogus"),
    ]


def _prove_forgotten_requests() -> list[HostileRequest]:
    good: dict[str, object] = {"project": "p", "artifact_id": "a", "event_ids": [], "scrub": False}
    return [
        HostileRequest("event-ids-missing", _body({"project": "p", "artifact_id": "a"}), "event_ids"),
        HostileRequest("event-id-not-a-uuid", _body(good | {"event_ids": ["not-a-uuid"]}), "event_ids[0]"),
        HostileRequest("event-ids-not-a-list", _body(good | {"event_ids": "x"}), "event_ids"),
        HostileRequest("artifact-id-path", _body(good | {"artifact_id": "../a b"}), "artifact_id"),
        HostileRequest("project-null", _body(good | {"project": None}), "project"),
        HostileRequest("fingerprint-number", _body(good | {"fingerprints": [5]}), "fingerprints[0]"),
        HostileRequest("embedded-text-huge", _body(good | {"embedded_texts": ["x" * HUGE]}), "embedded_texts[0]"),
        HostileRequest("scrub-string", _body(good | {"scrub": "yes"}), "scrub"),
        HostileRequest("extra-field", _body(good | {"bogus": 1}), "bogus"),
    ]


def _reindex_requests() -> list[HostileRequest]:
    return [
        HostileRequest("progress-wildcard", _body({"progress": "a.*"}), "progress"),
        HostileRequest("progress-full-wildcard", _body({"progress": ">"}), "progress"),
        HostileRequest("progress-space", _body({"progress": "a b"}), "progress"),
        HostileRequest("progress-empty-token", _body({"progress": "a..b"}), "progress"),
        HostileRequest("progress-number", _body({"progress": 5}), "progress"),
        HostileRequest("progress-huge", _body({"progress": "a" * HUGE}), "progress"),
        HostileRequest("extra-field", _body({"progress": None, "bogus": True}), "bogus"),
    ]


def _lookup_requests() -> list[HostileRequest]:
    event_id = "0190c1a2-0000-7000-8000-000000000000"
    return [
        HostileRequest("empty", b"", "body"),
        HostileRequest("not-json", b"[not json", "body"),
        HostileRequest("not-utf8", b'["\xff\xfe"]', "body"),
        HostileRequest("json-object", b'{"a": 1}', "body"),
        HostileRequest("json-null", b"null", "body"),
        HostileRequest("deep-nesting", ("[" * 30000).encode(), "body"),
        HostileRequest("id-number", b"[1]", "body[0]"),
        HostileRequest("id-not-a-uuid", _body(["not-a-uuid"]), "body[0]"),
        HostileRequest("id-huge", _body(["x" * HUGE]), "body[0]"),
        HostileRequest("too-many-ids", _body([event_id] * 1001), "body"),
    ]


_REQUESTS: dict[str, Callable[[], list[HostileRequest]]] = {
    RECALL: _recall_requests,
    VERIFY: _verify_requests,
    PROVE_FORGOTTEN: _prove_forgotten_requests,
    REINDEX: _reindex_requests,
}
