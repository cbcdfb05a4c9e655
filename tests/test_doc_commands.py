"""Every `epibus` command shown in the README and in docs/ is one the CLI accepts as written: the subcommands
exist and every option and argument parses (names, values from the closed vocabularies, numbers). A renamed
flag or command fails here, not on a reader's terminal. Placeholders in capitals (ARTIFACT, TOKEN) stand for
the value a reader fills in and parse as the strings they are."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer.main

# typer runs its own copy of click: its commands and errors are these, not the click package's.
from typer._click import core as click_core
from typer._click import exceptions as click_errors
from typer.core import TyperGroup

from epibus.cli import LEAN_COMMANDS
from epibus.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)\s*$")
PROMPT = re.compile(r"^(?:\$ |\.venv/bin/)?(epibus\s.*)$")


def shown_commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command) for each `epibus …` line inside a fenced block of `path`, with its continuation
    lines joined, its trailing comment dropped and anything after a pipe or `&&` cut. Left out: usage synopses
    (`[--home DIR]`), statusline output (`epibus up · outbox 0`) and a command shown with the error it gets
    (the next line starts `error:` or is a JSON error), which is there to be refused."""
    lines = path.read_text().splitlines()
    found: list[tuple[int, str]] = []
    inside = False
    pending: tuple[int, str] | None = None
    for index, line in enumerate(lines):
        if FENCE.match(line.strip()):
            inside = not inside
            continue
        if not inside:
            continue
        if pending is not None:
            start, text = pending
            pending = (start, text + " " + line.strip().rstrip("\\")) if line.rstrip().endswith("\\") else None
            if pending is None:
                found.append((start, text + " " + line.strip()))
            continue
        match = PROMPT.match(line.strip())
        if match is None or "[--" in line or "·" in line or _shown_refused(lines, index):
            continue
        if line.rstrip().endswith("\\"):
            pending = (index + 1, match.group(1).rstrip().rstrip("\\"))
        else:
            found.append((index + 1, match.group(1)))
    return [(number, _command_only(text)) for number, text in found]


def _shown_refused(lines: list[str], index: int) -> bool:
    after = lines[index + 1].strip() if index + 1 < len(lines) else ""
    return after.startswith("error:") or after.startswith('{"ok": false')


def _command_only(text: str) -> str:
    words = shlex.split(text, comments=True)
    for stop in ("|", "&&", ";", ">", "2>&1", "&", "<", "<<<"):
        if stop in words:
            words = words[: words.index(stop)]
    return shlex.join(words)


def parse(command: str) -> None:
    """Parse `command` (which starts with `epibus`) as the CLI would, without running it. Raises click's
    UsageError (or BadParameter) naming what does not parse."""
    words = shlex.split(command)[1:]
    if words and words[0] in LEAN_COMMANDS:
        return  # answered before the CLI loads (the statusline); it takes no options of the CLI's
    current: click_core.Command = typer.main.get_command(app)
    context = current.make_context("epibus", [], resilient_parsing=True)
    while isinstance(current, TyperGroup) and words and not words[0].startswith("-"):
        sub = current.get_command(context, words[0])
        if sub is None:
            raise click_errors.UsageError(f"no such command {words[0]!r} under {context.command_path!r}")
        current, words = sub, words[1:]
        context = current.make_context(current.name or "", [], parent=context, resilient_parsing=True)
    if "--help" in words:
        return
    with current.make_context(current.name or "", list(words), parent=context.parent):
        pass


CASES = [
    pytest.param(command, id=f"{path.name}:{number}") for path in DOCUMENTS for number, command in shown_commands(path)
]


def test_the_documents_show_commands_at_all() -> None:
    assert len(CASES) > 40, "the extraction found almost no commands: the fence or prompt pattern broke"


@pytest.mark.parametrize("command", CASES)
def test_a_documented_command_parses_as_written(command: str) -> None:
    try:
        parse(command)
    except click_errors.ClickException as e:
        pytest.fail(f"`{command}`: {e.format_message()}")


def test_the_check_refuses_a_renamed_flag_and_an_unknown_command() -> None:
    with pytest.raises(click_errors.UsageError):
        parse("epibus artifacts -p demo --no-such-flag")
    with pytest.raises(click_errors.UsageError):
        parse("epibus no-such-command")
    with pytest.raises(click_errors.BadParameter):
        parse("epibus resolve ARTIFACT -p demo --as maybe")
