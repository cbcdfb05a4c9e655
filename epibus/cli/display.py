"""The only way the CLI puts text on a terminal: whatever another agent, a store or the network wrote is shown
literally, with every character a terminal would act on or hide made visible, and never read as rich markup."""

from __future__ import annotations

import logging
import unicodedata

from rich.text import Text

# Controls (C0, DEL, C1: ESC starts CSI/OSC sequences, 0x9b is a one-byte CSI), format characters (bidi
# overrides and isolates, zero-width ones), line and paragraph separators, and lone surrogates, which
# cannot be encoded and would crash the write.
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})

Part = str | tuple[str, str]


def _visible(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def plain(value: object, *, multiline: bool = False) -> str:
    """`value` as a string safe for a terminal: a tab becomes a space, a newline stays only if `multiline`
    (else a space), and every other control, bidi or invisible format character is spelled out as `\\x1b`
    or `\\u202e`. Rich markup in it is left as characters; print it only inside a `Text` (see `shown`)."""
    text = "" if value is None else str(value)
    if text.isprintable():  # the common case: nothing to replace
        return text
    out: list[str] = []
    for char in text:
        if char == "\t":
            out.append(" ")
        elif char == "\n":
            out.append("\n" if multiline else " ")
        elif unicodedata.category(char) in _HIDDEN_CATEGORIES:
            out.append(_visible(char))
        else:
            out.append(char)
    return "".join(out)


def shown(*parts: Part, multiline: bool = False) -> Text:
    """A literal rich `Text` of the parts, each made safe by `plain`; a `(text, style)` pair styles its text.
    Nothing in a part is parsed as markup, so `[/]` or `[link=…]` in it is shown as written."""
    text = Text()
    for part in parts:
        value, style = part if isinstance(part, tuple) else (part, "")
        text.append(plain(value, multiline=multiline), style=style)
    return text


class SafeFormatter(logging.Formatter):
    """Log records as one safe string: a logged remote text cannot reach the terminal as escape sequences."""

    def format(self, record: logging.LogRecord) -> str:
        return plain(super().format(record), multiline=True)
