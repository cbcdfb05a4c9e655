"""`epibus recall` and `epibus audit-recall`: every node's mirror asked by meaning, the answers merged by event
id."""

from __future__ import annotations

from typing import Annotated

import typer

from bus.client.recall import RecallAnswer, ask_all, recall_request
from bus.model.requests import RecallRequest
from bus.model.review import vouched_cells
from epibus.cli import inputs
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JsonOpt,
    NatsOpt,
    Target,
    WideOpt,
    console,
    emit_json,
    err_console,
    handles_errors,
    run,
    table,
)
from epibus.cli.display import shown
from epibus.times import parse_time

QueryArg = Annotated[str, typer.Argument(help="What to recall, in words.")]
ProjectOpt = Annotated[
    str, typer.Option("--project", "-p", help="Project slug (required: recall is scoped).", callback=inputs.project)
]
KOpt = Annotated[int, typer.Option("--k", "-k", help="How many hits (1 to 200).", callback=inputs.limit(200))]
KindsOpt = Annotated[
    list[str] | None,
    typer.Option("--kind", help="Only these artifact kinds (repeatable).", callback=inputs.artifact_kind_list),
]
TimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait for the nodes.")]


def _show(answer: RecallAnswer, title: str, as_json: bool) -> None:
    if as_json:
        emit_json({"ok": True, **answer.as_dict()})
        return
    rows = [
        [
            f"{h['score']:.3f}",
            h["kind"],
            h["artifact_id"],
            f"{h['state']['trust']}/{h['state']['lifecycle']}",
            h["provenance"]["actor"],
            *vouched_cells(h["vouched"], h["review"]),
            h["content"],
        ]
        for h in answer.hits
    ]
    console.print(
        table(
            f"{title}: {len(rows)} hit(s) from {', '.join(answer.nodes)}",
            ["score", "kind", "artifact", "state", "actor", "agents", "people", "content"],
            rows,
        )
    )
    for node, error in answer.failed_nodes.items():
        err_console.print(shown(("warning:", "yellow"), f" node {node} did not answer: {error}"), soft_wrap=True)
    for node in answer.missing_nodes:  # live, with a mirror, and silent: these hits may lack its part
        err_console.print(shown(("warning:", "yellow"), f" live node {node} did not answer in time"), soft_wrap=True)


@handles_errors
def recall_command(
    query: QueryArg,
    project: ProjectOpt,
    k: KOpt = 10,
    kind: KindsOpt = None,
    include_resolved: Annotated[bool, typer.Option("--include-resolved", help="Also stale/superseded ones.")] = False,
    as_of: Annotated[str | None, typer.Option("--as-of", help="As it stood then: ISO time or age (2h).")] = None,
    timeout: TimeoutOpt = 3.0,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """The safe door by meaning: never contradicted, rolled back, retracted or mistyped items. Ranked by
    similarity x relevance; says which nodes answered. No mirror answering is an error, not "no matches"."""
    since, resolved = parse_time(as_of, "--as-of"), include_resolved
    request = recall_request(query, project, k=k, kinds=kind, include_resolved=resolved, as_of=since, audit=False)
    _show(run(_recall(request, timeout, Target(nats, home, agent))), "recall", as_json)


@handles_errors
def audit_recall_command(
    query: QueryArg,
    project: ProjectOpt,
    k: KOpt = 10,
    kind: KindsOpt = None,
    timeout: TimeoutOpt = 3.0,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """The audit door by meaning: everything mirrored, whatever its state, with that state (for reviewers and
    admins; under a node's home the node's operator asks)."""
    request = recall_request(query, project, k=k, kinds=kind, include_resolved=True, as_of=None, audit=True)
    _show(run(_recall(request, timeout, Target(nats, home, agent))), "audit recall", as_json)


async def _recall(request: RecallRequest, timeout_s: float, target: Target) -> RecallAnswer:
    async with target.asking() as (nc, signer):
        return await ask_all(nc, request, signer=signer, timeout_s=timeout_s)
