"""Texts other agents wrote (claims, mesh task titles, junk on the stream, dead-letter headers) reach the
terminal through the CLI as inert characters: no escape sequence, no rich markup, no crash; --json keeps
them exact."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from bus.client.client import connect
from bus.model.vocab import ReceiptLevel
from bus.subjects import DLQ_CONSUMER, DLQ_ERROR, DLQ_REASON, DLQ_STREAM_SEQ, DLQ_SUBJECT, dlq_subject
from epibus.cli.mesh_roster import seat_as_operator
from mesh.agent import MeshAgent
from tests.conftest import finding
from tests.support import eventually_sync, operator_credentials, run_epibus, start_node_process, stop_node_process

pytestmark = pytest.mark.slow

HOSTILE = (
    "[/] closes nothing",
    "[bold]x[/bold] plain",
    "\x1b[2J wipes",
    "\x1b]0;pwned\x07 titles",
    "\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\ links",
    "\x9b31m csi",
    "\u202e reversed",
)
# How each hostile text must look on the terminal: literally, every control spelled out.
VISIBLE = (
    "[/] closes nothing",
    "[bold]x[/bold] plain",
    "\\x1b[2J wipes",
    "\\x1b]0;pwned\\x07 titles",
    "\\x1b]8;;http://evil\\x1b\\link\\x1b]8;;\\x1b\\ links",
    "\\x9b31m csi",
    "\\u202e reversed",
)
# What must never reach a terminal from another agent's text: C0 (bar newline), DEL, C1, bidi controls.
TERMINAL_ACTIVE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`epibus ARGS` as a user runs it, wide enough that no table cell is folded."""
    return run_epibus(home, *args, columns=400)


def assert_inert(result: subprocess.CompletedProcess[str], *visible: str) -> None:
    out = result.stdout + result.stderr
    assert TERMINAL_ACTIVE.findall(out) == []
    assert [v for v in visible if v not in out] == []


def json_lines(result: subprocess.CompletedProcess[str]) -> list[Any]:
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """`epibus up` without a mirror (no recall here): its home and NATS URL."""
    home = tmp_path_factory.mktemp("hostile") / "home"
    process, status = start_node_process(home, "--mirror", "off")
    try:
        yield home, str(status["nats_url"])
    finally:
        stop_node_process(process)


def test_claims_with_hostile_texts_are_shown_inert_by_every_read_and_exact_in_json(
    node: tuple[Path, str], project: str
) -> None:
    home, url = node

    async def publish() -> None:
        async with connect(url, agent="mallory", home=home) as client:
            events = [client.event("finding", finding(text=text), project=project) for text in HOSTILE]
            await client.publish_many(events, wait_for=ReceiptLevel.journaled)

    asyncio.run(publish())
    for command in (
        ["events", "-p", project],
        ["artifacts", "-p", project],
        ["audit", "-p", project, "--journal", "node"],
    ):
        assert_inert(cli(home, *command), *VISIBLE)
        rows = json_lines(cli(home, *command, "--json"))[0]
        texts = [r["body"]["text"] for r in rows] if command[0] == "events" else [r["content"] for r in rows]
        assert sorted(texts) == sorted(HOSTILE)
    assert_inert(cli(home, "briefing", "-p", project), *VISIBLE)
    brief = json_lines(cli(home, "briefing", "-p", project, "--json"))[0]
    assert sorted(a["content"] for a in brief["top"]) == sorted(HOSTILE)
    bounded = ["tail", "-p", project, "--from-start", "--count", str(len(HOSTILE))]
    assert_inert(cli(home, *bounded), *VISIBLE)
    assert [e["body"]["text"] for e in json_lines(cli(home, *bounded, "--json"))] == list(HOSTILE)


def test_mesh_task_titles_with_hostile_texts_are_shown_inert_in_the_inbox_and_exact_in_json(
    node: tuple[Path, str], project: str
) -> None:
    home, url = node

    async def propose() -> None:
        async with connect(url, agent="mallory", home=home) as client:
            mesh = MeshAgent(client)
            await seat_as_operator([url], home, project, "mallory")
            for text in HOSTILE:
                await mesh.propose(project, text, text, category="operational", agents=["bob"])

    asyncio.run(propose())
    assert_inert(cli(home, "mesh", "inbox", "-p", project, "--agent", "bob"), *VISIBLE)
    tasks = json_lines(cli(home, "mesh", "inbox", "-p", project, "--agent", "bob", "--json"))[0]["tasks"]
    assert sorted(t["title"] for t in tasks) == sorted(HOSTILE)


def test_dead_letters_with_hostile_texts_are_listed_inert_and_exact_in_json(
    node: tuple[Path, str], project: str
) -> None:
    home, url = node
    # Junk the node dead-letters itself: a hostile kind (in the error) and hostile subjects.
    junk_subjects = [f"epi.{project}.finding.{token}" for token in ("[/]", "\x1b[2J", "\x1b]0;pwned\x07", "\x9b31m")]
    # And dead letters a hostile client wrote into the DLQ itself, each hostile text as subject and error.
    forged = [
        {DLQ_REASON: "invalid_event", DLQ_CONSUMER: "forger", DLQ_SUBJECT: text, DLQ_STREAM_SEQ: "1", DLQ_ERROR: text}
        for text in HOSTILE
    ]

    async def write() -> None:
        nc = await nats.connect(url, **operator_credentials(home))
        try:
            js = nc.jetstream()
            await js.publish(f"epi.{project}.finding.junk", json.dumps({"kind": "[/] x"}).encode())
            for subject in junk_subjects:
                await js.publish(subject, b"{}")
            for headers in forged:
                await js.publish(dlq_subject("forger", "invalid_event"), b"{}", headers=headers)
        finally:
            await nc.close()

    asyncio.run(write())

    def quarantined() -> list[dict[str, Any]]:
        letters = json_lines(cli(home, "dlq", "list", "--json"))[0]
        mine = [d for d in letters if str(d["subject"]).startswith(f"epi.{project}.")]
        return letters if len(mine) == 1 + len(junk_subjects) else []

    letters = eventually_sync(quarantined, timeout_s=20)
    assert sorted(d["subject"] for d in letters if d["consumer"] != "forger") == sorted(
        [f"epi.{project}.finding.junk", *junk_subjects]
    )
    assert any("kind='[/] x'" in d["error"] for d in letters)
    assert sorted((d["subject"], d["error"]) for d in letters if d["consumer"] == "forger") == sorted(
        (text, text) for text in HOSTILE
    )
    assert_inert(
        cli(home, "dlq", "list"),
        *VISIBLE,
        "kind='[/] x'",
        f"epi.{project}.finding.[/]",
        f"epi.{project}.finding.\\x1b[2J",
        f"epi.{project}.finding.\\x1b]0;pwned\\x07",
        f"epi.{project}.finding.\\x9b31m",
    )
