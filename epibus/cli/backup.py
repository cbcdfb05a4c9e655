"""`epibus backup DIR` and `epibus restore DIR`: a backup an operator can trust, and its restore onto a fresh
home (epibus/ops/backup.py says what each holds and in which order)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from bus.host.home import epibus_home, resolve_journal_url
from epibus.cli.common import (
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
from epibus.cli.display import shown

DirArg = Annotated[Path, typer.Argument(metavar="DIR", help="The backup's directory.")]


@handles_errors
def backup(
    directory: DirArg,
    nats: NatsOpt = None,
    journal: JournalOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Back up this home's running node into DIR (new, made 0700: it holds keys): its keys and state files, a
    consistent copy of the journal, then a snapshot of every stream. The mirror is rebuilt, not copied."""
    from epibus.ops.backup import backup as write_backup

    where = epibus_home(home)

    async def go() -> Any:
        async with Target(nats, home, None).asking() as (nc, _signer):
            with err_console.status("backing up") as status:
                return await write_backup(
                    nc,
                    where,
                    resolve_journal_url(journal, where),
                    directory,
                    progress=lambda step: status.update(f"backing up: {step}"),
                )

    manifest = run(go())
    if as_json:
        emit_json({"ok": True, "directory": str(directory), "journal": manifest.journal,
                   "streams": [vars(s) for s in manifest.streams], "state_files": manifest.state_files})  # fmt: skip
        return
    rows = [[s.name, s.messages, f"{s.first_seq}..{s.last_seq}", s.snapshot_bytes] for s in manifest.streams]
    console.print(table(f"backup in {directory}", ["stream", "messages", "sequences", "snapshot bytes"], rows))
    if manifest.journal.get("copied"):
        console.print(shown(f"journal: {manifest.journal['events']} event(s) copied"))
    else:
        console.print(shown(f"journal: not copied (PostgreSQL): {manifest.journal['do']}"), soft_wrap=True)


@handles_errors
def restore(directory: DirArg, home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Restore a backup onto a fresh home (no node may have run there): keys and state files, every stream, the
    journal. Then start the node (`epibus up`): it reads the stream into the journal and rebuilds the mirror."""
    from epibus.ops.backup import restore as put_back

    where = epibus_home(home)
    with err_console.status("restoring") as status:
        report = run(put_back(directory, where, progress=lambda step: status.update(f"restoring: {step}")))
    if as_json:
        emit_json({"ok": True, **report})
        return
    rows = [[name, messages] for name, messages in report["streams"].items()]
    console.print(table(f"restored into {where}", ["stream", "messages"], rows))
    console.print(shown(f"next: epibus up --home {where}, then epibus reconcile once it has caught up"), soft_wrap=True)
