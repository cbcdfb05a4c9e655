"""How the CLI lays out a table. On a terminal (or with COLUMNS set) it fits the width: an id is never folded
across lines, a header never split, a short value never wrapped, and the free text is cut with `…` (`--wide`
shows it whole, folded). When ids and headers alone do not fit, each id is shown as its shortest prefix that
is unique among the table's ids, as git abbreviates commits (every command takes a unique prefix). Piped to
another program, a table is plain, stable columns: a header line, then one line per row, nothing cut."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.rule import Rule
from rich.segment import Segment
from rich.table import Table

from bus.model.watch import WATCH_ID_PATTERN
from epibus.cli.display import plain, shown

_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"  # event, artifact, task ids
_WATCH_ID = r"\b" + WATCH_ID_PATTERN.strip("^$") + r"\b"
# What a person copies out of a table into the next command: never folded across lines.
_KEY = r"\bU[A-Z2-7]{55}\b"  # an agent's public key
ID_TOKEN = re.compile(f"{_UUID}|{_WATCH_ID}|{_KEY}")
# The ids every command takes by a unique prefix: shown as one when the table is too narrow for them whole.
PREFIXED_ID = re.compile(f"{_UUID}|{_WATCH_ID}")
PUBLIC_KEY = re.compile(_KEY)
KEY_CHARS = 12
MIN_ID_CHARS = 13  # 12 hex digits: a UUIDv7's milliseconds; ids made in other milliseconds differ within them
MIN_TEXT_CHARS = 10  # a text column narrower than this says nothing
GAP = 2  # between two columns: the divider (a space) and one of padding; no outer edge
PLAIN_WIDTH = 1_000_000  # a pipe has no width: nothing is wrapped or cut
_wide = False  # --wide: this process prints text whole (a CLI process prints for one command)


def set_wide(wide: bool) -> bool:
    """The `--wide` option's callback: every table this command prints shows its text whole."""
    global _wide
    _wide = wide
    return wide


def piped() -> bool:
    """stdout goes to another program (and no width was asked for with COLUMNS)."""
    return not sys.stdout.isatty() and "COLUMNS" not in os.environ


def make_console() -> Console:
    return Console(width=PLAIN_WIDTH if piped() else None)


@dataclass(frozen=True)
class PlainTable:
    """Columns for a program to read: two spaces between them, the last one unpadded, one line per row."""

    columns: Sequence[str]
    rows: Sequence[Sequence[str]]

    def lines(self) -> Iterator[str]:
        table = [list(self.columns), *(list(row) for row in self.rows)]
        widths = [max(cell_len(row[i]) for row in table) for i in range(len(self.columns))]
        for row in table:
            padded = [cell + " " * (widths[i] - cell_len(cell)) for i, cell in enumerate(row[:-1])]
            yield "  ".join([*padded, row[-1]]).rstrip()

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for line in self.lines():
            yield Segment(line)
            yield Segment.line()


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, wide: bool | None = None) -> Any:
    """The table as the output wants it: plain columns on a pipe, else a rich table fitted to the console
    (`wide`: text whole, folded; by default as the command's --wide said)."""
    wide = _wide if wide is None else wide
    cells = [["" if value is None else str(value) for value in row] for row in rows]
    if piped():
        return PlainTable([plain(c) for c in columns], [[plain(c) for c in row] for row in cells])
    return fitted(title, columns, cells, width=make_console().width, wide=wide)


def fitted(
    title: str, columns: Sequence[str], cells: Sequence[Sequence[str]], *, width: int, wide: bool
) -> RenderableType:
    # measured as shown: a control character is spelled out (`\x1b`), so it takes four cells, not one
    cells = [[plain(cell, multiline=True) for cell in row] for row in cells]
    kinds = [_kind(column, [row[i] for row in cells]) for i, column in enumerate(columns)]
    if wide and _natural_width(columns, cells, kinds) > width:
        return expanded(title, columns, cells)
    # Before a short column (a kind, a state) is cut: empty columns go, then ids shrink to unique prefixes.
    if cells and _natural_width(columns, cells, kinds) > width:  # no rows: the headers say what would be there
        kept = [i for i in range(len(columns)) if any(row[i] for row in cells)]  # an empty column says nothing
        columns, kinds = [columns[i] for i in kept], [kinds[i] for i in kept]
        cells = [[row[i] for i in kept] for row in cells]
    if not wide and _natural_width(columns, cells, kinds) > width:
        cells = abbreviated_ids(cells)
    widths = _widths(columns, cells, kinds, width=width, wide=wide)
    longest_title_word = max((len(word) for word in title.split()), default=0)
    t = Table(
        title=shown(title),
        min_width=min(width, longest_title_word + 4),
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1, 0, 0),
    )
    for column, kind, column_width in zip(columns, kinds, widths, strict=True):
        folds = wide and kind == "text"
        t.add_column(shown(column), width=column_width, no_wrap=not folds, overflow="fold" if folds else "ellipsis")
    for row in cells:
        t.add_row(*(shown(cell, multiline=wide and kinds[i] == "text") for i, cell in enumerate(row)))
    return t


