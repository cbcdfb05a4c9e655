"""`epibus certs DIR`: the CA and certificates a NATS cluster with TLS and route authentication needs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from epibus.cli.common import JsonOpt, console, emit_json, handles_errors, table
from epibus.fleet.certs import DEFAULT_DAYS, DEFAULT_SERVERS, MAX_DAYS, generate


@handles_errors
def certs(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="Where to write them (made mode 0700).")],
    servers: Annotated[
        list[str] | None,
        typer.Option(
            "--servers",
            help="Server host names, comma-separated or repeated.",
            show_default=",".join(DEFAULT_SERVERS),
        ),
    ] = None,
    hosts: Annotated[
        list[str] | None,
        typer.Option("--hosts", help="More names or IP addresses every server answers on (comma-separated)."),
    ] = None,
    days: Annotated[int, typer.Option("--days", help=f"How long they last (1 to {MAX_DAYS}).")] = DEFAULT_DAYS,
    force: Annotated[bool, typer.Option("--force", help="Replace files already in DIR (a new CA).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write a private CA, a key and certificate per NATS server (its name, localhost, 127.0.0.1 and --hosts)
    and a client certificate for the epibus node. Keys are mode 0600. Existing files are kept unless --force."""
    written = generate(
        directory,
        servers=_split(servers) or DEFAULT_SERVERS,
        hosts=_split(hosts),
        days=days,
        force=force,
    )
    if as_json:
        emit_json({"ok": True, "dir": str(directory), "files": [f.as_json() for f in written]})
        return
    rows = [
        [f.path.name, f.holds, f"{f.mode:04o}", ", ".join(f.names), f.not_after.date() if f.not_after else None]
        for f in written
    ]
    console.print(table(f"certificates in {directory}", ["file", "holds", "mode", "names", "expires"], rows))


def _split(values: list[str] | None) -> list[str]:
    return [part.strip() for value in values or [] for part in value.split(",") if part.strip()]
