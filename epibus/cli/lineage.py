"""`epibus lineage`: the revisions, supersessions and contradictions around one artifact, read from the journal."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from bus.lineage import Lineage, Member
from epibus.cli import ids
from epibus.cli.common import HomeOpt, JournalOpt, JsonOpt, console, emit_json, handles_errors, table
from epibus.cli.display import shown
from epibus.cli.inputs import ProjectOpt
from epibus.cli.state import AsOfOpt, _read
from epibus.times import parse_time

ArtifactArg = Annotated[str, typer.Argument(help="The artifact whose lineage is shown (id or unique prefix).")]
COLUMNS = ["relation", "artifact", "kind", "trust/lifecycle", "author", "created", "content"]


def _row(relation: str, member: Member) -> list[Any]:
    content = "(forgotten) " + member.content if member.forgotten else member.content
    created = member.created_at.strftime("%Y-%m-%d %H:%M")
    return [relation, member.artifact_id, member.kind, member.state_label, member.author, created, content[:70]]


def lineage_rows(found: Lineage) -> list[list[Any]]:
    """One row per member, in reading order: the root ancestor down to the artifact, then what came of it."""
    ancestors = len(found.ancestors)
    rows = [_row(f"ancestor {ancestors - i}", m) for i, m in enumerate(reversed(found.ancestors))]
    rows.append(_row("this artifact", found.artifact))
    rows += [_row(f"revised by (depth {d.depth})", d.member) for d in found.descendants]
    rows += [_row(f"supersedes ({i})", m) for i, m in enumerate(found.supersedes, start=1)]
    rows += [_row(f"superseded by ({i})", m) for i, m in enumerate(found.superseded_by, start=1)]
    rows += [_row("contradicted by", found.contradicted_by)] if found.contradicted_by else []
    rows += [_row("contradicts", m) for m in found.contradicts]
    return rows


@handles_errors
def lineage_command(
    artifact_id: ArtifactArg,
    project: ProjectOpt,
    as_of: AsOfOpt = None,
    journal: JournalOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The lineage of an artifact: what it revises (to the root) and what revises it, the supersession chain
    through it, what contradicts it and what it contradicts, each with its state. Cycles and links to
    artifacts the journal lacks (forgotten ones) are reported."""
    from observers.reads import artifact_lineage  # SQLAlchemy: loaded only to read (see epibus.cli.state)

    cutoff = parse_time(as_of, "--as-of")
    artifact_id = ids.artifact_id(artifact_id, field="ARTIFACT_ID", project=project, journal=journal, home=home)
    found = _read(journal, home, lambda j: artifact_lineage(j, project, artifact_id, as_of=cutoff))
    if as_json:
        emit_json(found.as_dict())
        return
    console.print(table(f"lineage of {artifact_id} in {project}", COLUMNS, lineage_rows(found)))
    for cycle in found.cycle:
        loop = " → ".join((*cycle.ids, cycle.ids[0]))
        console.print(shown(("cycle:", "yellow"), f" {cycle.link} loops: {loop}"), soft_wrap=True)
    for link in found.missing:
        console.print(
            shown(("missing:", "yellow"), f" {link.holder} {link.link} {link.missing}, which the journal lacks"),
            soft_wrap=True,
        )
