"""The MCP tools' argument guard, without a node: what a tool accepts is exactly what the event it publishes
accepts, and whatever a tool does not declare, types wrongly or sends too long is refused before anything runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp import Client

from bus.errors import InvalidEvent
from bus.identity.signing import AgentKey
from bus.model.event import draft_event
from bus.model.kinds import require_kind
from epibus.mcp_tools.guard import MAX_ARGUMENT_BYTES, parse_arguments
from epibus.mcp_tools.inputs import ProposeInput, claim_kinds, publish_input
from epibus.mcp_tools.mesh_tools import mesh_tools
from epibus.mcp_tools.server import BearerToken, EpibusMcp
from epibus.mcp_tools.session import AgentSession, SessionConfig
from epibus.mcp_tools.tools import knowledge_tools

KEY = AgentKey.generate("alice")
VALID: dict[str, dict[str, Any]] = {
    "finding": {"text": "t", "impact": 0.5, "confidence": 0.5, "subject": "s"},
    "unknown": {"question": "q", "impact": 0.5},
    "mistake": {"mistake": "m", "why_wrong": "w", "cost_estimate": "c", "root_cause": "r", "prevention": "p"},
    "decision": {"choice": "c", "rationale": "r", "confidence": 0.5, "reversibility": "committal"},
    "assumption": {"text": "t", "confidence": 0.5},
    "dead_end": {"approach": "a", "why_failed": "w"},
}
HOSTILE_VALUES = st.one_of(
    st.sampled_from(["", "x", "x" * 200, "x" * 201, "x" * 16_000, "x" * 16_001, "0.5", "committal", "maybe"]),
    st.sampled_from([-1, 0, 1, 2, 0.0, 0.5, 1.0, 1.5, -0.1, True, False, None]),
    st.sampled_from([[], ["a"], ["x" * 201], [{"kind": "file", "ref": "a.py"}], [{"kind": "disk", "ref": "a"}]]),
    st.sampled_from([{}, {"kind": "file", "ref": "a.py"}]),
)


def body_fields(kind: str) -> list[str]:
    return list(require_kind(kind).body.model_fields)


def test_every_built_in_claim_kind_has_a_publish_tool_and_an_example_here() -> None:
    assert set(VALID) <= set(claim_kinds())  # other tests register custom kinds in this process


@settings(max_examples=400, deadline=None)
@given(
    kind=st.sampled_from(sorted(VALID)),
    changes=st.lists(st.tuples(st.integers(min_value=0, max_value=20), HOSTILE_VALUES), max_size=3),
    drop=st.sets(st.integers(min_value=0, max_value=20), max_size=2),
)
def test_a_publish_tool_accepts_exactly_what_its_event_accepts(
    kind: str, changes: list[tuple[int, Any]], drop: set[int]
) -> None:
    fields = body_fields(kind)
    body = dict(VALID[kind])
    for index, value in changes:
        body[fields[index % len(fields)]] = value
    for index in drop:
        body.pop(fields[index % len(fields)], None)
    try:
        parse_arguments(f"publish_{kind}", publish_input(kind), {"project": "demo", **body})
        tool_error = None
    except InvalidEvent as e:
        tool_error = e
    try:
        draft_event(kind, body, project="demo", actor=KEY.actor, session_id="s")
        event_error = None
    except InvalidEvent as e:
        event_error = e
    assert (tool_error is None) == (event_error is None), (body, tool_error, event_error)
    if tool_error is not None:
        assert str(tool_error).startswith(f"publish_{kind}."), str(tool_error)


@pytest.mark.parametrize("spec", [*knowledge_tools(), *mesh_tools()], ids=lambda spec: spec.name)
def test_every_tool_refuses_an_argument_it_does_not_declare(spec: Any) -> None:
    with pytest.raises(InvalidEvent, match=rf"^{spec.name}\.verifier: is not an argument of {spec.name}; it takes "):
        parse_arguments(spec.name, spec.input, {"verifier": "manual"})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 10**5000], ids=["nan", "infinity", "huge-int"])
def test_a_value_json_cannot_carry_is_refused_not_passed_on(value: Any) -> None:
    arguments = {"project": "demo", "title": "t", "summary": "s", "payload": {"x": value}}
    with pytest.raises(InvalidEvent, match=r"^propose: its arguments hold a value JSON cannot carry"):
        parse_arguments("propose", ProposeInput, arguments)


def test_a_call_larger_than_an_event_is_refused_whole() -> None:
    huge = {"project": "demo", "question": "q" * MAX_ARGUMENT_BYTES, "impact": 0.5}
    with pytest.raises(InvalidEvent, match=r"^publish_unknown: its arguments are \d+ bytes; the limit is 65536"):
        parse_arguments("publish_unknown", publish_input("unknown"), huge)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"project": "demo", "question": "q", "impact": True}, "publish_unknown.impact=True"),
        ({"project": "demo", "question": 7, "impact": 0.5}, "publish_unknown.question=7"),
        ({"project": "Demo", "question": "q", "impact": 0.5}, "publish_unknown.project='Demo'"),
        ({"project": "demo", "impact": 0.5}, "publish_unknown.question: Field required"),
        ({"project": "demo", "question": "q", "impact": 0.5, "source": "guess"}, "publish_unknown.source='guess'"),
        ({"project": "demo", "question": "q", "impact": 0.5, "wait": "indexed"}, "publish_unknown.wait='indexed'"),
    ],
)
def test_a_wrong_value_is_named_with_what_is_allowed(arguments: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidEvent) as refused:
        parse_arguments("publish_unknown", publish_input("unknown"), arguments)
    assert str(refused.value).startswith(named), str(refused.value)


async def test_a_refused_call_comes_back_as_a_tool_error_through_the_protocol(tmp_path: Path) -> None:
    async with AgentSession(SessionConfig(agent="alice", home=tmp_path / "home")) as session:
        server = EpibusMcp(session)
        async with Client(server.server) as client:
            result = await client.call_tool("publish_unknown", {"project": "demo", "question": "q", "impact": "high"})
            assert result.is_error
            assert result.content[0].text == (  # type: ignore[union-attr]
                "InvalidEvent: publish_unknown.impact='high': Input should be a valid number"
            )
            listed = await client.list_tools()
    assert len(listed.tools) == len(server.tools)
    assert server.stats.refused == 1
    assert json.dumps([t.input_schema for t in listed.tools]).count('"$ref"') == 0


async def _asgi_call(scope_type: str, headers: list[tuple[bytes, bytes]]) -> tuple[list[dict[str, Any]], bool]:
    """What the token middleware sends for one request, and whether the wrapped app was reached."""
    reached = False

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal reached
        reached = True

    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    scope = {"type": scope_type, "path": "/mcp", "headers": headers}
    await BearerToken(app, "s3cret")(scope, receive, send)
    return sent, reached


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"authorization", b"Bearer wrong")],
        [(b"authorization", b"s3cret")],
        [(b"authorization", b"Bearer s3cret"), (b"authorization", b"Bearer other")],
    ],
    ids=["none", "wrong", "no-scheme", "two-headers"],
)
async def test_an_http_or_websocket_request_without_exactly_the_token_never_reaches_the_server(
    headers: list[tuple[bytes, bytes]],
) -> None:
    sent, reached = await _asgi_call("http", headers)
    assert not reached
    assert sent[0]["status"] == 401
    sent, reached = await _asgi_call("websocket", headers)
    assert not reached
    assert sent == [{"type": "websocket.close", "code": 1008}]


async def test_a_request_with_the_token_reaches_the_server() -> None:
    sent, reached = await _asgi_call("http", [(b"Authorization", b"Bearer s3cret")])
    assert reached
    assert sent == []
