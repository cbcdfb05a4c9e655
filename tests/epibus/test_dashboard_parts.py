"""The dashboard's parts that need no browser: which addresses it may bind, its token file, the gate in front
of every request (hostile headers included, through a real ASGI client), and the bounded per-page queues that
drop their oldest message, counted, when a page does not keep up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from bus.errors import ConfigError
from epibus.dashboard.feed import QUEUE_SIZE, Feed
from epibus.dashboard.security import COOKIE, TOKEN_FILE, TokenGate, allowed_hosts, check_bind_host, ui_token
from epibus.node.node import Node, NodeConfig

TOKEN = "t" * 43


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "example.com"])
def test_a_non_loopback_or_wildcard_address_is_refused_naming_the_option(host: str) -> None:
    with pytest.raises(ConfigError, match="--ui-host"):
        check_bind_host(host, allow_remote=False)


def test_a_remote_address_is_served_only_when_asked_and_a_wildcard_never() -> None:
    check_bind_host("10.1.2.3", allow_remote=True)
    check_bind_host("::1", allow_remote=False)
    with pytest.raises(ConfigError, match="every address"):
        check_bind_host("0.0.0.0", allow_remote=True)
    assert allowed_hosts("127.0.0.1", 8080) == {"127.0.0.1:8080", "localhost:8080", "[::1]:8080"}
    assert allowed_hosts("10.1.2.3", 8080) == {"10.1.2.3:8080"}


async def test_a_node_asked_for_a_wildcard_dashboard_refuses_to_start(tmp_path: Path) -> None:
    config = NodeConfig(home=tmp_path / "home", mirror="off", ui_port=0, ui_host="0.0.0.0")
    with pytest.raises(ConfigError, match="--ui-host"):
        async with Node(config):
            pass
    assert not (tmp_path / "home" / "nats").exists()  # refused before anything started


def test_the_token_is_made_once_owner_only(tmp_path: Path) -> None:
    first = ui_token(tmp_path)
    assert len(first) >= 32
    assert ui_token(tmp_path) == first
    assert (tmp_path / TOKEN_FILE).stat().st_mode & 0o777 == 0o600


@pytest.fixture
def gate() -> TokenGate:
    async def hello(_: Request) -> PlainTextResponse:
        return PlainTextResponse("inside")

    return TokenGate(Starlette(routes=[Route("/", hello), Route("/x", hello)]), TOKEN, allowed_hosts("127.0.0.1", 9))


async def ask(gate: TokenGate, path: str, headers: list[tuple[str, str]]) -> httpx.Response:
    transport = httpx.ASGITransport(app=gate)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:9") as client:
        return await client.get(path, headers=headers)


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ([], 401),
        ([("cookie", f"{COOKIE}=wrong")], 401),
        ([("cookie", f'{COOKIE}="{TOKEN}; x')], 401),  # a malformed cookie header
        ([("cookie", "\x00\x01;;==;")], 401),
        ([("authorization", f"Bearer {TOKEN}x")], 401),
        ([("cookie", f"{COOKIE}={TOKEN}"), ("cookie", f"{COOKIE}={TOKEN}")], 401),  # repeated: refused
        ([("cookie", f"{COOKIE}={TOKEN}"), ("host", "evil.example:9")], 421),
        ([("cookie", f"{COOKIE}={TOKEN}"), ("host", "127.0.0.1:10")], 421),
        ([("cookie", f"other=1; {COOKIE}={TOKEN}")], 200),
        ([("authorization", f"Bearer {TOKEN}")], 200),
        ([("cookie", f"{COOKIE}={TOKEN}"), ("host", "localhost:9")], 200),
    ],
)
async def test_the_gate_lets_only_the_token_holder_in_at_its_own_address(
    gate: TokenGate, headers: list[tuple[str, str]], status: int
) -> None:
    answer = await ask(gate, "/x", headers)
    assert answer.status_code == status, answer.text
    assert (answer.text == "inside") is (status == 200)
    assert "script-src 'self'" in answer.headers["content-security-policy"]
    assert "access-control-allow-origin" not in answer.headers


async def test_the_token_in_the_url_becomes_a_strict_http_only_cookie_and_leaves_the_url(gate: TokenGate) -> None:
    answer = await ask(gate, f"/?token={TOKEN}", [])
    assert answer.status_code == 303
    assert answer.headers["location"] == "/"
    assert answer.headers["set-cookie"] == f"{COOKIE}={TOKEN}; HttpOnly; SameSite=Strict; Path=/"
    assert (await ask(gate, "/?token=nope", [])).status_code == 401
    assert (await ask(gate, f"/x?token={TOKEN}", [])).status_code == 401  # only the page trades it
    assert gate.refused == 2


async def test_a_page_that_does_not_keep_up_loses_its_oldest_messages_counted_and_others_lose_none() -> None:
    async def health() -> dict[str, object]:
        return {}

    feed = Feed(lambda: None, health)
    slow, reader = feed.subscribe(), feed.subscribe()
    assert slow is not None
    assert reader is not None
    received: list[str] = []
    for i in range(QUEUE_SIZE + 10):
        feed._broadcast("events", {"i": i})
        received.append(reader.queue.get_nowait()[1])
        await asyncio.sleep(0)
    assert slow.queue.qsize() == QUEUE_SIZE
    assert slow.dropped == 10
    assert reader.dropped == 0
    assert slow.queue.get_nowait() == ("events", '{"i": 10}')  # the oldest went first
    assert feed.dropped == 10
    assert len(received) == QUEUE_SIZE + 10
    assert (await feed.current_health())["pages"] == {"open": 2, "dropped": 10, "read_failures": 0}


def test_the_dashboard_files_load_nothing_from_elsewhere() -> None:
    static = Path(__file__).parents[2] / "epibus" / "dashboard" / "static"
    for path in static.iterdir():
        # an SVG names its XML namespace with a URL; nothing is fetched from it
        text = path.read_text().replace('xmlns="http://www.w3.org/2000/svg"', "")
        forbidden = ("http://", "https://", "//cdn", "innerHTML", "insertAdjacentHTML", "eval(")
        found = [bad for bad in forbidden if bad in text]
        assert found == [], path.name
