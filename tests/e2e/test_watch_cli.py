"""`epibus watch` as a user runs it against `epibus up`: register, be told of a matching claim (and not of an
unrelated one), come back later and be told only of what was missed, list and stop."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import last_json, run_epibus, start_node_process, stop_node_process

pytestmark = pytest.mark.slow


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "epibus-home"
    process, _ = start_node_process(home)
    try:
        yield home
    finally:
        stop_node_process(process)


def publish(home: Path, text: str) -> str:
    out = run_epibus(home, "publish", "finding", "-p", "ops", "--text", text, "--impact", "0.6", "--confidence",
                     "0.7", "--subject", "ops", "--json")  # fmt: skip
    return str(last_json(out)["artifact_id"])


def follow(home: Path, out: Path) -> list[dict[str, Any]]:
    """`epibus watch follow --count 1 --json --out FILE`: the next notice after the file's last line."""
    result = run_epibus(home, "watch", "follow", "--count", "1", "--json", "--out", str(out), timeout_s=60)
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def test_a_watch_from_the_cli_tells_of_a_match_then_only_of_what_was_missed(home: Path, tmp_path: Path) -> None:
    made = last_json(run_epibus(home, "watch", "--about", "caches are empty after a deploy", "-p", "ops",
                                "--no-follow", "--json"))["watch"]  # fmt: skip
    publish(home, "bananas are yellow when ripe")
    cold = publish(home, "the cache is cold after every deploy")
    log = tmp_path / "notices.jsonl"
    (first,) = follow(home, log)
    assert (first["notice"], first["artifact_id"], first["watch_id"]) == ("match", cold, made["watch_id"])
    again = publish(home, "every release starts with an empty cache")
    (second,) = follow(home, log)  # the file is the cursor: the first is not told again
    assert (second["artifact_id"], second["seq"] > first["seq"]) == (again, True)
    assert [json.loads(line)["artifact_id"] for line in log.read_text().splitlines()] == [cold, again]

    shown = run_epibus(home, "watch", "list", columns=80).stdout
    assert made["watch_id"][:12] in shown  # at 80 columns, its shortest unique prefix at least
    assert "1 of 32" in shown
    stopped = last_json(run_epibus(home, "watch", "stop", made["watch_id"][:10], "--json"))
    assert (stopped["watch_id"], stopped["stopped"]) == (made["watch_id"], True)  # the whole id it named
    assert last_json(run_epibus(home, "watch", "list", "--json"))["watches"] == []
    refused = run_epibus(home, "watch", "--about", "x", check=False)
    assert refused.returncode == 1
    assert "--about TEXT and --project P" in refused.stderr
