"""The node's live dashboard in a real headless Chromium (Debian's, driven by Playwright) against a real node:
real nats-server, SQLite journal, embedded mirror with the real embedding model. The page loads with the token
and shows the observers; events published during the test appear live (server-sent events, no reload), a hostile
text renders as text; recall through the safe door finds a hit; a bad project is refused with a clear error;
requests without the token get 401, with a foreign Host 421; the port refuses connections once the node stops."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser, Page, async_playwright

from bus.client.client import connect
from bus.host.server import NatsServer
from epibus.dashboard import Dashboard
from epibus.dashboard.security import TOKEN_FILE
from epibus.node.node import Node, NodeConfig
from mesh.agent import MeshAgent
from tests.conftest import finding
from tests.support import eventually, start_node_process, stop_node_process

pytestmark = pytest.mark.slow
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
HOSTILE = "<img src=x onerror=alert(1)>"


@pytest.fixture
def chromium() -> Path:
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: the dashboard test drives Debian's chromium; run tests/prepare.sh "
            "(or apt-get install chromium)",
            pytrace=False,
        )
    return CHROMIUM


@pytest.fixture
async def browser(chromium: Path) -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture
async def ui_node(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Node]:
    config = NodeConfig(
        home=tmp_path / "node",
        nats_url=nats_server.url,
        name="ui-node",
        journal_url=f"sqlite:///{tmp_path / 'journal.db'}",
        ui_port=0,
    )
    async with Node(config) as node:
        yield node


async def cell_texts(page: Page, selector: str) -> list[str]:
    return await page.locator(selector).all_inner_texts()


def save_screenshot(shot: bytes, tmp_path: Path) -> Path:
    path = tmp_path / "dashboard.png"
    path.write_bytes(shot)
    if artifacts := os.environ.get("EPIBUS_TEST_ARTIFACTS"):
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(artifacts) / path.name)
    return path


async def open_page(browser: Browser, url_with_token: str, url: str) -> tuple[Page, list[str]]:
    """The page as the operator opens it from the printed URL; the dialogs any script on it opened."""
    page = await browser.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda d: dialogs.append(d.message))
    opened = await page.goto(url_with_token)
    assert opened is not None
    assert opened.status == 200
    assert page.url == url  # the token left the address bar
    await page.locator("#link", has_text="live").wait_for(timeout=15_000)
    return page, dialogs


async def recall_in_page(page: Page, query: str, project: str) -> list[str]:
    """Type a recall into the box, submit it and return the artifact ids of the hits the page shows."""
    answered = int(await page.locator("#recall").get_attribute("data-answered") or 0)
    await page.fill("#recall-query", query)
    await page.fill("#recall-project", project)
    await page.click("#recall-submit")
    await page.locator(f"#recall[data-answered='{answered + 1}']").wait_for(timeout=20_000)
    if await page.locator("#recall-hits").is_hidden():
        return []
    return [
        str(await row.get_attribute("data-artifact-id")) for row in await page.locator("#recall-hits tbody tr").all()
    ]


async def row_text(page: Page, selector: str, *, containing: str) -> str:
    row = page.locator(selector, has_text=containing)
    await row.wait_for(timeout=20_000)
    return await row.inner_text()


async def test_the_dashboard_shows_the_node_live_and_safely(
    ui_node: Node, browser: Browser, nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    dashboard = ui_node.dashboard
    assert dashboard is not None
    assert ui_node.info is not None
    assert ui_node.info.ui_url == dashboard.url  # recorded in node.json, without the token
    token_file = ui_node.config.home / TOKEN_FILE
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert dashboard.url_with_token == f"{dashboard.url}?token={token_file.read_text().strip()}"
    page, dialogs = await open_page(browser, dashboard.url_with_token, dashboard.url)
    await page.locator("#observers tr[data-observer^='journal-']").wait_for(timeout=15_000)
    await page.locator("#observers tr[data-observer^='mirror-']").wait_for(timeout=15_000)

    async with connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice:
        plain = alice.event("finding", finding(text="the nightly backup skips the largest table"), project=project)
        hostile = alice.event("finding", finding(text=HOSTILE), project=project)
        await alice.publish(plain)
        await alice.publish(hostile)
        mesh = MeshAgent(alice)
        await mesh.add_coordinator(project, "alice")
        task = (await mesh.propose(project, "rotate logs", "disk full", category="operational", agents=["bob"])).record

        # Live: the rows arrive by the stream, without a reload, with the full artifact id, actor and state.
        shown = await row_text(page, f"#events tr[data-event-id='{plain.event_id}']", containing=plain.artifact_id)
        assert shown.split("\t")[4:7] == [plain.artifact_id, "alice", "unverified active"]
        bad = page.locator(f"#events tr[data-event-id='{hostile.event_id}'] td.text")
        await bad.wait_for(timeout=20_000)
        assert await bad.inner_text() == HOSTILE  # shown as text...
        assert await page.locator("main img").count() == 0  # ...never parsed into an element
        assert "proposed" in await row_text(page, "#tasks tbody tr", containing=task.task_id)
        assert float(await page.locator("#rate").inner_text()) > 0

        # A standing watch shows with its owner and words, and the claims matched against it with their cost.
        watch = await alice.watch("the backup leaves out the biggest table", project)
        held = await row_text(page, f"#watches tr[data-watch-id='{watch.watch_id}']", containing=watch.about)
        assert held.split("\t")[:3] == ["alice", project, watch.about]
        await alice.publish(alice.event("finding", finding(text="backups skip the largest table at night"),
                                        project=project))  # fmt: skip
        cost = page.locator("#watch-cost", has_text="ms of matching per claim")
        await cost.wait_for(timeout=20_000)
        pushed = "() => / [1-9][0-9]*$/.test(document.getElementById('watch-count').textContent)"
        await page.wait_for_function(pushed, timeout=20_000)  # held / pushed: the claim reached alice

        # Recall through the safe door, as an operator types it; a retraction takes the hit out of it.
        assert ui_node.mirror is not None
        await eventually(lambda: ui_node.mirror is not None and ui_node.mirror.indexed >= 2, timeout_s=30)
        query = "backups miss the biggest table"
        assert (await recall_in_page(page, query, project))[0] == plain.artifact_id
        await alice.transition("resolved", {"resolution": "retracted"}, project=project, artifact_id=plain.artifact_id)
    retracted = f"#events tr[data-event-id='{plain.event_id}']"
    assert "retracted" in await row_text(page, retracted, containing="retracted")  # its state changed live

    async def plain_is_gone() -> bool:
        return plain.artifact_id not in await recall_in_page(page, query, project)

    await eventually(plain_is_gone, timeout_s=20, interval_s=0.5)
    shot = save_screenshot(await page.screenshot(full_page=True), tmp_path)
    assert shot.stat().st_size > 10_000

    assert await recall_in_page(page, query, "Not A Slug") == []
    error = await page.locator("#recall-error").inner_text()
    assert error.startswith('RecallRequest: project="Not A Slug" refused')
    assert dialogs == []  # no script ran from the hostile text
    await check_refusals(browser, dashboard)


async def check_refusals(browser: Browser, dashboard: Dashboard) -> None:
    """Without the token nothing answers; with a foreign Host (DNS rebinding) neither."""
    stranger = await browser.new_page()
    refused = await stranger.goto(dashboard.url)
    assert refused is not None
    assert refused.status == 401
    async with httpx.AsyncClient(timeout=5) as plain_client:
        for path in ("", "api/snapshot", "api/stream", "app.js"):
            assert (await plain_client.get(dashboard.url + path)).status_code == 401, path
        wrong = await plain_client.get(dashboard.url_with_token.replace("token=", "token=x"))
        assert wrong.status_code == 401
        rebound = await plain_client.get(dashboard.url_with_token, headers={"Host": f"evil.example:{dashboard.port}"})
        assert rebound.status_code == 421


def test_epibus_up_prints_the_url_with_its_token_records_it_and_stops_with_the_node(tmp_path: Path) -> None:
    home = tmp_path / "home"
    process, status = start_node_process(home, "--mirror", "off", "--ui-port", "0")
    try:
        url = status["dashboard"]
        token = (home / TOKEN_FILE).read_text().strip()
        node_file = json.loads((home / "node.json").read_text())
        assert url == f"{node_file['ui_url']}?token={token}"
        assert node_file["ui_url"].startswith("http://127.0.0.1:")
        with httpx.Client(timeout=10, follow_redirects=True) as client:
            page = client.get(url)
            assert page.status_code == 200
            assert "epibus" in page.text
            assert client.get(node_file["ui_url"] + "api/snapshot").json()["health"]["node"]["pid"] == process.pid
        port = int(node_file["ui_url"].rsplit(":", 1)[1].rstrip("/"))
        page_open = open_stream(port, token)  # a page still streaming when the node stops
    finally:
        stop_node_process(process)  # SIGTERM stops the whole node, the dashboard with it
    assert process.returncode == 0
    assert process.stderr is not None
    assert process.stderr.read() == ""  # no error logged at the stop
    assert rest_of(page_open).endswith(b"0\r\n\r\n")  # the open stream was ended (its last chunk), not cut off
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def open_stream(port: int, token: str) -> socket.socket:
    """A page's event stream on a raw socket, once its first event arrived."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        f"GET /api/stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
    )
    received = b""
    while b"event: events" not in received:
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    return sock