def _kind(column: str, values: Sequence[str]) -> str:
    """id: every value is an id (or empty); text: free text (spaces, or long); short: the rest."""
    filled = [v for v in values if v]
    if filled and all(ID_TOKEN.fullmatch(v) for v in filled):
        return "id"
    if any(" " in v.strip() or "\n" in v or len(v) > 40 for v in filled):
        return "text"
    return "short"


def _natural(column: str, values: Sequence[str]) -> int:
    return max([cell_len(column), *(max(map(cell_len, v.split("\n")), default=0) for v in values)])


def _least(column: str, values: Sequence[str], kind: str) -> int:
    """The narrowest a column may get: an id whole, a header whole, text a few words."""
    if kind == "id":
        return _natural(column, values)
    natural = _natural(column, values)
    floor = MIN_TEXT_CHARS if kind == "text" else 1
    return min(natural, max(cell_len(column), floor))


def _natural_width(columns: Sequence[str], cells: Sequence[Sequence[str]], kinds: Sequence[str]) -> int:
    """The width of the table with text folded at MIN_TEXT_CHARS and everything else whole."""
    values = [[row[i] for row in cells] for i in range(len(columns))]
    natural = [
        min(_natural(c, v), max(MIN_TEXT_CHARS, cell_len(c))) if k == "text" else _natural(c, v)
        for c, v, k in zip(columns, values, kinds, strict=True)
    ]
    return sum(natural) + GAP * (len(columns) - 1)


def expanded(title: str, columns: Sequence[str], cells: Sequence[Sequence[str]]) -> RenderableType:
    """--wide on a terminal too narrow for the whole table: each row as a record, one field per line, as
    psql's expanded display does; every value whole, text folded."""
    parts: list[RenderableType] = [shown(title, multiline=False)]
    for number, row in enumerate(cells, start=1):
        record = Table.grid(padding=(0, 2))
        record.add_column(style="bold", no_wrap=True)
        record.add_column(overflow="fold")
        for column, cell in zip(columns, row, strict=True):
            record.add_row(shown(column), shown(cell, multiline=True))
        parts += [Rule(f"{number}", align="left", characters="─"), record]
    return Group(*parts)


def _widths(
    columns: Sequence[str], cells: Sequence[Sequence[str]], kinds: Sequence[str], *, width: int, wide: bool
) -> list[int]:
    """Each column's width: its natural width if all fit; else text columns give way first (down to
    MIN_TEXT_CHARS), then the widest short columns (down to their headers). Ids never give way."""
    values = [[row[i] for row in cells] for i in range(len(columns))]
    natural = [_natural(c, v) for c, v in zip(columns, values, strict=True)]
    least = [_least(c, v, k) for c, v, k in zip(columns, values, kinds, strict=True)]
    room = width - GAP * (len(columns) - 1)
    widths = list(natural)
    over = sum(widths) - room
    for giving in (("text",), ("short",)):
        while over > 0:
            candidates = [i for i, k in enumerate(kinds) if k in giving and widths[i] > least[i]]
            if not candidates:
                break
            widest = max(candidates, key=lambda i: widths[i] - least[i])
            widths[widest] -= 1
            over -= 1
    if wide:  # folded text takes what is left, whatever its natural width
        return [max(w, least[i]) for i, w in enumerate(widths)]
    return widths


def abbreviated_ids(cells: Sequence[Sequence[str]]) -> list[list[str]]:
    """Every id a command takes by prefix (a UUID, a watch id) cut to the shortest prefix (at least MIN_ID_CHARS)
    that no other id in the table shares; a key to its first KEY_CHARS and `…` (no command takes a key's prefix:
    --wide or --json show it whole)."""
    ids = sorted({m.group() for row in cells for cell in row for m in PREFIXED_ID.finditer(cell)})
    short = {full: _unique_prefix(full, ids) for full in ids}

    def cut(cell: str) -> str:
        cell = PREFIXED_ID.sub(lambda m: short[m.group()], cell)
        return PUBLIC_KEY.sub(lambda m: m.group()[:KEY_CHARS] + "…", cell)

    return [[cut(cell) for cell in row] for row in cells]


def _unique_prefix(full: str, ids: Sequence[str]) -> str:
    for length in range(MIN_ID_CHARS, len(full)):
        prefix = full[:length]
        if prefix.endswith("-"):
            continue
        if sum(1 for other in ids if other.startswith(prefix)) == 1:
            return prefix
    return full
