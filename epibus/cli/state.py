"""State commands: resolve, verify, contradict, rollback (writes, validated and compare-and-set). The journal
reads are in epibus/cli/reads.py."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from bus.client.client import connect
from bus.identity.signing import AgentKey
from bus.model.kinds import Evidence
from bus.model.state import TRUST_TRANSITIONS
from bus.model.vocab import ResolutionKind, Trust, describe
from bus.outbox.publish import Receipt
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

# The journal reads are loaded by the commands that read, not at the top: SQLAlchemy is a large part of every
# CLI start, `epibus --help` included.
if TYPE_CHECKING:
    pass

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
    where = {"agent": target["agent"], "home": target["home"], "key": target.get("key")}
    async with connect(target["nats"], **where, outbox=False) as client:
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
    signer: AgentKey | None = None,
) -> None:
    """Vouch for another agent's artifact (trust → verified; a verified one gains another record).
    The verifier is the signing agent (--agent), or `signer` (a person's key), of another owner than the
    author's."""
    artifact_id = ids.artifact_id(artifact_id, field="ARTIFACT_ID", project=project, journal=journal, home=home)
    pointers = [_evidence(v) for v in evidence or []]
    body = {"note": note, "evidence": [p.model_dump(mode="json") for p in pointers]}
    target = {"nats": nats, "agent": agent, "home": home, "key": signer}
    receipt = run(_transition("verified", body, project, artifact_id, target))
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
