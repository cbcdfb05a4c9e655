"""Every command of the CLI, as a person mistypes it: one error line on stderr (one JSON object there with
--json), nothing on stdout, exit code 1; --help still exits 0. The commands are read from the app itself, so
a command added later is checked too. Driven in-process: nothing here reaches a node."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main
import typer.testing
from typer.testing import CliRunner

from epibus.cli.app import app

LEAN = {"statusline"}  # answered by its own parser before the app loads (epibus.cli.main)
# A value each of these options refuses, in the order they are tried: the first one a command has is used.
BAD_VALUES = [
    ("--limit", "many"),
    ("--count", "-3"),
    ("--k", "0"),
    ("--timeout", "soon"),
    ("--port", "http"),
    ("--from-seq", "first"),
    ("--days", "forever"),
    ("--seq", "last"),
    ("--sweep", "often"),
    ("--replicas", "9"),
    ("--as", "gone"),
    ("--category", "urgent"),
    ("--role", "king"),
    ("--kind", "findng"),
    ("--project", "Not A Slug"),
]


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for name, sub in getattr(command, "commands", {}).items():
        if name not in LEAN:
            yield from _commands(sub, (*path, name)) if hasattr(sub, "commands") else [((*path, name), sub)]


CLI = typer.main.get_command(app)
COMMANDS = sorted(_commands(CLI), key=lambda c: c[0])
IDS = [" ".join(path) for path, _ in COMMANDS]


@pytest.fixture(autouse=True)
def _built_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner builds the click command from the app at every call (a quarter second): build it once."""
    monkeypatch.setattr(typer.testing, "_get_command", lambda _app: CLI)


def _options(command: Any) -> set[str]:
    return {opt for param in command.params for opt in getattr(param, "opts", [])}


def _bad_value(command: Any) -> list[str]:
    options = _options(command)
    for option, value in BAD_VALUES:
        if option in options:
            return [option, value]
    return ["--json=yes"]  # a flag given a value


def _invoke(args: list[str], home: Path) -> Any:
    return CliRunner().invoke(app, args, env={"EPIBUS_HOME": str(home), "COLUMNS": "80"})


def _one_error(result: Any, *, as_json: bool) -> dict[str, Any] | str:
    assert result.exit_code == 1, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.endswith("\n")
    if not as_json:
        assert result.stderr.startswith("error: ")
        return str(result.stderr)
    error = json.loads(result.stderr)
    assert error["ok"] is False
    assert set(error) == {"ok", "error", "type"}
    return dict(error)


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=IDS)
def test_a_bad_value_and_an_unknown_option_are_one_error_line(
    path: tuple[str, ...], command: Any, as_json: bool, tmp_path: Path
) -> None:
    extra = ["--json"] if as_json else []
    bad = _one_error(_invoke([*path, *_bad_value(command), *extra], tmp_path), as_json=as_json)
    unknown = _one_error(_invoke([*path, "--no-such-option", *extra], tmp_path), as_json=as_json)
    hint = f"run 'epibus {' '.join(path)} --help'"
    assert hint in str(bad)
    assert hint in str(unknown)
    assert "No such option: --no-such-option" in str(unknown)
    if as_json:
        assert isinstance(bad, dict)
        assert isinstance(unknown, dict)
        assert bad["type"] in ("BadParameter", "BadOptionUsage")
        assert unknown["type"] == "NoSuchOption"
    assert not (tmp_path / "keys").exists()  # refused while parsing: nothing ran


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize(
    ("path", "command"),
    [(p, c) for p, c in COMMANDS if any(param.required for param in c.params)],
    ids=[i for i, (_, c) in zip(IDS, COMMANDS, strict=True) if any(param.required for param in c.params)],
)
def test_a_missing_required_option_is_one_error_line(
    path: tuple[str, ...], command: Any, as_json: bool, tmp_path: Path
) -> None:
    error = _one_error(_invoke([*path, *(["--json"] if as_json else [])], tmp_path), as_json=as_json)
    assert "Missing " in str(error)
    assert f"run 'epibus {' '.join(path)} --help'" in str(error)
    if as_json:
        assert isinstance(error, dict)
        assert error["type"] == "MissingParameter"


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=IDS)
def test_help_still_works(path: tuple[str, ...], command: Any, tmp_path: Path) -> None:
    result = _invoke([*path, "--help"], tmp_path)
    assert result.exit_code == 0
    assert "Usage" in result.stdout
    assert result.stderr == ""


def test_the_reads_refuse_what_cannot_exist_naming_option_value_and_what_is_allowed(tmp_path: Path) -> None:
    slug = _one_error(_invoke(["artifacts", "-p", "Demo"], tmp_path), as_json=False)
    assert "'--project' / '-p': 'Demo' is not a project slug: lowercase letters" in str(slug)
    kind = _one_error(_invoke(["artifacts", "-p", "demo", "-k", "findng", "--json"], tmp_path), as_json=True)
    assert isinstance(kind, dict)
    assert "'findng' is not an artifact kind; did you mean 'finding'? allowed: assumption, dead_end" in kind["error"]
    event_kind = _one_error(_invoke(["events", "-k", "verifyed"], tmp_path), as_json=False)
    assert "did you mean 'verified'?" in str(event_kind)
    as_of = _one_error(_invoke(["audit", "-p", "demo", "--as-of", "yesterday"], tmp_path), as_json=False)
    assert "--as-of: 'yesterday' is neither ISO 8601 nor an age like 30m, 2h, 7d" in str(as_of)
    limit = _one_error(_invoke(["briefing", "-p", "demo", "--limit", "-1", "--json"], tmp_path), as_json=True)
    assert isinstance(limit, dict)
    assert "'--limit': -1 is not allowed: give a whole number of 1 or more" in limit["error"]
    k = _one_error(_invoke(["recall", "q", "-p", "demo", "--k", "500"], tmp_path), as_json=False)
    assert "500 is not allowed: give a whole number from 1 to 200" in str(k)


def test_a_value_out_of_range_is_named(tmp_path: Path) -> None:
    port = _one_error(_invoke(["up", "--port", "0"], tmp_path), as_json=False)
    assert "Invalid value for '--port': Input should be greater than or equal to 1 (given: '0')" in str(port)
    timeout = _one_error(_invoke(["publish", "finding", "--timeout=soon", "--json"], tmp_path), as_json=True)
    assert isinstance(timeout, dict)
    assert "(given: 'soon')" in timeout["error"]


def test_no_command_shows_the_help_and_an_unknown_one_is_one_line(tmp_path: Path) -> None:
    shown = _invoke([], tmp_path)
    assert shown.exit_code == 0
    assert "Usage" in shown.stdout
    unknown = _one_error(_invoke(["artefacts", "--json"], tmp_path), as_json=True)
    assert isinstance(unknown, dict)
    assert unknown["type"] == "UsageError"
    assert "artefacts" in unknown["error"]
