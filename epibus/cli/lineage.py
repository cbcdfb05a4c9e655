"""`epibus lineage`: the revisions, supersessions and contradictions around one artifact, read from the journal
(through a node as --agent, or directly with --journal: see epibus/cli/reads.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import typer

from bus.model.requests import JournalReadRequest, build_request
from epibus.cli.common import AgentOpt, HomeOpt, JsonOpt, NatsOpt, console, emit_json, handles_errors, table
from epibus.cli.display import shown
from epibus.cli.inputs import ProjectOpt
from epibus.cli.reads import AsOfOpt, ReadJournalOpt, journal_read, state_label
from epibus.times import parse_time

ArtifactArg = Annotated[str, typer.Argument(help="The artifact whose lineage is shown (id or unique prefix).")]
COLUMNS = ["relation", "artifact", "kind", "trust/lifecycle", "author", "created", "content"]


def _row(relation: str, member: dict[str, Any]) -> list[Any]:
    content = "(forgotten) " + member["content"] if member["forgotten"] else member["content"]
    created = datetime.fromisoformat(member["created_at"]).strftime("%Y-%m-%d %H:%M")
    label = state_label(member)
    return [relation, member["artifact_id"], member["kind"], label, member["author"], created, content]


def lineage_rows(found: dict[str, Any]) -> list[list[Any]]:
    """One row per member, in reading order: the root ancestor down to the artifact, then what came of it."""
    ancestors = found["ancestors"]
    rows = [_row(f"ancestor {len(ancestors) - i}", m) for i, m in enumerate(reversed(ancestors))]
    rows.append(_row("this artifact", found["artifact"]))
    rows += [_row(f"revised by (depth {d['depth']})", d) for d in found["descendants"]]
    rows += [_row(f"supersedes ({i})", m) for i, m in enumerate(found["supersedes"], start=1)]
    rows += [_row(f"superseded by ({i})", m) for i, m in enumerate(found["superseded_by"], start=1)]
    rows += [_row("contradicted by", found["contradicted_by"])] if found["contradicted_by"] else []
    rows += [_row("contradicts", m) for m in found["contradicts"]]
    return rows


@handles_errors
def lineage_command(
    artifact_id: ArtifactArg,
    project: ProjectOpt,
    as_of: AsOfOpt = None,
    journal: ReadJournalOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The lineage of an artifact: what it revises (to the root) and what revises it, the supersession chain
    through it, what contradicts it and what it contradicts, each with its state. Cycles and links to
    artifacts the journal lacks (forgotten ones) are reported."""
    cutoff = parse_time(as_of, "--as-of")
    request = build_request(JournalReadRequest, read="lineage", project=project, artifact_id=artifact_id, as_of=cutoff)
    found = journal_read(
        request, journal=journal, nats=nats, agent=agent, home=home, as_json=as_json, artifact_field="ARTIFACT_ID"
    )
    if as_json:
        emit_json(found)
        return
    console.print(table(f"lineage of {found['artifact']['artifact_id']} in {project}", COLUMNS, lineage_rows(found)))
    for cycle in found["cycle"]:
        loop = " → ".join((*cycle["ids"], cycle["ids"][0]))
        console.print(shown(("cycle:", "yellow"), f" {cycle['link']} loops: {loop}"), soft_wrap=True)
    for link in found["missing"]:
        console.print(
            shown(
                ("missing:", "yellow"), f" {link['holder']} {link['link']} {link['missing']}, which the journal lacks"
            ),
            soft_wrap=True,
        )
