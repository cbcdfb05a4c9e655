"""The journal reads: artifacts, audit, briefing, vocab-report (lineage and events beside their own commands),
every one of them taking --as-of. A read goes through a node as --agent: a signed request answered under the
membership rules of recall, so an agent reads its projects and is refused the others, naming the rule.
`--journal` reads the file directly instead: the node's operator's door, no identity, said so on stderr."""

from __future__ import annotations

import difflib
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from bus.client.client import connect
from bus.client.fleet import ask_journal
from bus.client.recall import RecallAnswer
from bus.errors import AmbiguousId
from bus.host.home import epibus_home, resolve_journal_url
from bus.model.requests import JournalReadRequest, build_request
from bus.model.review import AWAITING_REVIEW, vouched_cells
from epibus.cli import inputs
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JsonOpt,
    NatsOpt,
    WideOpt,
    console,
    emit_json,
    err_console,
    handles_errors,
    run,
    table,
)
from epibus.cli.display import shown
from epibus.cli.inputs import ArtifactKindsOpt, ProjectOpt
from epibus.times import parse_time

AsOfOpt = Annotated[
    str | None, typer.Option("--as-of", help="Knowledge as it stood then: ISO time or age (30m, 2h, 7d).")
]
KindFilter = ArtifactKindsOpt
LimitOpt = Annotated[int, typer.Option("--limit", callback=inputs.at_least_one)]
ReadJournalOpt = Annotated[
    str | None,
    typer.Option(
        "--journal",
        help="Read this journal directly, as the node's operator: a SQLAlchemy URL, or `node` for the local "
        "node's. Without it the read goes through a node, signed as --agent.",
    ),
]
OPERATOR_NOTE = "read the journal directly, as the node's operator (no agent, no membership rules): "


def journal_read(
    request: JournalReadRequest,
    *,
    journal: str | None,
    nats: str | None,
    agent: str | None,
    home: Path | None,
    as_json: bool,
    artifact_field: str = "--artifact-id",
) -> Any:
    """The read's answer (plain JSON values, as `--json` prints it): through a node as `agent`, or the file
    directly when `journal` is given. Raises Forbidden (the rule that refused the agent), Unavailable, and
    NotFound or AmbiguousId for an artifact prefix, named as the option the user typed (`artifact_field`)."""
    try:
        answer = (
            run(_ask(request, nats, agent, home)) if journal is None else _read_file(request, journal, home, as_json)
        )
    except AmbiguousId as e:
        raise AmbiguousId(artifact_field, e.prefix, e.what, e.where, e.matches, e.more) from None
    if request.project is not None and not as_json and _empty(answer):
        projects = JournalReadRequest(read="projects")
        known = run(_ask(projects, nats, agent, home)) if journal is None else _read_file(projects, journal, home, True)
        if (note := unknown_project_note(request.project, known)) is not None:
            err_console.print(shown(("note: ", "yellow"), note), soft_wrap=True)
    return answer


def _empty(answer: Any) -> bool:
    if isinstance(answer, dict):  # a briefing: a list per section
        return all(not v for v in answer.values() if isinstance(v, list))
    return isinstance(answer, list) and not answer


def unknown_project_note(project: str, known: list[str]) -> str | None:
    """What to say when a read of `project` came back empty and no event of it is in the journal: the projects
    that are, the nearest first. None when the project has events (empty because nothing matched)."""
    if project in known:
        return None
    if not known:
        return f"project {project!r} has no events yet, and neither has any other project you can read"
    near = difflib.get_close_matches(project, known, n=3, cutoff=0.6)
    listed = ", ".join(known[:10]) + (f" and {len(known) - 10} more" if len(known) > 10 else "")
    guess = f"; did you mean {' or '.join(repr(p) for p in near)}?" if near else ""
    return f"project {project!r} has no events yet{guess} (projects with events: {listed})"


