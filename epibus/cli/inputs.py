"""What a person types, checked before anything is read or written: one check per kind of input, used by
every command that takes it, with the rules the events themselves follow (bus/subjects.py, bus/model/event.py).
A refused value is a usage error naming the option, the value and what is allowed."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Annotated

import typer

import mesh.events  # noqa: F401  registers the mesh's kinds (task, coordinators): --kind accepts, reads parse them
from bus.model.fields import AGENT_PATTERN
from bus.model.kinds import artifact_kind_names, kind_names
from bus.subjects import PROJECT_PATTERN

PROJECT_RULE = "lowercase letters, digits and '-', starting with a letter or digit, at most 63 characters"


def project(value: str | None) -> str | None:
    """A project slug as every event carries it."""
    if value is not None and not PROJECT_PATTERN.fullmatch(value):
        raise typer.BadParameter(f"{value!r} is not a project slug: {PROJECT_RULE}")
    return value


def agent(value: str | None) -> str | None:
    """An agent id as every event carries it."""
    if value is not None and not AGENT_PATTERN.fullmatch(value):
        raise typer.BadParameter(
            f"{value!r} is not an agent id: lowercase letters, digits, '_' and '-', at most 64 characters"
        )
    return value


def _kind_in(value: str, allowed: list[str], what: str) -> str:
    if value in allowed:
        return value
    close = difflib.get_close_matches(value, allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise typer.BadParameter(f"{value!r} is not {what}; {hint}allowed: {', '.join(allowed)}")


def artifact_kind_list(values: list[str] | None) -> list[str] | None:
    """--kind, repeatable, on the artifact reads (artifacts, audit, recall)."""
    return [_kind_in(v, artifact_kind_names(), "an artifact kind") for v in values] if values else values


def event_kind(value: str | None) -> str | None:
    """--kind on the event reads (events, tail): any registered kind, transitions and mesh records too."""
    return None if value is None else _kind_in(value, kind_names(), "an event kind")


def at_least_one(value: int | None) -> int | None:
    """--limit, --count and the like: a whole number of items, 1 or more (the most is the option's own)."""
    if value is not None and value < 1:
        raise typer.BadParameter(f"{value} is not allowed: give a whole number of 1 or more")
    return value


def limit(most: int) -> Callable[[int | None], int | None]:
    """`at_least_one`, and at most `most`."""

    def check(value: int | None) -> int | None:
        if at_least_one(value) is not None and value is not None and value > most:
            raise typer.BadParameter(f"{value} is not allowed: give a whole number from 1 to {most}")
        return value

    return check


ProjectOpt = Annotated[str, typer.Option("--project", "-p", help="Project slug.", callback=project)]
ProjectFilterOpt = Annotated[str | None, typer.Option("--project", "-p", help="Only this project.", callback=project)]
ArtifactKindsOpt = Annotated[
    list[str] | None,
    typer.Option("--kind", "-k", help="Only these artifact kinds (repeatable).", callback=artifact_kind_list),
]
EventKindOpt = Annotated[str | None, typer.Option("--kind", "-k", help="Only this kind.", callback=event_kind)]
