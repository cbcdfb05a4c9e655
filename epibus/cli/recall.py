"""`epibus recall` and `epibus audit-recall` (every node's mirror by meaning, merged by event id) and `epibus
forget` (the privacy delete, proven by reading every store back and scanning every node's files)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import typer

from bus.client import connect
from bus.fleet import ask_forget_proof, ask_reindex, ask_verify
from bus.forget import ForgetProof
from bus.recall import RecallAnswer, ask_all, recall_request
from bus.requests import RecallRequest
from epibus.cli import ids, inputs
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JournalOpt,
    JsonOpt,
    NatsOpt,
    Target,
    console,
    emit_json,
    err_console,
    handles_errors,
    run,
    table,
)
from epibus.cli.display import plain, shown
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
            f"{h['similarity']:.3f}",
            h["kind"],
            h["artifact_id"],
            f"{h['state']['trust']}/{h['state']['lifecycle']}",
            h["provenance"]["actor"],
            h["content"][:70],
        ]
        for h in answer.hits
    ]
    console.print(
        table(
            f"{title}: {len(rows)} hit(s) from {', '.join(answer.nodes)}",
            ["score", "similarity", "kind", "artifact", "state", "actor", "content"],
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
) -> None:
    """The audit door by meaning: everything mirrored, whatever its state, with that state (for reviewers and
    admins; under a node's home the node's operator asks)."""
    request = recall_request(query, project, k=k, kinds=kind, include_resolved=True, as_of=None, audit=True)
    _show(run(_recall(request, timeout, Target(nats, home, agent))), "audit recall", as_json)


async def _recall(request: RecallRequest, timeout_s: float, target: Target) -> RecallAnswer:
    async with target.asking() as (nc, signer):
        return await ask_all(nc, request, signer=signer, timeout_s=timeout_s)


@handles_errors
def forget_command(
    artifact_id: Annotated[str, typer.Argument(help="The artifact whose content must go (id or unique prefix).")],
    project: ProjectOpt,
    reason: Annotated[str, typer.Option("--reason", help="Why (kept in the audit trail).")],
    timeout: Annotated[float, typer.Option("--timeout", min=1.0, help="Seconds to wait for every store.")] = 30.0,
    nats: NatsOpt = None,
    journal: JournalOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Privacy delete: erase the artifact's messages from the stream, redact its journal rows (an audit row
    each is kept) and delete its points from every mirror; then every node erases what is left in its files
    and scans every file it owns for the content. Exit code 1 unless no store holds the content and every
    store could be checked (a store a node cannot scan, such as a server it does not run, is never clean)."""
    artifact_id = ids.artifact_id(artifact_id, field="ARTIFACT_ID", project=project, journal=journal, home=home)
    proof = run(_forget(artifact_id, project, reason, timeout, nats, agent, home))
    if as_json:
        emit_json({"ok": proof.clean, **proof.as_dict()})
    else:
        title = f"forget {artifact_id}: every store read back, every file scanned"
        console.print(table(title, ["store", "found", "clean"], _proof_rows(proof)))
    if not proof.clean:
        raise typer.Exit(1)


def _proof_rows(proof: ForgetProof) -> list[list[str]]:
    """One row per store: what reading it back or scanning its files found."""
    erased = f"{len(proof.erased_seqs)} of {len(proof.report.messages)} messages erased"
    rows = [["stream", erased, _yes(proof.stream_clean)]]
    if not proof.provable:
        rows.append(["content", "too short to fingerprint: no scan can show it is gone", "NO"])
    for node, answer in proof.nodes.items():
        if "error" in answer:
            rows.append([f"node {node}", str(answer["error"]), "NO"])
            continue
        redacted = answer["journal_rows"] - answer["journal_content_left"]
        journal = f"rows redacted {redacted}/{answer['journal_rows']}, projection rows {answer['projection_rows']}"
        rows.append(
            [f"{node} journal", journal, _yes(not answer["journal_content_left"] and not answer["projection_rows"])]
        )
        mirror = f"points {answer['mirror_points']}, cached vectors {answer.get('cached_vectors', 0)}"
        rows.append([f"{node} mirror", mirror, _yes(not answer["mirror_points"] and not answer.get("cached_vectors"))])
        held = [*answer.get("files", []), *answer.get("unreadable", [])]
        scanned = f"{answer.get('scanned', 0)} files scanned, " + (
            "held by: " + ", ".join(held) if held else "none holds it"
        )
        rows.append([f"{node} files", scanned, _yes("files" in answer and not held)])
        rows += [
            [f"{node} {store}", f"unscrubbable: {why}", "NO"] for store, why in answer.get("unscrubbable", {}).items()
        ]
    return rows


