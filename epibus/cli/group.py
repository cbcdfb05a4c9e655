"""The app's top group: every failure of every command, usage errors included, ends the same way: one line on
stderr (one JSON object there with --json), nothing on stdout, exit code 1. A command added later gets this
without doing anything."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import typer
from typer._click import exceptions as usage  # typer 0.29 carries its own click
from typer.core import TyperGroup

from bus.errors import EpibusError
from epibus.cli.common import fail

PROG = "epibus"


def wants_json(args: Sequence[str]) -> bool:
    """--json among the options (not after `--`, where it would be an argument)."""
    options = args[: list(args).index("--")] if "--" in args else args
    return "--json" in options


def given(error: usage.UsageError, argv: Sequence[str]) -> str | None:
    """The value the arguments gave the option a BadParameter names (click's range and type messages leave it
    out)."""
    opts = getattr(getattr(error, "param", None), "opts", None) or []
    for index, word in enumerate(argv):
        for opt in opts:
            if word == opt and index + 1 < len(argv):
                return argv[index + 1]
            if word.startswith(f"{opt}="):
                return word[len(opt) + 1 :]
    return None


def usage_line(error: usage.UsageError, named: str, argv: Sequence[str] = ()) -> str:
    """Click's message as one line, naming the value given when it does not, with where to read the command's
    usage (`named`: the command the arguments name, for an error raised before click knew it)."""
    message = " ".join(error.format_message().split()).rstrip(".")
    value = given(error, argv) if isinstance(error, usage.BadParameter) else None
    if value is not None and value not in message:
        message += f" (given: {value!r})"
    path = error.ctx.command_path if error.ctx is not None and error.ctx.parent is not None else named
    return f"{message}; run '{path} --help'"


class EpibusGroup(TyperGroup):
    """Runs the app in click's non-standalone mode and reports what it raises in the one error format."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        code = self._run(argv, prog_name or PROG, complete_var, **extra)
        if standalone_mode:
            sys.exit(code)
        return code

    def _run(self, argv: list[str], prog_name: str, complete_var: str | None, **extra: Any) -> int:
        as_json = wants_json(argv)
        try:
            result = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except usage.NoArgsIsHelpError as e:  # `epibus`, `epibus mesh`: the help, as --help shows it
            typer.echo(e.ctx.get_help())
            return 0
        except usage.UsageError as e:
            line = usage_line(e, " ".join([prog_name, *self._named(argv)]), argv)
            return fail(line, as_json=as_json, error_type=type(e).__name__).exit_code
        except usage.ClickException as e:
            return fail(e.format_message(), as_json=as_json, error_type=type(e).__name__).exit_code
        except typer.Abort:
            return fail("aborted", as_json=as_json, error_type="Aborted").exit_code
        except EpibusError as e:  # a command without @handles_errors, or an option callback
            return fail(str(e), as_json=as_json, error_type=type(e).__name__).exit_code
        return result if isinstance(result, int) else 0

    def _named(self, argv: list[str]) -> list[str]:
        """The (sub)command names the arguments begin with."""
        names: list[str] = []
        group: Any = self
        for word in argv:
            group = getattr(group, "commands", {}).get(word)
            if group is None:
                break
            names.append(word)
        return names