def rest_of(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    sock.close()
    return received


async def test_the_port_refuses_connections_once_the_node_stops(nats_server: NatsServer, tmp_path: Path) -> None:
    config = NodeConfig(home=tmp_path / "node", nats_url=nats_server.url, mirror="off", ui_port=0)
    async with Node(config) as node:
        assert node.dashboard is not None
        port = node.dashboard.port
        async with httpx.AsyncClient(timeout=5, follow_redirects=True) as client:
            assert (await client.get(node.dashboard.url_with_token)).status_code == 200  # followed to the page
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


HOSTILE_RECALLS: list[tuple[dict[str, str], bytes, int, str]] = [
    ({"content-type": "text/plain"}, b'{"query": "q", "project": "p"}', 415, "JSON"),
    ({"content-type": "application/json"}, b"not json", 400, "not JSON"),
    ({"content-type": "application/json"}, b"\xff\xfe", 400, "not JSON"),
    ({"content-type": "application/json"}, b"[1, 2]", 400, "must be strings"),
    ({"content-type": "application/json"}, b'{"query": 5, "project": "p"}', 400, "must be strings"),
    ({"content-type": "application/json"}, b'{"query": "  ", "project": "p"}', 400, "query"),
    ({"content-type": "application/json"}, json.dumps({"query": "q" * 16_001, "project": "p"}).encode(), 400, "query"),
    ({"content-type": "application/json"}, json.dumps({"query": "q" * 200_000, "project": "p"}).encode(), 413, "over"),
    ({"content-type": "application/json"}, json.dumps({"query": "q", "project": "../etc"}).encode(), 400, "project"),
    ({"content-type": "application/json"}, b'{"query": "q", "project": "p", "k": 1000}', 400, "'k' is not"),
    ({"content-type": "application/json"}, b'{"query": "q", "project": "p"}', 503, "no mirror"),
]


async def test_hostile_recalls_get_a_one_line_error_and_the_dashboard_keeps_serving(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    config = NodeConfig(home=tmp_path / "node", nats_url=nats_server.url, mirror="off", ui_port=0)
    async with Node(config) as node:
        assert node.dashboard is not None
        token = {"authorization": f"Bearer {(node.config.home / TOKEN_FILE).read_text().strip()}"}
        async with httpx.AsyncClient(timeout=10, base_url=node.dashboard.url) as client:
            for headers, body, status, says in HOSTILE_RECALLS:
                answer = await client.post("api/recall", headers=token | headers, content=body)
                assert (answer.status_code, says in answer.json()["error"]) == (status, True), (body[:60], answer.text)
                assert "\n" not in answer.json()["error"]
            snapshot = await client.get("api/snapshot", headers=token)
            assert snapshot.json()["health"]["node"]["name"] == node.name


async def test_pages_that_never_read_or_vanish_do_not_hold_the_node_back(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    config = NodeConfig(home=tmp_path / "node", nats_url=nats_server.url, mirror="off", ui_port=0)
    async with Node(config) as node:
        dashboard = node.dashboard
        assert dashboard is not None
        token = (node.config.home / TOKEN_FILE).read_text().strip()
        request = (
            f"GET /api/stream HTTP/1.1\r\nHost: 127.0.0.1:{dashboard.port}\r\nAuthorization: Bearer {token}\r\n\r\n"
        )
        stuck = []
        for _ in range(3):  # pages that ask for the stream and never read a byte of it
            sock = socket.create_connection(("127.0.0.1", dashboard.port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(request.encode())
            stuck.append(sock)
        await eventually(lambda: len(dashboard.feed.subscribers) == 3, timeout_s=10)
        async with connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice:
            for i in range(20):
                await alice.publish(alice.event("finding", finding(i, text="x" * 2000), project=project))
        async with httpx.AsyncClient(timeout=5, base_url=dashboard.url) as client:

            async def all_shown() -> bool:
                answer = await client.get("api/snapshot", headers={"authorization": f"Bearer {token}"})
                return len([e for e in answer.json()["events"] if e["project"] == project]) == 20

            await eventually(all_shown, timeout_s=20)
        for sock in stuck:  # the pages go away without a word
            sock.close()
        await eventually(lambda: not dashboard.feed.subscribers, timeout_s=20)


async def test_the_first_paint_shows_real_figures_before_any_live_update(ui_node: Node, browser: Browser) -> None:
    """The page carries where things stand when it is served: with its live stream blocked it still shows the
    figures, the observers, a dated 24-hour time, and its icon."""
    dashboard = ui_node.dashboard
    assert dashboard is not None
    page = await browser.new_page()
    await page.route("**/api/stream", lambda route: route.abort())  # no update can arrive
    opened = await page.goto(dashboard.url_with_token, wait_until="load")
    assert opened is not None
    assert opened.status == 200
    figures = {f: await page.locator(f"#{f}").inner_text() for f in ("rate", "dlq", "outbox", "nats")}
    assert [f for f, text in figures.items() if text in ("\u2013", "", "?")] == [], figures  # \u2013: the placeholder
    assert await page.locator("#observers tr[data-observer^='journal-']").count() == 1
    assert re.fullmatch(r"updated \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", await page.locator("#updated").inner_text())
    icon = await page.request.get(dashboard.url.rstrip("/") + "/favicon.svg")
    assert icon.status == 200
    assert (await icon.body()).startswith(b"<svg")