def _yes(clean: bool) -> str:
    return "yes" if clean else "NO"


async def _forget(
    artifact_id: str,
    project: str,
    reason: str,
    timeout_s: float,
    nats: str | None,
    agent: str | None,
    home: Path | None,
) -> ForgetProof:
    # The agent publishes `forgotten`; the erase and the scrubbing proof are an admin's requests: the node's
    # operator signs them under a node's home, else the agent, which must hold the admin role.
    async with (
        Target(nats, home, agent).asking() as admin,
        connect(nats, agent=agent, home=home, outbox=False) as client,
    ):
        report = await client.forget(project, artifact_id, reason=reason, eraser=admin)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        proof = await ask_forget_proof(*admin, report)
        while not proof.complete and loop.time() < deadline:  # observers apply the forget asynchronously
            await asyncio.sleep(0.5)
            proof = await ask_forget_proof(*admin, report)
        return proof


@handles_errors
def verify_command(
    project: Annotated[str | None, typer.Option("--project", "-p", help="Only this project.")] = None,
    repair: Annotated[
        bool, typer.Option("--repair", help="Make the journal and mirror agree with the stream.")
    ] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=1.0)] = 120.0,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Reconcile the stream, every node's journal and every node's mirror by event id: missing, extra and
    stale-payload counts per store (--repair to fix them). Exit code 1 unless every store is clean. Every
    project and --repair are for admins (under a node's home the node's operator asks)."""

    async def ask() -> list[dict[str, Any]]:
        async with Target(nats, home, agent).asking() as (nc, signer):
            return await ask_verify(nc, signer, project, repair=repair, timeout_s=timeout)

    answers = run(ask())
    clean = all(bool(a.get("clean")) for a in answers)
    if as_json:
        emit_json({"ok": clean, "nodes": answers})
    else:
        rows = []
        for a in answers:
            if "error" in a:
                rows.append([a["node"], "-", "error", a["error"], "", ""])
                continue
            for store in ("journal", "mirror"):
                part = a.get(store)
                if isinstance(part, dict):
                    rows.append([a["node"], a["stream_events"], store, part["missing"], part["extra"], part["stale"]])
        console.print(
            table(
                "verify" + (" (after repair)" if repair else ""),
                ["node", "stream events", "store", "missing", "extra", "stale payload"],
                rows,
            )
        )
    if not clean:
        raise typer.Exit(1)


@handles_errors
def reindex_command(
    timeout: Annotated[float, typer.Option("--timeout", min=1.0)] = 1800.0,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Rebuild every node's mirror from the stream into a new collection and swap it in (after a model
    change, or to start clean); the old mirror keeps answering until the swap. For admins (under a node's
    home the node's operator asks)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn  # only this command's bar

    with Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        console=err_console,
        disable=as_json,
    ) as bar:
        tasks: dict[str, TaskID] = {}

        def advance(node: str, done: int, total: int) -> None:
            if node not in tasks:
                tasks[node] = bar.add_task(plain(f"reindexing on {node}"), total=total)
            bar.update(tasks[node], completed=done, total=total)

        async def ask() -> list[dict[str, Any]]:
            async with Target(nats, home, agent).asking() as (nc, signer):
                return await ask_reindex(nc, signer, advance, timeout_s=timeout)

        answers = run(ask())
    ok = all("error" not in a for a in answers)
    if as_json:
        emit_json({"ok": ok, "nodes": answers})
    else:
        console.print(
            table(
                "reindex",
                ["node", "points", "up to stream seq", "error"],
                [[a["node"], a.get("points"), a.get("last_seq"), a.get("error")] for a in answers],
            )
        )
    if not ok:
        raise typer.Exit(1)
