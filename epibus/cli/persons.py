"""`epibus person add`: a person's identity, as an admin makes it. The key is made here and written encrypted
with a passphrase the person types (never stored in clear); the node enrols it as a person, who alone may
hold the reviewer role. A person signs at the CLI with `--person NAME`, typing the passphrase each time."""

from __future__ import annotations

import getpass
import sys
from pathlib import Path
from typing import Annotated

import typer

from bus.client import enrol
from bus.errors import ConfigError, EpibusError
from bus.host.home import epibus_home
from bus.identity.person import require_passphrase_shape, require_person_key, unlock_person_key, write_person_key
from bus.identity.signing import AgentKey
from bus.model.auth import ANY_PROJECT
from bus.model.requests import EnrolRequest, build_request
from bus.model.vocab import Identity, Role
from epibus.cli.agents import _admin, _ask, _show
from epibus.cli.common import AgentOpt, HomeOpt, JsonOpt, NatsOpt, emit_json, handles_errors, run

person_app = typer.Typer(help="A person's identity: an encrypted key and a review role (admins).", no_args_is_help=True)

PersonOpt = Annotated[
    str | None,
    typer.Option("--person", help="Sign as this person (their key in the home; asks for the passphrase)."),
]
PassphraseStdinOpt = Annotated[
    bool,
    typer.Option("--passphrase-stdin", help="Read the passphrase from the first line of stdin, not the terminal."),
]
PERSON_ROLES = (Role.reviewer, Role.admin, Role.coordinator)


def read_passphrase(name: str, *, from_stdin: bool, confirm: bool = False) -> str:
    """The passphrase, typed at the terminal (hidden) or piped on stdin. Raises ConfigError when there is
    neither a terminal nor --passphrase-stdin, or the two typings differ."""
    if from_stdin:
        passphrase = sys.stdin.readline().rstrip("\r\n")
        if not passphrase:
            raise ConfigError("--passphrase-stdin", "stdin held no passphrase; pipe one line holding it")
        return passphrase
    if not sys.stdin.isatty():
        raise ConfigError("--person", f"no terminal to ask {name}'s passphrase on; pipe it and add --passphrase-stdin")
    passphrase = getpass.getpass(f"{name}'s passphrase: ")
    if confirm and getpass.getpass("the same again: ") != passphrase:
        raise ConfigError("passphrase", "the two typings differ; nothing was made")
    return passphrase


def person_signer(home: Path | None, name: str, *, from_stdin: bool) -> AgentKey:
    """A person's key, unlocked for this command. Raises NotFound, ConfigError (wrong passphrase)."""
    where = epibus_home(home)
    require_person_key(where, name)  # before a passphrase is asked for a key that is not here
    return unlock_person_key(where, name, read_passphrase(name, from_stdin=from_stdin))


@person_app.command("add")
@handles_errors
def add(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The person's identity name.")],
    project: Annotated[
        list[str], typer.Option("--project", "-p", help=f"A project they review (repeat; {ANY_PROJECT!r}: all).")
    ],
    role: Annotated[
        list[Role] | None, typer.Option("--role", help="reviewer (default), admin or coordinator; repeat.")
    ] = None,
    owner: Annotated[str | None, typer.Option("--owner", help="Who they are, e.g. an email (default: NAME).")] = None,
    passphrase_stdin: PassphraseStdinOpt = False,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Make a person's key, encrypted with the passphrase they type, and enrol it as a person (signed by the
    node's key under --home, else by --agent, an admin)."""
    roles = list(dict.fromkeys(role or [Role.reviewer]))
    if any(r not in PERSON_ROLES for r in roles):
        raise ConfigError("--role", f"{', '.join(roles)}: a person holds {', '.join(PERSON_ROLES)}; agents publish")
    key = AgentKey.generate(name)
    request = build_request(  # checked before a passphrase is asked or a file written
        EnrolRequest,
        agent_id=name,
        public_key=key.public_key,
        owner=owner,
        roles=roles,
        projects=project,
        identity=Identity.person,
    )
    target, admin = _admin(nats, home, agent)
    passphrase = read_passphrase(name, from_stdin=passphrase_stdin, confirm=not passphrase_stdin)
    require_passphrase_shape(passphrase)
    key_file = write_person_key(epibus_home(home), key, passphrase)
    try:
        enrolment = run(_ask(target, admin, lambda nc, a: enrol.enrol(nc, a, request)))
    except EpibusError:
        key_file.unlink()  # not enrolled: no key is left that names no one
        raise
    if as_json:
        emit_json(enrolment | {"key_file": str(key_file)})
    else:
        _show([enrolment], f"person enrolled; key encrypted at {key_file}")
