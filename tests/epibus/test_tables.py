"""Tables at the widths people use: at 80 and 120 columns no header splits, no id folds and no line is longer
than the terminal; --wide shows every value whole; a pipe gets plain columns. Rendered by rich as a terminal
of that width would receive them."""

from __future__ import annotations

import io
import re
import uuid

from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console, RenderableType

from epibus.cli.display import plain
from epibus.cli.tables import MIN_ID_CHARS, PlainTable, abbreviated_ids, fitted
from tests.epibus.test_display import HOSTILE

ARTIFACT_COLUMNS = ["artifact", "kind", "trust/lifecycle", "author", "relevance", "flags", "content"]
IDS = ["01a24cd8-f037-72c4-a4af-036fe415f8f8", "01a24cd8-f5bd-734a-bb74-485c712ba22b"]
ROWS = [
    [IDS[0], "finding", "unverified/active", "root", "0.800", "", "the cache is cold after every deploy"],
    [IDS[1], "unknown", "verified/resolved(superseded)", "bob", "0.700", "unearned", "does warming delay readiness?"],
]
UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}[0-9a-f-]*")


def rendered(renderable: RenderableType, width: int) -> list[str]:
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(renderable)
    assert isinstance(console.file, io.StringIO)
    return [line.rstrip() for line in console.file.getvalue().rstrip("\n").split("\n")]


def header_line(lines: list[str], columns: list[str]) -> str:
    (line,) = [line for line in lines if line.lstrip().startswith(columns[0])]
    return line


def test_at_80_columns_headers_stay_whole_ids_are_unique_prefixes_and_text_is_cut() -> None:
    lines = rendered(fitted("2 artifact(s) in demo", ARTIFACT_COLUMNS, ROWS, width=80, wide=False), 80)
    assert max(map(len, lines)) <= 80
    header = header_line(lines, ARTIFACT_COLUMNS)
    assert [c for c in ARTIFACT_COLUMNS if c != "flags" and c not in header.split()] == []
    shown_ids = [m.group() for line in lines for m in UUID.finditer(line)]
    assert len(shown_ids) == 2
    assert all(len(i) >= MIN_ID_CHARS for i in shown_ids)
    assert [i for i in shown_ids if not any(full.startswith(i) for full in IDS)] == []
    assert any(line.rstrip().endswith("…") for line in lines)  # the text, cut


def test_at_120_columns_ids_are_whole_and_every_column_is_shown() -> None:
    lines = rendered(fitted("2 artifact(s) in demo", ARTIFACT_COLUMNS, ROWS, width=120, wide=False), 120)
    assert max(map(len, lines)) <= 120
    assert header_line(lines, ARTIFACT_COLUMNS).split() == ARTIFACT_COLUMNS
    assert all(any(i in line for line in lines) for i in IDS)


@given(width=st.integers(min_value=60, max_value=140))
def test_a_short_column_is_never_cut_while_an_id_could_be_shortened(width: int) -> None:
    """Kinds and states stay whole at every width where unique id prefixes leave room for them."""
    lines = rendered(fitted("2 artifact(s) in demo", ARTIFACT_COLUMNS, ROWS, width=width, wide=False), width)
    words = " ".join(lines).split()
    whole = ["finding", "unknown", "unverified/active", "verified/resolved(superseded)"]
    full_ids = all(any(i in line for line in lines) for i in IDS)
    abbreviated_width = MIN_ID_CHARS + 2 + 7 + 2 + len(whole[3]) + 2 + 6 + 2 + 9 + 2 + len("unearned") + 2 + 10
    if full_ids or width >= abbreviated_width:
        assert [w for w in whole if w not in words] == []


def test_wide_on_a_narrow_terminal_shows_each_row_as_a_record_with_every_value_whole() -> None:
    lines = rendered(fitted("2 artifact(s) in demo", ARTIFACT_COLUMNS, ROWS, width=80, wide=True), 80)
    assert max(map(len, lines)) <= 80
    for row in ROWS:
        for column, value in zip(ARTIFACT_COLUMNS, row, strict=True):
            assert any(line.split(None, 1) == [column, value] for line in lines) or not value, (column, value)


def test_a_pipe_gets_a_header_and_one_plain_line_per_row_with_nothing_cut() -> None:
    lines = list(PlainTable(ARTIFACT_COLUMNS, ROWS).lines())
    assert lines[0].split() == ARTIFACT_COLUMNS
    assert len(lines) == 1 + len(ROWS)
    starts = [lines[0].index(c) for c in ARTIFACT_COLUMNS]
    for line, row in zip(lines[1:], ROWS, strict=True):
        filled = [(start, value) for start, value in zip(starts, row, strict=True) if value]
        assert all(line[start:].startswith(value) for start, value in filled), line


def test_a_pipe_shows_hostile_text_literally_on_one_line() -> None:
    lines = list(PlainTable(["text"], [[plain(h)] for h in HOSTILE]).lines())
    assert len(lines) == 1 + len(HOSTILE)
    assert not any("\x1b" in line or "\r" in line for line in lines)


uuid7s = st.builds(
    lambda ms, rand: str(uuid.UUID(int=(ms << 80) | (0x7 << 76) | (rand & ((1 << 76) - 1)))),
    st.integers(min_value=1_700_000_000_000, max_value=1_700_000_000_005),  # made within a few milliseconds
    st.integers(min_value=0, max_value=(1 << 76) - 1),
)


@given(st.lists(uuid7s, min_size=1, max_size=30, unique=True))
def test_an_abbreviated_id_is_a_prefix_of_its_id_that_no_other_id_in_the_table_shares(ids: list[str]) -> None:
    (shown,) = zip(*abbreviated_ids([[i] for i in ids]), strict=True)
    for full, short in zip(ids, shown, strict=True):
        assert full.startswith(short)
        assert len(short) >= MIN_ID_CHARS
        assert [other for other in ids if other != full and other.startswith(short)] == []


def test_a_watch_id_at_80_columns_is_whole_or_a_unique_prefix_and_the_words_are_cut() -> None:
    """`epibus watch list` at 80 columns: `watch stop` takes what is shown, so the id is never cut with `…`."""
    columns = ["watch", "projects", "threshold", "expires", "about"]
    ids = ["526271a8f80f440084210b7b2a061111", "526271a8f80f440084210b7b2a062222"]
    rows = [[i, "demo", "0.27", "2026-12-14T21:22", "deploys leave the cache empty " * 3] for i in ids]
    lines = rendered(fitted("epibus watch list: 2 of 32", columns, rows, width=80, wide=False), 80)
    assert max(map(len, lines)) <= 80
    shown = [re.search(r"\b526271a8[0-9a-f]*", line) for line in lines]
    prefixes = [m.group() for m, line in zip(shown, lines, strict=True) if m is not None and "…" not in m.group()]
    assert len(prefixes) == 2
    assert [sum(full.startswith(p) for full in ids) for p in prefixes] == [1, 1]  # each names one watch
    assert all(line.rstrip().endswith("…") for line in lines if "526271a8" in line)  # the words, cut