def _read_file(request: JournalReadRequest, journal: str, home: Path | None, as_json: bool) -> Any:
    from observers.journal import Journal  # SQLAlchemy: loaded only to read
    from observers.read_service import read_journal

    url = resolve_journal_url(None if journal == "node" else journal, epibus_home(home))
    store = Journal(url)
    try:
        store.migrate()
        if not as_json:
            err_console.print(shown(OPERATOR_NOTE + store.safe_url))
        return read_journal(store, request)
    finally:
        store.close()


async def _ask(request: JournalReadRequest, nats: str | None, agent: str | None, home: Path | None) -> Any:
    async with connect(nats, agent=agent, home=home, outbox=False) as client:
        return await ask_journal(client.connection.require_nc(), client.key, request)


def artifact_rows(views: list[dict[str, Any]]) -> list[list[Any]]:
    return [
        [
            v["artifact_id"],
            v["kind"],
            state_label(v),
            v["author"],
            *vouched_cells(v["vouched"], v["review"]),
            f"{v['relevance']:.3f}",
            ",".join(sorted(v["flags"])),
            v["content"],
        ]
        for v in views
    ]


def state_label(view: dict[str, Any]) -> str:
    """trust/lifecycle as bus.model.state.ArtifactState.state_label shows it, from an answer's fields."""
    life = f"resolved({view['resolution']})" if view["lifecycle"] == "resolved" else "active"
    return f"{view['trust']}/{life}"


# agents and people: who verified it (the last person named, or "awaiting" a person's review)
COLUMNS = ["artifact", "kind", "trust/lifecycle", "author", "agents", "people", "relevance", "flags", "content"]


def _cutoff(as_of: str | None) -> datetime | None:
    return parse_time(as_of, "--as-of")


