"""`epibus publish <kind>`: one command per registered kind, its options made from the kind's body model."""

from __future__ import annotations

import inspect
import types
import typing
from enum import StrEnum
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from bus.client.client import connect
from bus.errors import InvalidEvent
from bus.host.home import default_agent, epibus_home
from bus.identity.signing import AgentKey
from bus.model.event import draft_event, invalid_event_of
from bus.model.ids import new_event_id
from bus.model.kinds import Body, Evidence, kind_names, require_kind
from bus.model.vocab import HELP, EpistemicSource, EvidenceKind, ReceiptLevel, describe
from epibus.cli import ids
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JsonOpt,
    NatsOpt,
    QuietOpt,
    console,
    emit_json,
    err_console,
    handles_errors,
    run,
    table,
)
from epibus.cli.display import shown
from epibus.cli.inputs import ProjectOpt

publish_app = typer.Typer(
    help="Publish an event. One subcommand per kind: `epibus publish finding --help`.", no_args_is_help=True
)


ARTIFACT_LINKS = ("revises", "supersedes")


def _option_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _parse_evidence(values: list[str]) -> list[Evidence]:
    evidence = []
    for value in values:
        kind, sep, ref = value.partition(":")
        if not sep or kind not in EvidenceKind.__members__:
            kinds = ", ".join(EvidenceKind.__members__)
            raise InvalidEvent(f"--evidence={value!r}", f"must be KIND:REF with KIND one of {{{kinds}}}")
        try:
            evidence.append(Evidence(kind=EvidenceKind(kind), ref=ref))
        except ValidationError as e:  # an empty, too long or undecodable REF: one line, not a traceback
            raise InvalidEvent(f"--evidence={value!r}", f"REF: {invalid_event_of(e).problem}") from None
    return evidence


def _field_parameter(name: str, field: FieldInfo) -> tuple[inspect.Parameter, Any]:
    """A typer option for one body field: its CLI type and the typer annotation."""
    annotation: Any = field.annotation
    optional = False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional, annotation = True, args[0]
    origin = typing.get_origin(annotation)
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
        origin = typing.get_origin(annotation)
    help_text = field.description or ""
    if origin in (tuple, list):
        (item,) = typing.get_args(annotation)[:1]
        if item is Evidence:
            cli_type: Any = list[str] | None
            help_text = "evidence pointer KIND:REF, repeatable (" + describe(EvidenceKind) + ")"
        else:
            cli_type = list[str] | None
            help_text = help_text or "repeatable"
        default: Any = None
    else:
        if isinstance(annotation, type) and issubclass(annotation, StrEnum) and annotation in HELP:
            help_text = describe(annotation)
        cli_type = annotation if not optional else annotation | None
        default = None if optional or not field.is_required() else ...
    option = typer.Option(_option_name(name), help=help_text, show_default=False)
    parameter = inspect.Parameter(
        name,
        inspect.Parameter.KEYWORD_ONLY,
        default=default if default is not ... else inspect.Parameter.empty,
        annotation=Annotated[cli_type, option],
    )
    return parameter, cli_type


def _common_parameters() -> list[inspect.Parameter]:
    keyword = inspect.Parameter.KEYWORD_ONLY
    p = inspect.Parameter
    return [
        p("project", keyword, annotation=ProjectOpt),
        p(
            "artifact_id",
            keyword,
            default=None,
            annotation=Annotated[
                str | None, typer.Option("--artifact-id", help="Artifact acted on (required for transitions).")
            ],
        ),
        p(
            "source",
            keyword,
            default=None,
            annotation=Annotated[EpistemicSource | None, typer.Option("--source", help=describe(EpistemicSource))],
        ),
        p("goal_id", keyword, default=None, annotation=Annotated[str | None, typer.Option("--goal-id")]),
        p(
            "wait_for",
            keyword,
            default=ReceiptLevel.published,
            annotation=Annotated[
                ReceiptLevel,
                typer.Option(
                    "--wait",
                    help="Level to wait for: published (a stream has it), journaled (a node's journal has it) or "
                    "indexed (a node's mirror has it: recall finds it).",
                ),
            ],
        ),
        p(
            "timeout_s",
            keyword,
            default=10.0,
            annotation=Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait for the receipt.")],
        ),
        p(
            "strict",
            keyword,
            default=False,
            annotation=Annotated[
                bool, typer.Option("--strict", help="Refuse a claim that repeats a retracted or rolled-back one.")
            ],
        ),
        p("agent", keyword, default=None, annotation=AgentOpt),
        p("nats", keyword, default=None, annotation=NatsOpt),
        p("home", keyword, default=None, annotation=HomeOpt),
        p("as_json", keyword, default=False, annotation=JsonOpt),
        p("quiet", keyword, default=False, annotation=QuietOpt),
    ]


