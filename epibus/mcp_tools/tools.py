"""The epibus MCP tools: what each is called, what it says about itself, what it accepts and what it does. The
knowledge tools are here; the mesh's are in mesh_tools. Every tool acts as the session's agent through the same
client calls the CLI makes, so the same rules (validation, authority, compare-and-set) apply on every path."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import mcp_types as types

from bus.model.kinds import require_kind
from bus.model.state import TRUST_TRANSITIONS
from bus.model.vocab import ReceiptLevel, Trust, describe
from epibus.mcp_tools import inputs as i
from epibus.mcp_tools.schema import ToolInput, tool_schema
from epibus.mcp_tools.session import AgentSession
from epibus.times import parse_time
from observers import reads
from observers.journal import EventQuery, Journal

Result = dict[str, Any]
Handler = Callable[[AgentSession, Any], Awaitable[Result]]


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    input: type[ToolInput]
    handler: Handler
    read_only: bool = False
    # Retracts, refutes or ends something (a client may ask its user first); publishing is only additive.
    destructive: bool = False

    def tool(self) -> types.Tool:
        return types.Tool(
            name=self.name,
            description=self.description,
            input_schema=tool_schema(self.input),
            annotations=types.ToolAnnotations(
                read_only_hint=self.read_only, destructive_hint=self.destructive, open_world_hint=False
            ),
        )


def _when(value: str | None, argument: str) -> datetime | None:
    return parse_time(value, argument)


def _kinds(names: list[str] | None) -> set[str] | None:
    """The kinds asked for, each one registered (a read for a kind that cannot exist is an error, not nothing)."""
    return {require_kind(name).name for name in names} if names else None


# -- publishing ------------------------------------------------------------------------------------------


def publish_tool(kind: str) -> ToolSpec:
    body = require_kind(kind).body
    model = i.publish_input(kind)
    fields = set(body.model_fields)

    async def handler(session: AgentSession, args: ToolInput) -> Result:
        assert isinstance(args, i.PublishCommon)
        client = await session.client()
        content = args.model_dump(mode="json", include=fields, exclude_unset=True)
        event = client.event(kind, content, project=args.project, source=args.source, goal_id=args.goal_id)
        receipt = await client.publish(event, wait_for=ReceiptLevel(args.wait), strict=args.strict)
        return {"ok": True, "artifact_id": event.artifact_id, **receipt.as_dict()}

    summary = (body.__doc__ or kind).strip()
    return ToolSpec(
        f"publish_{kind}",
        f"Publish a new `{kind}` claim, signed by this agent. {summary} Returns its artifact_id and receipt.",
        model,
        handler,
    )


# -- state changes ---------------------------------------------------------------------------------------


async def _transition(session: AgentSession, kind: str, args: i.ArtifactInput, body: Result) -> Result:
    client = await session.client()
    receipt = await client.transition(kind, body, project=args.project, artifact_id=args.artifact_id)
    return {"ok": True, "artifact_id": args.artifact_id, **receipt.as_dict()}


async def verify(session: AgentSession, args: i.VerifyInput) -> Result:
    # An agent's verification: a person's review is made only with a person's key, which no MCP server holds.
    evidence = [e.model_dump(mode="json") for e in args.evidence]
    return await _transition(session, "verified", args, {"note": args.note, "evidence": evidence})


async def contradict(session: AgentSession, args: i.ContradictInput) -> Result:
    body = {"contradicted_by": args.contradicted_by, "reason": args.reason}
    return await _transition(session, "contradicted", args, body)


async def resolve(session: AgentSession, args: i.ResolveInput) -> Result:
    body = {"resolution": args.resolution.value, "superseded_by": args.superseded_by, "note": args.note}
    return await _transition(session, "resolved", args, body)


async def rollback(session: AgentSession, args: i.RollbackInput) -> Result:
    client = await session.client()
    if not args.apply:
        plan = await client.plan_rollback(args.project, args.artifact_id, cascade=args.cascade)
        return {"ok": True, "applied": False, "plan": plan.as_dict(), "receipts": []}
    plan, receipts = await client.rollback(args.project, args.artifact_id, reason=args.reason, cascade=args.cascade)
    return {"ok": True, "applied": True, "plan": plan.as_dict(), "receipts": [r.as_dict() for r in receipts]}


# -- reading ---------------------------------------------------------------------------------------------


def _listing(name: str, project: str, items: list[Any], limit: int) -> Result:
    """At most `limit` items (they were read with one more), and whether more exist: never a silent cut."""
    return {"project": project, name: items[:limit], "truncated": len(items) > limit}


async def recall(session: AgentSession, args: i.SafeRecallInput) -> Result:
    await session.require_member(args.project)
    answer = await (await session.client()).recall(
        args.query,
        args.project,
        k=args.k,
        kinds=sorted(found) if (found := _kinds(args.kinds)) else None,
        include_resolved=args.include_resolved,
        as_of=_when(args.as_of, "as_of"),
    )
    return answer.as_dict()


async def audit_recall(session: AgentSession, args: i.RecallInput) -> Result:
    await session.require_auditor(args.project, "audit_recall")
    client = await session.client()
    kinds = _kinds(args.kinds)
    answer = await client.audit_recall(args.query, args.project, k=args.k, kinds=sorted(kinds) if kinds else None)
    return answer.as_dict()


async def artifacts(session: AgentSession, args: i.ArtifactsInput) -> Result:
    await session.require_member(args.project)
    as_of, kinds = _when(args.as_of, "as_of"), _kinds(args.kinds)

    def read(journal: Journal) -> list[reads.ArtifactView]:
        return reads.artifacts(
            journal,
            args.project,
            kinds=kinds,
            include_resolved=args.include_resolved,
            as_of=as_of,
            limit=args.limit + 1,
        )

    views = await session.read_journal(read)
    return _listing("artifacts", args.project, [v.as_dict() for v in views], args.limit)


async def audit(session: AgentSession, args: i.AuditInput) -> Result:
    await session.require_auditor(args.project, "audit")
    as_of, kinds = _when(args.as_of, "as_of"), _kinds(args.kinds)

    def read(journal: Journal) -> list[reads.ArtifactView]:
        return reads.audit_artifacts(journal, args.project, kinds=kinds, as_of=as_of, limit=args.limit + 1)

    views = await session.read_journal(read)
    return _listing("artifacts", args.project, [v.as_dict() for v in views], args.limit)


async def briefing(session: AgentSession, args: i.BriefingInput) -> Result:
    await session.require_member(args.project)
    as_of = _when(args.as_of, "as_of")
    brief = await session.read_journal(
        lambda journal: reads.briefing(journal, args.project, args.goal_id, as_of=as_of, limit=args.limit)
    )
    semantic = None
    if args.goal_text is not None:
        client = await session.client()
        semantic = await client.recall(args.goal_text, args.project, k=args.limit, as_of=as_of)
    return brief.as_dict() | {"semantic": semantic.as_dict() if semantic else None}


async def lineage(session: AgentSession, args: i.LineageInput) -> Result:
    await session.require_member(args.project)
    as_of = _when(args.as_of, "as_of")
    found = await session.read_journal(
        lambda journal: reads.artifact_lineage(journal, args.project, args.artifact_id, as_of=as_of)
    )
    return found.as_dict()


async def events(session: AgentSession, args: i.EventsInput) -> Result:
    await session.require_member(args.project)
    query = EventQuery(
        project=args.project,
        kind=require_kind(args.kind).name if args.kind else None,
        actor=args.actor,
        artifact_id=args.artifact_id,
        since=_when(args.since, "since"),
        until=_when(args.until, "until"),
        limit=args.limit + 1,
        newest_first=not args.oldest_first,
    )
    rows = await session.read_journal(lambda journal: journal.query(query))
    return _listing("events", args.project, [row.as_dict() for row in rows], args.limit)


async def vocab_report(session: AgentSession, args: i.VocabReportInput) -> Result:
    await session.require_member(args.project)
    as_of = _when(args.as_of, "as_of")
    report = await session.read_journal(lambda journal: reads.vocab_report(journal, args.project, as_of=as_of))
    return report.as_dict()


async def whoami(session: AgentSession, args: i.WhoamiInput) -> Result:
    enrolment = await session.enrolment()
    return {
        "agent": session.agent,
        "public_key": session.key.public_key,
        "authenticated": enrolment is not None,
        "enrolment": enrolment.model_dump(mode="json") if enrolment is not None else None,
    }


TRUST_MOVES = "; ".join(
    f"{t.value} -> {' | '.join(sorted(m.value for m in TRUST_TRANSITIONS[t])) or '(terminal)'}" for t in Trust
)


def knowledge_tools() -> list[ToolSpec]:
    publishing = [publish_tool(kind) for kind in i.claim_kinds()]
    return [
        *publishing,
        ToolSpec(
            "verify",
            "Vouch for another agent's claim (trust -> verified; a verified claim gains another record). The "
            "verifier is this agent, whose signature is checked; an author never verifies its own claim. A "
            "person's review is made by the person at the CLI, never here. "
            f"Trust: {describe(Trust)}. Moves: {TRUST_MOVES}.",
            i.VerifyInput,
            verify,
        ),
        ToolSpec(
            "contradict",
            "Refute a claim with another existing artifact (trust -> contradicted; only a rollback may follow).",
            i.ContradictInput,
            contradict,
            destructive=True,
        ),
        ToolSpec(
            "resolve",
            "Mark a claim no longer current, saying why (lifecycle; trust unchanged). Only its author's identities "
            "or an admin.",
            i.ResolveInput,
            resolve,
            destructive=True,
        ),
        ToolSpec(
            "rollback",
            "Plan (default) or apply a rollback: walk `revises` back to the nearest verified ancestor, roll back "
            "the intermediates, report descendants built on them as tainted. Applying needs the author or an admin.",
            i.RollbackInput,
            rollback,
            destructive=True,
        ),
        ToolSpec(
            "recall",
            "Recall claims by meaning across every node's mirror: the safe door (never contradicted, rolled back, "
            "retracted or mistyped). Says which nodes answered.",
            i.SafeRecallInput,
            recall,
            read_only=True,
        ),
        ToolSpec(
            "audit_recall",
            "Recall by meaning through the audit door: everything, with its state (reviewers and admins).",
            i.RecallInput,
            audit_recall,
            read_only=True,
        ),
        ToolSpec(
            "artifacts",
            "The project's trusted claims ranked by relevance (the safe door), from the journal.",
            i.ArtifactsInput,
            artifacts,
            read_only=True,
        ),
        ToolSpec(
            "audit",
            "Every artifact whatever its state, with its verification log (reviewers and admins).",
            i.AuditInput,
            audit,
            read_only=True,
        ),
        ToolSpec(
            "briefing",
            "What a starting agent needs: top claims, open unknowns, recent mistakes and dead ends, recently "
            "superseded items, confidence flags; with goal_text, what the mirrors recall for the goal.",
            i.BriefingInput,
            briefing,
            read_only=True,
        ),
        ToolSpec(
            "lineage",
            "An artifact's lineage: what it revises (back to the root) and what revises it, the supersession chain "
            "both ways, what contradicts it and what it contradicts, each with its trust and lifecycle.",
            i.LineageInput,
            lineage,
            read_only=True,
        ),
        ToolSpec(
            "events",
            "The journal's events of a project, newest first, filtered by kind, actor, artifact and time.",
            i.EventsInput,
            events,
            read_only=True,
        ),
        ToolSpec(
            "vocab_report",
            "Counts of resolutions by kind, trust states and sources, with warnings: are errors being recorded?",
            i.VocabReportInput,
            vocab_report,
            read_only=True,
        ),
        ToolSpec(
            "whoami",
            "This server's agent: its id, public key and, on a node that authenticates, its roles and projects.",
            i.WhoamiInput,
            whoami,
            read_only=True,
        ),
    ]
