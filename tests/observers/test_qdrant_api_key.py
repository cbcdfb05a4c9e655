"""A secured Qdrant server: QDRANT_API_KEY is sent with every request, as Qdrant's own tools send it. The
server here is a plain HTTP listener that records the headers and answers 503 (what is checked is what
epibus sends, not what Qdrant does with it); the store then reports an outage, never an empty mirror."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from bus.errors import Unavailable
from observers.mirror.server import QDRANT_API_KEY_ENV, ServerVectorStore


class Recording(http.server.BaseHTTPRequestHandler):
    keys: list[str | None] = []

    def do_GET(self) -> None:
        Recording.keys.append(self.headers.get("api-key"))
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test reads what was recorded."""


@pytest.fixture
def listener() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_the_api_key_reaches_the_server_and_a_refusal_is_an_outage(
    listener: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    Recording.keys.clear()
    monkeypatch.setenv(QDRANT_API_KEY_ENV, "s3cret-key")
    with pytest.raises(Unavailable):
        await ServerVectorStore.open(listener, "m", 4)
    assert Recording.keys
    assert set(Recording.keys) == {"s3cret-key"}
