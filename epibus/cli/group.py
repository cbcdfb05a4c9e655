"""The app's top group: every failure of every command, usage errors included, ends the same way: one line on
stderr (one JSON object there with --json), nothing on stdout, exit code 1. A command added later gets this
without doing anything."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import typer
from typer._click import exceptions as usage  # typer 0.29 carries its own click
from typer.core import TyperGroup, TyperOption

from bus.errors import EpibusError
from epibus.cli.common import fail
from epibus.extras import missing_extra

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


def every_missing(error: usage.MissingParameter, argv: Sequence[str]) -> str | None:
    """All the required options the arguments leave out, not only the first that click stopped at: one run
    names everything to add. None when click's own message says it all (one missing, or an argument)."""
    if error.ctx is None or error.param is None:
        return None
    words = [w.split("=", 1)[0] for w in argv]
    missing = [
        param.opts[0]
        for param in error.ctx.command.params
        if isinstance(param, TyperOption)
        and param.required
        and not any(opt in words for opt in param.opts)
        and not (param.envvar and any(os.environ.get(v) for v in _envvars(param.envvar)))
    ]
    if len(missing) < 2:
        return None
    return "Missing options " + ", ".join(f"'{opt}'" for opt in missing)


def _envvars(envvar: str | Sequence[str]) -> list[str]:
    return [envvar] if isinstance(envvar, str) else list(envvar)


def untyped_flags(command: Any, ctx: Any) -> None:
    """A flag takes no value, so its help shows none (typer 0.29 prints `--json <bool>`): an empty metavar,
    on the command, its help option and every subcommand below it."""
    for param in command.get_params(ctx):
        if getattr(param, "is_flag", False):
            param.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        untyped_flags(sub, ctx)


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
            if isinstance(e, usage.MissingParameter) and (every := every_missing(e, argv)) is not None:
                line = every + line[line.index("; run '") :]
            return fail(line, as_json=as_json, error_type=type(e).__name__).exit_code
        except usage.ClickException as e:
            return fail(e.format_message(), as_json=as_json, error_type=type(e).__name__).exit_code
        except typer.Abort:
            return fail("aborted", as_json=as_json, error_type="Aborted").exit_code
        except EpibusError as e:  # a command without @handles_errors, or an option callback
            return fail(str(e), as_json=as_json, error_type=type(e).__name__).exit_code
        except ModuleNotFoundError as e:  # a node command on the light install
            if (fix := missing_extra(e)) is None:
                raise
            return fail(fix, as_json=as_json, error_type="MissingExtra").exit_code
        return result if isinstance(result, int) else 0

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            untyped_flags(command, ctx)
        return command

    def format_help(self, ctx: Any, formatter: Any) -> None:
        untyped_flags(self, ctx)
        super().format_help(ctx, formatter)

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