@handles_errors
def artifacts_command(
    project: ProjectOpt,
    kind: KindFilter = None,
    include_resolved: Annotated[bool, typer.Option("--include-resolved", help="Also stale/superseded ones.")] = False,
    as_of: AsOfOpt = None,
    limit: LimitOpt = 50,
    journal: ReadJournalOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """The safe read: never contradicted, rolled back, retracted or mistyped artifacts. Ranked by relevance."""
    request = build_request(
        JournalReadRequest,
        read="artifacts",
        project=project,
        kinds=list(kind) if kind else None,
        include_resolved=include_resolved,
        as_of=_cutoff(as_of),
        limit=limit,
    )
    views = journal_read(request, journal=journal, nats=nats, agent=agent, home=home, as_json=as_json)
    if as_json:
        emit_json(views)
        return
    console.print(table(f"{len(views)} artifact(s) in {project}", COLUMNS, artifact_rows(views)))


@handles_errors
def audit(
    project: ProjectOpt,
    kind: KindFilter = None,
    as_of: AsOfOpt = None,
    limit: LimitOpt = 500,
    journal: ReadJournalOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    reviews: Annotated[
        bool, typer.Option("--reviews", help="Only who reviewed what, and the claims awaiting a person's review.")
    ] = False,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """The audit read: every artifact whatever its state, with its verification log (reviewers and admins).
    With --reviews: the claims the project's review policy holds for a person, and what people reviewed."""
    request = build_request(
        JournalReadRequest,
        read="audit",
        project=project,
        kinds=list(kind) if kind else None,
        as_of=_cutoff(as_of),
        limit=limit,
    )
    views = journal_read(request, journal=journal, nats=nats, agent=agent, home=home, as_json=as_json)
    if reviews:
        _show_reviews(project, views, as_json)
        return
    if as_json:
        emit_json(views)
        return
    console.print(table(f"audit of {project}: {len(views)} artifact(s)", COLUMNS, artifact_rows(views)))


def _show_reviews(project: str, views: list[dict[str, Any]], as_json: bool) -> None:
    """Claims awaiting a person's review (under the project's policy), and every person's review."""
    awaiting = [v for v in views if v["review"] == AWAITING_REVIEW]
    reviews = [
        {"artifact_id": v["artifact_id"], "person": log["verifier"], "at": log["at"], "note": log["note"]}
        for v in views
        for log in v["verifications"]
        if log["human_review"]
    ]
    if as_json:
        emit_json({"project": project, "awaiting": awaiting, "reviews": sorted(reviews, key=lambda r: r["at"])})
        return
    console.print(table(f"awaiting a person's review in {project} ({len(awaiting)})", COLUMNS, artifact_rows(awaiting)))
    rows = [[r["artifact_id"], r["person"], r["at"], r["note"] or ""] for r in sorted(reviews, key=lambda r: r["at"])]
    console.print(table(f"reviewed by people in {project} ({len(rows)})", ["artifact", "person", "at", "note"], rows))


BRIEFING_SECTIONS = (
    ("top", "top artifacts"),
    ("for_goal", "recorded under goal {goal}"),
    ("open_unknowns", "open unknowns"),
    ("recent_mistakes_and_dead_ends", "recent mistakes and dead ends"),
    ("recently_superseded", "recently superseded"),
    ("unearned_confidence", "unearned confidence (>= 0.8 on intuition)"),
    ("previously_retracted", "repeats a retracted claim"),
)


@handles_errors
def briefing_command(
    project: ProjectOpt,
    goal: Annotated[str | None, typer.Option("--goal", help="Goal id: adds what was recorded under it.")] = None,
    goal_text: Annotated[
        str | None, typer.Option("--goal-text", help="The goal in words: adds what the mirrors recall for it.")
    ] = None,
    as_of: AsOfOpt = None,
    limit: LimitOpt = 10,
    journal: ReadJournalOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """What a starting agent needs: top artifacts, open unknowns, recent mistakes and dead ends, recently
    superseded items and confidence flags; with --goal-text, what the mirrors recall for the goal."""
    cutoff = _cutoff(as_of)
    request = build_request(JournalReadRequest, read="briefing", project=project, goal=goal, as_of=cutoff, limit=limit)
    brief = journal_read(request, journal=journal, nats=nats, agent=agent, home=home, as_json=as_json)
    semantic = run(_recall_goal(goal_text, project, limit, cutoff, nats, agent, home)) if goal_text else None
    if as_json:
        emit_json(brief | {"semantic": semantic.as_dict() if semantic else None})
        return
    empty: list[str] = []
    for section, title in BRIEFING_SECTIONS:
        if section == "for_goal" and not goal:
            continue
        views = brief[section]
        if not views:
            empty.append(title.format(goal=goal))
            continue
        console.print(table(f"{title.format(goal=goal)} ({len(views)})", COLUMNS, artifact_rows(views)))
    if empty:
        console.print(shown(("nothing yet: ", "dim"), "; ".join(empty)), soft_wrap=True)
    if semantic is not None:
        rows = [[f"{h['score']:.3f}", h["kind"], h["artifact_id"], h["content"]] for h in semantic.hits]
        console.print(table(f"recalled for the goal ({len(rows)})", ["score", "kind", "artifact", "content"], rows))


async def _recall_goal(
    goal_text: str,
    project: str,
    limit: int,
    as_of: datetime | None,
    nats: str | None,
    agent: str | None,
    home: Path | None,
) -> RecallAnswer:
    async with connect(nats, agent=agent, home=home, outbox=False) as client:
        return await client.recall(goal_text, project, k=limit, as_of=as_of)


@handles_errors
def vocab_report_command(
    project: ProjectOpt,
    as_of: AsOfOpt = None,
    journal: ReadJournalOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Counts of resolutions per kind, trust states and sources: are errors being recorded at all?"""
    request = build_request(JournalReadRequest, read="vocab_report", project=project, as_of=_cutoff(as_of))
    report = journal_read(request, journal=journal, nats=nats, agent=agent, home=home, as_json=as_json)
    if as_json:
        emit_json(report)
        return
    rows = [[f"resolution {k}", v] for k, v in report["resolutions"].items()]
    rows += [[f"trust {k}", v] for k, v in report["trust"].items()]
    rows += [[f"source {k}", v] for k, v in report["sources"].items()]
    rows.append(["unearned confidence", report["unearned_confidence"]])
    title = f"vocabulary report for {project} ({report['artifacts']} artifacts)"
    console.print(table(title, ["what", "count"], rows))
    for warning in report["warnings"]:
        console.print(shown(("warning:", "yellow"), f" {warning}"), soft_wrap=True)
