"""A node whose mirror outgrows its hot shard, as an operator sees it: the full shard is sealed by a worker while
the node serves, `status` and `/metrics` say so, recall still finds every claim, and after a restart the node
opens the sealed shards with nothing lost."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from epibus.monitoring.metrics_http import TOKEN_FILE
from tests.support import eventually_sync, run_epibus, start_node_process, stop_node_process

pytestmark = pytest.mark.slow
TEXTS = [
    "the cache is cold after every deploy",
    "disks fill up at night when logs rotate late",
    "dns lookups flap under load",
    "the queue backs up when a consumer restarts",
    "certificates expire on the first of the month",
    "a schema migration locks the table for minutes",
    "retries double the load during an outage",
]


def metric(home: Path, url: str, name: str) -> float:
    token = (home / TOKEN_FILE).read_text().strip()
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        text = answer.read().decode()
    found = [line.split()[-1] for line in text.splitlines() if line.startswith(name)]
    return sum(float(value) for value in found)


def settled_mirror(home: Path) -> dict[str, Any] | None:
    """The mirror as `status --json` shows it, once no shard waits for its seal."""
    mirror: dict[str, Any] = json.loads(run_epibus(home, "status", "--json").stdout)["mirror"]
    return mirror if mirror["shards"]["frozen"] == 0 else None


def seals_done(home: Path, at_least: int) -> bool:
    """Whether `status --json` counts `at_least` seals; a failed seal fails the test with what the node said."""
    seals = json.loads(run_epibus(home, "status", "--json").stdout)["mirror"]["seals"]
    assert seals["failures"] == 0, seals
    return bool(seals["sealed"] >= at_least)


def test_a_node_seals_its_full_hot_shard_says_so_and_recalls_across_shards_after_a_restart(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {"EPIBUS_MIRROR_SEAL_POINTS": "3"}
    process, up = start_node_process(home, env=env)
    try:
        for text in TEXTS:
            run_epibus(home, "publish", "finding", "-p", "seals", "-q", "--text", text, "--impact", "0.5",
                       "--confidence", "0.6", "--subject", "ops", "--wait", "indexed")  # fmt: skip
        # A seal is a spawned worker; on a loaded machine two of them take a while. A failed one is named at once.
        eventually_sync(lambda: seals_done(home, 2), timeout_s=120)
        assert metric(home, up["metrics_url"], "epibus_mirror_seals_total") >= 2
        mirror = eventually_sync(lambda: settled_mirror(home), timeout_s=60)
        assert mirror["shards"]["sealed"] >= 1
        assert mirror["seals"]["failures"] == 0
        shown = run_epibus(home, "status", columns=100).stdout
        assert "sealed, 0 sealing, 1 hot" in shown
    finally:
        stop_node_process(process)
    process, _ = start_node_process(home, env=env)
    try:
        for text in TEXTS:
            hits = json.loads(run_epibus(home, "recall", text, "-p", "seals", "--json").stdout)["hits"]
            assert hits[0]["content"] == text, (text, hits[:2])
        (reconciled,) = json.loads(run_epibus(home, "reconcile", "--json").stdout)["nodes"]
        assert reconciled["mirror"]["clean"], reconciled["mirror"]
        assert reconciled["stream_events"] == len(TEXTS)
    finally:
        stop_node_process(process)
