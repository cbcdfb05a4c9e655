"""State commands: resolve, verify, contradict, rollback (writes, validated and compare-and-set), and the
journal reads artifacts, audit, briefing, vocab-report (every read takes --as-of)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from bus.client import connect
from bus.home import epibus_home, resolve_journal_url
from bus.kinds import Evidence
from bus.publish import Receipt
from bus.recall import RecallAnswer
from bus.state import TRUST_TRANSITIONS
from bus.vocab import ResolutionKind, Trust, describe
from epibus.cli import ids, inputs
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JournalOpt,
    JsonOpt,
    NatsOpt,
    console,
    emit_json,
    handles_errors,
    run,
    table,
)
from epibus.cli.display import shown
from epibus.cli.inputs import ArtifactKindsOpt, ProjectOpt
from epibus.times import parse_time

# The journal reads are loaded by the commands that read, not at the top: SQLAlchemy is a large part of every
# CLI start, `epibus --help` included.
if TYPE_CHECKING:
    from observers.journal import Journal
    from observers.reads import ArtifactView

T = TypeVar("T")
ArtifactArg = Annotated[str, typer.Argument(help="The artifact acted on: its id or a unique prefix (4+ hex digits).")]
AsOfOpt = Annotated[
    str | None, typer.Option("--as-of", help="Knowledge as it stood then: ISO time or age (30m, 2h, 7d).")
]
KindFilter = ArtifactKindsOpt
LimitOpt = Annotated[int, typer.Option("--limit", callback=inputs.at_least_one)]


def trust_help() -> str:
    """Every trust value with its meaning and the legal moves, for --help."""
    moves = "; ".join(
        f"{t.value} -> {' | '.join(sorted(m.value for m in TRUST_TRANSITIONS[t])) or '(terminal)'}" for t in Trust
    )
    return f"Trust values: {describe(Trust)}. Legal moves: {moves}."


async def _transition(
    kind: str, body: dict[str, Any], project: str, artifact_id: str, target: dict[str, Any]
) -> Receipt:
    async with connect(target["nats"], agent=target["agent"], home=target["home"], outbox=False) as client:
        return await client.transition(kind, body, project=project, artifact_id=artifact_id)


def _print_receipt(title: str, receipt: Receipt, artifact_id: str, as_json: bool) -> None:
    if as_json:
        emit_json({"ok": True, "artifact_id": artifact_id, **receipt.as_dict()})
        return
    rows: list[list[Any]] = [
        ["artifact_id", artifact_id],
        ["event_id", receipt.event_id],
        ["stream_seq", receipt.stream_seq],
    ]
    console.print(table(title, ["field", "value"], rows))


@handles_errors
def resolve(
    artifact_id: ArtifactArg,
    project: ProjectOpt,
    resolution: Annotated[ResolutionKind, typer.Option("--as", help=describe(ResolutionKind))],
    superseded_by: Annotated[
        str | None, typer.Option("--superseded-by", help="The replacing artifact (id or unique prefix).")
    ] = None,
    note: Annotated[str | None, typer.Option("--note")] = None,
    nats: NatsOpt = None,
    journal: JournalOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Mark an artifact no longer current, saying why (lifecycle). Trust is unchanged."""
    artifact_id = ids.artifact_id(artifact_id, field="ARTIFACT_ID", project=project, journal=journal, home=home)
    superseded_by = ids.optional_artifact_id(
        superseded_by, field="--superseded-by", project=project, journal=journal, home=home
    )
    body = {"resolution": resolution.value, "superseded_by": superseded_by, "note": note}
    receipt = run(_transition("resolved", body, project, artifact_id, {"nats": nats, "agent": agent, "home": home}))
    _print_receipt(f"resolved ({resolution.value})", receipt, artifact_id, as_json)


