"""Invites, the one way a node joins a fleet. An admin's node (the fleet's hub: it holds the stream and the fleet
CA) issues one per new node: a one-time invite key, a certificate the fleet CA signed for that node's name, the
hub's leaf URLs and the fleet CA, all in a token valid for a bounded time. The new node dials the hub with the
invite key, asks to join with its own node key (made on its own host: no node's key leaves it) and from then on
connects as itself. The hub keeps each invite in `<home>/fleet/invites.json` and admits its key once: a used,
expired or withdrawn invite is refused."""

from __future__ import annotations

import base64
import binascii
import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated

import nkeys
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from bus.errors import ConfigError, Forbidden
from bus.host.home import private_dir, write_private

TOKEN_PREFIX = "epibus-join-1."
FLEET_DIR = "fleet"
INVITES_FILE = "invites.json"
DEFAULT_INVITE_TTL_S = 3600.0
MAX_INVITE_TTL_S = 7 * 86400.0
NODE_NAME = r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$"

NodeName = Annotated[str, StringConstraints(pattern=NODE_NAME)]
Pem = Annotated[str, StringConstraints(min_length=1, max_length=16_000)]


class Invite(BaseModel):
    """What a token carries to the new host."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fleet: Annotated[str, StringConstraints(pattern=NODE_NAME)]  # the hub's JetStream domain
    name: NodeName
    hub: NodeName
    urls: Annotated[list[Annotated[str, StringConstraints(pattern=r"^nats-leaf://[^\s/]+:\d+$")]], Field(min_length=1)]
    ca_pem: Pem
    cert_pem: Pem
    key_pem: Pem
    invite_seed: Annotated[str, StringConstraints(pattern=r"^SU[A-Z2-7]{56}$")]
    expires_at: AwareDatetime

    @property
    def invite_key(self) -> str:
        return str(nkeys.from_seed(self.invite_seed.encode()).public_key.decode())


def encode_token(invite: Invite) -> str:
    return TOKEN_PREFIX + base64.urlsafe_b64encode(invite.model_dump_json().encode()).decode().rstrip("=")


def decode_token(token: str, *, now: datetime | None = None) -> Invite:
    """The invite a token carries. Raises ConfigError naming what is wrong with it and what to do: not a token,
    damaged, or expired."""
    text = token.strip()
    if not text.startswith(TOKEN_PREFIX):
        raise ConfigError("--join", f"is not an epibus invite (it starts {TOKEN_PREFIX!r}); copy the whole token")
    body = text.removeprefix(TOKEN_PREFIX)
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        invite = Invite.model_validate_json(raw)
    except (binascii.Error, ValueError, ValidationError) as e:
        raise ConfigError("--join", f"the invite is damaged ({type(e).__name__}); copy the whole token again") from e
    moment = now or datetime.now(UTC)
    if invite.expires_at <= moment:
        raise ConfigError(
            "--join",
            f"the invite for {invite.name} expired at {invite.expires_at:%Y-%m-%d %H:%M} UTC; "
            f"ask an admin for a new one (epibus fleet invite {invite.name})",
        )
    return invite


def new_invite_seed() -> str:
    seed: bytes = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed.decode()


class InviteRecord(BaseModel):
    """The hub's record of one invite: never the seed, only its public key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: NodeName
    invite_key: str
    serial: str  # the certificate's serial, hex
    issued_at: AwareDatetime
    expires_at: AwareDatetime
    used_at: AwareDatetime | None = None
    node_key: str | None = None  # the key the node joined with

    def pending(self, now: datetime) -> bool:
        return self.used_at is None and self.expires_at > now


class InviteBook:
    """The hub's invites, in one owner-only file. Not shared: only the node that issued an invite redeems it."""

    def __init__(self, home: Path) -> None:
        self.path = home / FLEET_DIR / INVITES_FILE

    def records(self) -> list[InviteRecord]:
        if not self.path.exists():
            return []
        try:
            return [InviteRecord.model_validate(item) for item in json.loads(self.path.read_text())]
        except (OSError, ValueError, ValidationError) as e:
            raise ConfigError(str(self.path), f"cannot be read ({e}); move it aside: its invites are withdrawn") from e

    def _save(self, records: list[InviteRecord]) -> None:
        private_dir(self.path.parent)
        write_private(self.path, json.dumps([r.model_dump(mode="json") for r in records], indent=1))

    def add(self, record: InviteRecord) -> None:
        now = datetime.now(UTC)
        kept = [r for r in self.records() if r.pending(now) or r.used_at is not None]  # expired ones go
        self._save([*kept, record])

    def pending_keys(self, now: datetime | None = None) -> list[str]:
        moment = now or datetime.now(UTC)
        return [r.invite_key for r in self.records() if r.pending(moment)]

    def check(self, invite_key: str, name: str, *, now: datetime | None = None) -> InviteRecord:
        """The pending invite of `invite_key` for `name`. Raises Forbidden naming why there is none: unknown,
        for another name, used, or expired."""
        moment = now or datetime.now(UTC)
        for record in self.records():
            if record.invite_key != invite_key:
                continue
            if record.name != name:
                raise _refused(name, f"the invite is for {record.name}, not {name}")
            if record.used_at is not None:
                raise _refused(name, f"the invite was used at {record.used_at:%Y-%m-%d %H:%M} UTC; ask for a new one")
            if record.expires_at <= moment:
                raise _refused(name, f"the invite expired at {record.expires_at:%Y-%m-%d %H:%M} UTC; ask for a new one")
            return record
        raise _refused(name, "no such invite on this hub (forged, or withdrawn); ask an admin for a new one")

    def redeem(self, invite_key: str, name: str, node_key: str, *, now: datetime | None = None) -> InviteRecord:
        """Mark the invite used by `node_key`. Raises Forbidden as `check` does."""
        moment = now or datetime.now(UTC)
        pending = self.check(invite_key, name, now=moment)
        used = pending.model_copy(update={"used_at": moment, "node_key": node_key})
        self._save([used if r.invite_key == invite_key else r for r in self.records()])
        return used


def _refused(name: str, why: str) -> Forbidden:
    return Forbidden(name, "join", "the fleet", why)


def invite_lifetime(ttl_s: float) -> timedelta:
    if not 60 <= ttl_s <= MAX_INVITE_TTL_S:
        raise ConfigError("--ttl", f"{ttl_s:.0f} s is out of range: an invite lasts 60 s to {MAX_INVITE_TTL_S:.0f} s")
    return timedelta(seconds=ttl_s)
