"""`epibus forget`: the privacy delete, proven by reading every store back and scanning every node's files."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from bus.client.client import connect
from bus.client.fleet import ask_forget_proof
from bus.model.forget import ForgetProof
from epibus.cli import ids
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JournalOpt,
    JsonOpt,
    NatsOpt,
    Target,
    console,
    emit_json,
    handles_errors,
    run,
    table,
)
from epibus.cli.recall import ProjectOpt


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
        vectors = answer.get("cached_vectors", 0), answer.get("shared_vectors", 0)
        mirror = f"points {answer['mirror_points']}, cached vectors {vectors[0]}, shared {vectors[1]}"
        rows.append([f"{node} mirror", mirror, _yes(not answer["mirror_points"] and not any(vectors))])
        if answer.get("watch_notices") is not None:  # a node without a mirror pushes and checks no notices
            erased = answer.get("scrubbed", {}).get("watch_notices", 0)
            pushed = f"pushed copies left {answer['watch_notices']}, erased in this round {erased}"
            rows.append([f"{node} watch notices", pushed, _yes(not answer["watch_notices"])])
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