@handles_errors
def verify(
    artifact_id: ArtifactArg,
    project: ProjectOpt,
    note: Annotated[str | None, typer.Option("--note")] = None,
    evidence: Annotated[list[str] | None, typer.Option("--evidence", help="KIND:REF, repeatable")] = None,
    nats: NatsOpt = None,
    journal: JournalOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Vouch for another agent's artifact (trust → verified; a verified one gains another record).
    The verifier is the signing agent (--agent), an agent or reviewer of another owner than the author's."""
    artifact_id = ids.artifact_id(artifact_id, field="ARTIFACT_ID", project=project, journal=journal, home=home)
    pointers = [_evidence(v) for v in evidence or []]
    body = {"note": note, "evidence": [p.model_dump(mode="json") for p in pointers]}
    receipt = run(_transition("verified", body, project, artifact_id, {"nats": nats, "agent": agent, "home": home}))
    _print_receipt("verified", receipt, artifact_id, as_json)


@handles_errors
def contradict(
    artifact_id: ArtifactArg,
    project: ProjectOpt,
    by: Annotated[
        str, typer.Option("--by", help="The existing artifact that contradicts it (not itself; id or unique prefix).")
    ],
    reason: Annotated[str, typer.Option("--reason")],
    nats: NatsOpt = None,
    journal: JournalOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Refute an artifact with another one (trust → contradicted; only a rollback may follow)."""
    artifact_id = ids.artifact_id(artifact_id, field="ARTIFACT_ID", project=project, journal=journal, home=home)
    by = ids.artifact_id(by, field="--by", project=project, journal=journal, home=home)
    body = {"contradicted_by": by, "reason": reason}
    receipt = run(_transition("contradicted", body, project, artifact_id, {"nats": nats, "agent": agent, "home": home}))
    _print_receipt("contradicted", receipt, artifact_id, as_json)


def _evidence(value: str) -> Evidence:
    from epibus.cli.publish import _parse_evidence

    return _parse_evidence([value])[0]


@handles_errors
def rollback(
    artifact_id: ArtifactArg,
    project: ProjectOpt,
    reason: Annotated[str, typer.Option("--reason")] = "rolled back",
    apply: Annotated[bool, typer.Option("--apply", help="Write the rollback (default: show the plan only).")] = False,
    cascade: Annotated[bool, typer.Option("--cascade", help="Also roll back tainted descendants.")] = False,
    nats: NatsOpt = None,
    journal: JournalOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Walk `revises` back to the nearest verified ancestor, roll back the intermediates, report descendants
    built on them as tainted. A dry run unless --apply; cycles and broken chains are errors."""
    artifact_id = ids.artifact_id(artifact_id, field="ARTIFACT_ID", project=project, journal=journal, home=home)
    plan, receipts = run(_rollback(project, artifact_id, reason, apply, cascade, nats, agent, home))
    if as_json:
        emit_json({"ok": True, "applied": apply, "plan": plan.as_dict(), "receipts": [r.as_dict() for r in receipts]})
        return
    rows = [[a, "roll back" if a in plan.to_roll_back else "", "intermediate"] for a in plan.intermediates]
    rows += [
        [a, "roll back" if a in plan.to_roll_back else "tainted (use --cascade)", "descendant"] for a in plan.tainted
    ]
    title = f"rollback of {artifact_id} to verified {plan.verified_ancestor}" + ("" if apply else " (dry run)")
    console.print(table(title, ["artifact", "action", "role"], rows))
    if apply:
        console.print(shown(f"rolled back {len(receipts)} artifact(s)"))


async def _rollback(
    project: str,
    artifact_id: str,
    reason: str,
    apply: bool,
    cascade: bool,
    nats: str | None,
    agent: str | None,
    home: Path | None,
) -> tuple[Any, list[Receipt]]:
    async with connect(nats, agent=agent, home=home, outbox=False) as client:
        if not apply:
            return await client.plan_rollback(project, artifact_id, cascade=cascade), []
        return await client.rollback(project, artifact_id, reason=reason, cascade=cascade)


# -- reads ------------------------------------------------------------------------------------------------


def _read(journal: str | None, home: Path | None, read: Callable[[Journal], T]) -> T:
    """Open the journal, read, close: every read command's frame."""
    from observers.journal import Journal

    store = Journal(resolve_journal_url(journal, epibus_home(home)))
    try:
        store.migrate()
        return read(store)
    finally:
        store.close()


def _artifact_rows(views: list[ArtifactView]) -> list[list[Any]]:
    return [
        [
            v.state.artifact_id,
            v.state.kind,
            v.state.state_label,
            v.state.author,
            f"{v.relevance:.3f}",
            ",".join(sorted(v.state.flags)),
            v.state.content[:70],
        ]
        for v in views
    ]


COLUMNS = ["artifact", "kind", "trust/lifecycle", "author", "relevance", "flags", "content"]


@handles_errors
def artifacts_command(
    project: ProjectOpt,
    kind: KindFilter = None,
    include_resolved: Annotated[bool, typer.Option("--include-resolved", help="Also stale/superseded ones.")] = False,
    as_of: AsOfOpt = None,
    limit: LimitOpt = 50,
    journal: JournalOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The safe read: never contradicted, rolled back, retracted or mistyped artifacts. Ranked by relevance."""
    from observers.reads import artifacts

    cutoff = parse_time(as_of, "--as-of")
    kinds = set(kind) if kind else None
    views = _read(
        journal,
        home,
        lambda j: artifacts(j, project, kinds=kinds, include_resolved=include_resolved, as_of=cutoff, limit=limit),
    )
    if as_json:
        emit_json([v.as_dict() for v in views])
        return
    console.print(table(f"{len(views)} artifact(s) in {project}", COLUMNS, _artifact_rows(views)))


@handles_errors
def audit(
    project: ProjectOpt,
    kind: KindFilter = None,
    as_of: AsOfOpt = None,
    limit: LimitOpt = 500,
    journal: JournalOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The audit read: every artifact whatever its state, with its verification log."""
    from observers.reads import audit_artifacts

    cutoff = parse_time(as_of, "--as-of")
    kinds = set(kind) if kind else None
    views = _read(journal, home, lambda j: audit_artifacts(j, project, kinds=kinds, as_of=cutoff, limit=limit))
    if as_json:
        emit_json([v.as_dict() for v in views])
        return
    console.print(table(f"audit of {project}: {len(views)} artifact(s)", COLUMNS, _artifact_rows(views)))


@handles_errors
def briefing_command(
    project: ProjectOpt,
    goal: Annotated[str | None, typer.Option("--goal", help="Goal id: adds what was recorded under it.")] = None,
    goal_text: Annotated[
        str | None, typer.Option("--goal-text", help="The goal in words: adds what the mirrors recall for it.")
    ] = None,
    as_of: AsOfOpt = None,
    limit: LimitOpt = 10,
    journal: JournalOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """What a starting agent needs: top artifacts, open unknowns, recent mistakes and dead ends, recently
    superseded items and confidence flags; with --goal-text, what the mirrors recall for the goal."""
    from observers.reads import briefing

    cutoff = parse_time(as_of, "--as-of")
    brief = _read(journal, home, lambda j: briefing(j, project, goal, as_of=cutoff, limit=limit))
    semantic = run(_recall_goal(goal_text, project, limit, cutoff, nats, agent, home)) if goal_text else None
    if as_json:
        emit_json(brief.as_dict() | {"semantic": semantic.as_dict() if semantic else None})
        return
    for title, views in (
        ("top artifacts", brief.top),
        (f"recorded under goal {goal}", brief.for_goal if goal else None),
        ("open unknowns", brief.open_unknowns),
        ("recent mistakes and dead ends", brief.recent_mistakes_and_dead_ends),
        ("recently superseded", brief.recently_superseded),
        ("unearned confidence (>= 0.8 on intuition)", brief.unearned_confidence),
        ("repeats a retracted claim", brief.previously_retracted),
    ):
        if views is not None:
            console.print(table(f"{title} ({len(views)})", COLUMNS, _artifact_rows(views)))
    if semantic is not None:
        rows = [[f"{h['score']:.3f}", h["kind"], h["artifact_id"], h["content"][:70]] for h in semantic.hits]
        console.print(table(f"recalled for the goal ({len(rows)})", ["score", "kind", "artifact", "content"], rows))


async def _recall_goal(
    goal_text: str, project: str, limit: int, as_of: Any, nats: str | None, agent: str | None, home: Path | None
) -> RecallAnswer:
    async with connect(nats, agent=agent, home=home, outbox=False) as client:
        return await client.recall(goal_text, project, k=limit, as_of=as_of)


@handles_errors
def vocab_report_command(
    project: ProjectOpt,
    as_of: AsOfOpt = None,
    journal: JournalOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Counts of resolutions per kind, trust states and sources: are errors being recorded at all?"""
    from observers.reads import vocab_report

    cutoff = parse_time(as_of, "--as-of")
    report = _read(journal, home, lambda j: vocab_report(j, project, as_of=cutoff))
    if as_json:
        emit_json(report.as_dict())
        return
    rows = [[f"resolution {k}", v] for k, v in report.resolutions.items()]
    rows += [[f"trust {k}", v] for k, v in report.trust.items()]
    rows += [[f"source {k}", v] for k, v in report.sources.items()]
    rows.append(["unearned confidence", report.unearned_confidence])
    console.print(table(f"vocabulary report for {project} ({report.artifacts} artifacts)", ["what", "count"], rows))
    for warning in report.warnings:
        console.print(shown(("warning:", "yellow"), f" {warning}"), soft_wrap=True)
