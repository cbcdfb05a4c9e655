"""`python -m bench` runs end to end against real nats-servers and writes results.json with numeric figures.
The sizes are tiny and nothing about speed is asserted (speed is reported by the benchmark, not tested). The
rows run here need no FastStream, so the test extra does not carry it; the `live` row needs the bench extra."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from bench.__main__ import run
from bench.harness import Line, Sizes
from bench.rows import ROWS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_rows_write_numeric_figures_beside_their_baselines(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--tiny", "--only", "drain", "--only", "publish", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "tiny"
    assert report["machine"]["cpu_count"] >= 1
    assert report["machine"]["nats_server"].startswith("nats-server: v")
    assert len(report["machine"]["load_average"]) == 3
    rows = report["rows"]
    assert sorted({r["row"] for r in rows}) == ["drain", "publish"]
    assert len(rows) == 3  # drain: against the bare drain and against fetch + ack; publish: against publish_async
    for row in rows:
        assert row["error"] is None
        for figure in ("epibus", "baseline", "ratio"):
            value = row[figure]
            assert isinstance(value, float), (row["what"], figure, value)
            assert math.isfinite(value), (row["what"], figure, value)
            assert value > 0, (row["what"], figure, value)
        assert row["ratio"] == pytest.approx(row["epibus"] / row["baseline"])
        assert isinstance(row["met"], bool) or row["target"] == "—"
    assert "journal observer drain" in done.stdout  # the table was printed
    assert "publish_many" in done.stdout
    rendered = subprocess.run(
        [sys.executable, "-m", "bench", "--from", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert rendered.returncode == 0, rendered.stderr[-2000:]
    table_rows = [line for line in rendered.stdout.splitlines() if line.startswith(("| drain |", "| publish |"))]
    assert len(table_rows) == 3


async def test_a_row_that_fails_is_reported_with_its_error_not_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(root: Path, sizes: Sizes) -> list[Line]:
        raise RuntimeError("no node answered")

    monkeypatch.setitem(ROWS, "broken", broken)
    lines = await run(["broken"], "tiny", Console(file=io.StringIO()))
    assert [(line.row, line.error, line.met) for line in lines] == [("broken", "RuntimeError: no node answered", False)]
