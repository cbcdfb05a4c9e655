"""`epibus policy set|show`: a project's review policy. An admin of the project sets it; the node records it on
the stream next to the enrolments, so every node and every read applies the same one: claims at or above the
impact await a person's review, ranked after the rest by the safe door, or withheld from it."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from bus.client import enrol
from bus.errors import ConfigError
from bus.model.requests import PolicySetRequest, build_request
from bus.model.vocab import ReviewMode
from epibus.cli.common import AgentOpt, HomeOpt, JsonOpt, NatsOpt, Target, console, emit_json, handles_errors, run
from epibus.cli.inputs import ProjectOpt
from epibus.cli.tables import table

policy_app = typer.Typer(help="A project's review policy: which claims need a person's review.", no_args_is_help=True)


def _show(reply: Any, as_json: bool, title: str) -> None:
    if as_json:
        emit_json(reply.model_dump(mode="json"))
        return
    policy = reply.policy
    if policy is None or policy["human_review_impact"] is None:
        rows = [["project", reply.project], ["human review", "not required"]]
    else:
        rows = [
            ["project", reply.project],
            ["human review", f"claims of impact {policy['human_review_impact']:g} or more"],
            ["until reviewed", f"{policy['mode']}: " + ("after the rest" if policy["mode"] == "rank" else "withheld")],
        ]
    if policy is not None:
        rows.append(["set by", f"{policy['set_by']} at {policy['set_at']}"])
    console.print(table(title, ["field", "value"], rows))


@policy_app.command("set")
@handles_errors
def set_command(
    project: ProjectOpt,
    human_review_impact: Annotated[
        float | None,
        typer.Option(
            "--human-review-impact", min=0.0, max=1.0, help="Claims of this impact or more need a person's review."
        ),
    ] = None,
    withhold: Annotated[
        bool, typer.Option("--withhold", help="Keep them from the safe door until reviewed (default: rank last).")
    ] = False,
    clear: Annotated[bool, typer.Option("--clear", help="No claim needs a person's review any more.")] = False,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Set the project's review policy (admins of the project), recorded on the stream for every node."""
    if clear == (human_review_impact is not None):
        raise ConfigError("--human-review-impact", "give an impact from 0 to 1, or --clear (one of the two)")
    mode = ReviewMode.withhold if withhold else ReviewMode.rank
    request = build_request(PolicySetRequest, project=project, human_review_impact=human_review_impact, mode=mode)
    target = Target(nats, home, agent)

    async def ask() -> Any:
        async with target.asking() as (nc, signer):
            return await enrol.set_policy(nc, signer, request)

    _show(run(ask()), as_json, "review policy set")


@policy_app.command("show")
@handles_errors
def show_command(
    project: ProjectOpt, nats: NatsOpt = None, agent: AgentOpt = None, home: HomeOpt = None, as_json: JsonOpt = False
) -> None:
    """The project's review policy, as a node holds it."""
    target = Target(nats, home, agent)

    async def ask() -> Any:
        async with target.asking() as (nc, signer):
            return await enrol.show_policy(nc, signer, project)

    _show(run(ask()), as_json, "review policy")