def _make_command(kind: str) -> Any:
    spec = require_kind(kind)
    body_model: type[Body] = spec.body
    field_params = [_field_parameter(name, field)[0] for name, field in body_model.model_fields.items()]
    common = _common_parameters()
    field_names = [p.name for p in field_params]

    def command(**options: Any) -> None:
        body: dict[str, Any] = {}
        for name in field_names:
            value = options[name]
            if value is None:
                continue
            body[name] = _parse_evidence(value) if name == "evidence" else value
        for link in ARTIFACT_LINKS:  # a claim's links to other artifacts take prefixes too
            if link in body:
                body[link] = ids.artifact_id(
                    body[link], field=_option_name(link), project=options["project"], journal=None, home=options["home"]
                )
        run(_publish(kind, body, options))

    command.__signature__ = inspect.Signature([*common, *field_params])  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in [*common, *field_params]}
    article = "an" if kind[0] in "aeiou" else "a"
    command.__doc__ = f"Publish {article} {kind} event" + (" (acts on --artifact-id)." if spec.transition else ".")
    return handles_errors(command)


async def _publish(kind: str, body: dict[str, Any], o: dict[str, Any]) -> None:
    if o["wait_for"] is ReceiptLevel.outboxed:
        raise InvalidEvent("--wait", repr(o["wait_for"].value), allowed=["published", "journaled", "indexed"])
    # Validate and sign before connecting: bad input is named even when no node is running.
    home = epibus_home(o["home"])
    key = AgentKey.load_or_create(home, o["agent"] or default_agent())
    draft = draft_event(
        kind,
        body,
        project=o["project"],
        actor=key.actor,
        session_id=str(new_event_id()),
        artifact_id=o["artifact_id"],
        goal_id=o["goal_id"],
        source=o["source"],
    )
    event = key.sign(draft)  # raises InvalidEvent over the size limit, too
    # No node running and no --nats: the event waits in the home's outbox, signed as it would be sent now, and
    # the node's forwarder sends it (same event id) when it starts.
    async with connect(
        o["nats"],
        agent=key.agent_id,
        home=home,
        offline_without_node=True,
        publish_timeout_s=o["timeout_s"],
        connect_timeout_s=min(5.0, o["timeout_s"]),
    ) as client:
        receipt = await client.publish(event, wait_for=o["wait_for"], timeout_s=o["timeout_s"], strict=o["strict"])
    if o["as_json"]:
        emit_json({"ok": True, **receipt.as_dict(), "artifact_id": event.artifact_id})
        return
    if o["quiet"]:
        print(event.artifact_id, flush=True)
        return
    if client.offline:
        err_console.print(
            shown(f"no epibus node is running under {home}: the event waits in the outbox until `epibus up`"),
            soft_wrap=True,
        )
    rows: list[list[Any]] = [
        ["event_id", receipt.event_id],
        ["artifact_id", event.artifact_id],
        ["level", receipt.level.value],
        ["stream_seq", receipt.stream_seq],
        ["duplicate", receipt.duplicate],
        ["flags", ",".join(receipt.flags)],
    ]
    title = f"{'published' if receipt.level is not ReceiptLevel.outboxed else 'outboxed'} {kind}"
    console.print(table(title, ["field", "value"], rows))


def register_publish_commands() -> None:
    """Artifact kinds only, not records a subsystem writes (the mesh's). State changes go through
    resolve/verify/contradict/rollback, which validate them against the artifact's current state and publish
    with compare-and-set."""
    for kind in kind_names():
        body = require_kind(kind).body
        if not body.transition and not body.system_record:
            publish_app.command(name=kind.replace("_", "-"))(_make_command(kind))
