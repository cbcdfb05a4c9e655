"""The CLI's one way to the terminal: any text in, only inert characters out, shown literally and never
read as rich markup; and every print in the CLI goes through it."""

from __future__ import annotations

import ast
import io
import logging
import re
import sys
import unicodedata
from pathlib import Path

from hypothesis import example, given
from hypothesis import strategies as st
from rich.console import Console, RenderableType

from epibus.cli.display import SafeFormatter, plain, shown
from epibus.cli.tables import fitted

CLI = Path(__file__).resolve().parents[2] / "epibus" / "cli"
HIDDEN = {"Cc", "Cf", "Cs", "Zl", "Zp"}  # controls, format (bidi, zero-width), separators, lone surrogates
SGR = re.compile(r"\x1b\[[0-9;]*m")  # the only sequence rich itself writes, for styles
TRICKY = ("[", "]", "/", "=", "b", "l", "\\", "\x1b", "\x07", "\x9b", "\x7f", "\r", "\n", "\t", "\u202e", "\u2066")
# Every code point (surrogates too), mixed with the pieces markup and escape sequences are made of.
any_text = st.text(st.one_of(st.characters(exclude_categories=[]), st.sampled_from(TRICKY)))
HOSTILE = (
    "[/]",
    "[bold]x[/bold]",
    "[link=http://evil]x[/link]",
    "\x1b[2J",
    "\x1b]0;pwned\x07",
    "\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\",
    "\x9b31m",
    "\u202eabc",
    "a\x00b\x08c\rd",
)


def on_terminal(renderable: RenderableType) -> str:
    """What a colour terminal would receive."""
    console = Console(file=io.StringIO(), force_terminal=True, color_system="truecolor", width=400)
    console.print(renderable, soft_wrap=True)
    assert isinstance(console.file, io.StringIO)
    return console.file.getvalue()


def hidden(text: str, *, but: str = "") -> list[str]:
    return [c for c in text if unicodedata.category(c) in HIDDEN and c not in but]


@given(any_text)
@example("".join(HOSTILE))
def test_any_text_comes_out_without_control_bidi_or_invisible_characters(text: str) -> None:
    assert hidden(plain(text)) == []
    assert hidden(plain(text, multiline=True), but="\n") == []
    assert plain(text, multiline=True).count("\n") == text.count("\n")


@given(any_text)
@example("".join(HOSTILE))
def test_any_text_reaches_the_terminal_literally_and_never_as_markup(text: str) -> None:
    # Unstyled, nothing but the text itself is written: no sequence at all, markup shown as typed.
    assert on_terminal(shown(text)) == plain(text) + "\n"


def test_printable_text_is_left_as_it_is_and_controls_are_spelled_out() -> None:
    assert plain("[bold]x[/bold] naïve 日本") == "[bold]x[/bold] naïve 日本"
    assert plain("\x1b]0;pwned\x07") == "\\x1b]0;pwned\\x07"
    assert plain("\x9b31m\u202e\ufeff\u2028") == "\\x9b31m\\u202e\\ufeff\\u2028"
    assert plain("a\tb\nc") == "a b c"
    assert plain("a\tb\nc", multiline=True) == "a b\nc"
    assert plain(None) == ""


@given(any_text)
def test_a_styled_line_carries_only_its_own_style_sequences(text: str) -> None:
    out = on_terminal(shown(("warning:", "yellow"), " ", text))
    assert SGR.sub("", out) == "warning: " + plain(text) + "\n"


def test_a_table_of_hostile_texts_renders_them_literally_with_no_sequence_but_styles() -> None:
    rows = [[h, h] for h in HOSTILE]
    out = on_terminal(fitted("[/] " + HOSTILE[3], ["[bold]", "text"], rows, width=400, wide=True))
    inert = SGR.sub("", out)
    assert "\x1b" not in inert
    assert hidden(inert, but="\n") == []
    assert [plain(h) for h in HOSTILE if plain(h) not in inert] == []
    assert "[/] \\x1b[2J" in inert
    assert "[bold]" in inert


def test_log_lines_spell_out_the_controls_in_what_they_log() -> None:
    record = logging.LogRecord(
        "bus.intake.runner", logging.WARNING, __file__, 1, "dead-lettered %s", (HOSTILE[5],), None
    )
    try:
        raise ValueError("\x1b[2J")
    except ValueError:
        record.exc_info = sys.exc_info()
    line = SafeFormatter("%(levelname)s %(message)s").format(record)
    assert line.startswith("WARNING dead-lettered \\x1b]8;;http://evil\\x1b\\link")
    assert hidden(line, but="\n") == []
    assert "ValueError: \\x1b[2J" in line


def test_every_print_in_the_cli_goes_through_the_display_module() -> None:
    """A console print of a bare string or f-string would read its text as markup: only shown() or table()."""
    offenders = []
    for path in sorted(CLI.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = node.func.value
            if node.func.attr == "print" and isinstance(receiver, ast.Name) and receiver.id.endswith("console"):
                first = node.args[0] if node.args else None
                through = first.func.id if isinstance(first, ast.Call) and isinstance(first.func, ast.Name) else None
                if through not in ("shown", "table"):
                    offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []
