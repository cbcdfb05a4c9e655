"""A fleet across machines, the hub's side. The hub is the node whose server holds the stream; it listens for
joining nodes on `--fleet-port` (nats-server leafnode connections, mutual TLS with the fleet CA, each node
authenticated by its own nkey). It invites a node (`epibus.fleet.invite`, admins), admits the invite's one-time
key until the node redeems it (`epibus.fleet.join`), and removes a node (`epibus.fleet.remove`, admins): its key
leaves the hub's users and its leaf connection is closed at once.

Members are recorded in the registry bucket (`fleet.<name>`), written by the hub only, so every node lists them."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from pydantic import AwareDatetime, BaseModel, ConfigDict, ValidationError

from bus.broker.kv import read_entry
from bus.broker.nats_errors import nats_call
from bus.broker.streams import open_bucket
from bus.enrolment.service_rules import Asker, Authorizer, admin_rule
from bus.errors import ConfigError, Forbidden, InvalidEvent, NotFound, Unavailable
from bus.host.home import write_private
from bus.identity.signing import verify_document, verify_request
from bus.model.auth import inbox_owner, inbox_prefix
from bus.model.requests import (
    FleetInviteReply,
    FleetInviteRequest,
    FleetJoinRequest,
    FleetRemoveRequest,
    FleetReply,
)
from bus.services.responder import Responder, Service, serve
from bus.subjects import (
    AGENT_KEYS_BUCKET,
    FLEET_DOMAIN,
    FLEET_INVITE,
    FLEET_JOIN,
    FLEET_QUEUE,
    FLEET_REMOVE,
    JS_API,
    in_js_domain,
    kv_stream,
    kv_subject,
)
from epibus.fleet.certs import CA_NAME, fleet_authority, issue_node_certificate
from epibus.fleet.invites import (
    FLEET_DIR,
    Invite,
    InviteBook,
    InviteRecord,
    encode_token,
    invite_lifetime,
    new_invite_seed,
)

log = logging.getLogger(__name__)
JOIN_PROOF_PURPOSE = "epibus-fleet-join"
HUB_CERT = "hub"
MEMBER_PREFIX = "fleet."
KICK_TIMEOUT_S = 5.0


class FleetMember(BaseModel):
    """One node of the fleet as its hub recorded it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    public_key: str
    host: str
    role: Literal["hub", "leaf"]
    joined_at: AwareDatetime
    revoked_at: AwareDatetime | None = None
    certificate_serial: str = ""

    @property
    def active(self) -> bool:
        return self.revoked_at is None


def join_proof_document(name: str, invite_key: str) -> bytes:
    return f"{name}\n{invite_key}".encode()


class FleetRoster:
    """The members' records in the registry bucket, read by any node, written by the hub."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await open_bucket(self.js, AGENT_KEYS_BUCKET)
        return self._kv

    async def members(self) -> list[FleetMember]:
        """Every member ever recorded, removed ones included. Raises Unavailable."""
        prefix = kv_subject(AGENT_KEYS_BUCKET, MEMBER_PREFIX)
        found: list[FleetMember] = []
        async with nats_call("fleet members"):
            kv = await self._bucket()
            info = await self.js.stream_info(kv_stream(AGENT_KEYS_BUCKET), subjects_filter=f"{prefix}>")
            for subject in sorted(info.state.subjects or {}):
                entry = await read_entry(kv, subject.removeprefix(kv_subject(AGENT_KEYS_BUCKET, "")))
                if entry is None:
                    continue
                try:
                    found.append(FleetMember.model_validate_json(entry.value or b""))
                except ValidationError as e:
                    log.warning("fleet member record %s is unreadable and left out: %s", subject, e)
        return found

    async def get(self, name: str) -> FleetMember | None:
        async with nats_call(f"fleet member {name}"):
            kv = await self._bucket()
            entry = await read_entry(kv, MEMBER_PREFIX + name)
            if entry is None:
                return None
        return FleetMember.model_validate_json(entry.value or b"")

    async def put(self, member: FleetMember) -> None:
        async with nats_call(f"fleet member {member.name}"):
            kv = await self._bucket()
            await kv.put(MEMBER_PREFIX + member.name, member.model_dump_json().encode())


class FleetHub:
    """The hub's fleet services and what its server needs for them."""

    def __init__(
        self,
        home: Path,
        js: JetStreamContext,
        *,
        name: str,
        public_key: str,
        host: str,
        fleet_port: int,
        apply: Callable[[], Awaitable[bool]],
        system: Callable[[], Awaitable[NatsClient]],
    ) -> None:
        self.home = home
        self.directory = home / FLEET_DIR
        self.name = name
        self.public_key = public_key
        self.host = host
        self.fleet_port = fleet_port
        self.roster = FleetRoster(js)
        self.book = InviteBook(home)
        self._apply = apply  # re-render the server's authorization (enrolments + fleet users) and reload
        self._system = system  # the server's system-account connection: leaf connections, kicks
        self._members: list[FleetMember] = []
        self.kicked = 0

    async def start(self) -> None:
        """Record the hub itself and read the members (their keys are users of this server)."""
        if (await self.roster.get(self.name)) is None:
            now = datetime.now(UTC)
            await self.roster.put(FleetMember(name=self.name, public_key=self.public_key, host=self.host, role="hub",
                                              joined_at=now))  # fmt: skip
        self._members = await self.roster.members()

    def users(self) -> list[dict[str, Any]]:
        """The server users the fleet adds: each active joined node (every permission: a node), and each pending
        invite's one-time key, which may only ask to join and hear the answer."""
        users: list[dict[str, Any]] = [{"nkey": m.public_key} for m in self._members if m.active and m.role == "leaf"]
        for key in self.book.pending_keys():
            allow_publish = {"allow": [FLEET_JOIN]}
            allow_subscribe = {"allow": [f"{inbox_prefix(key)}.>"]}
            users.append({"nkey": key, "permissions": {"publish": allow_publish, "subscribe": allow_subscribe}})
        return users

    def services(self) -> list[Service[Any]]:
        return [
            Service(FLEET_INVITE, FleetInviteRequest, FleetInviteReply, self.invite, admin_rule, queue=FLEET_QUEUE),
            Service(FLEET_REMOVE, FleetRemoveRequest, FleetReply, self.remove, admin_rule, queue=FLEET_QUEUE),
        ]

    async def serve_join(self, nc: NatsClient) -> Responder[FleetJoinRequest, FleetReply]:
        """`epibus.fleet.join`, signed by an invite's key (no enrolment: the invite book decides)."""
        authorizer: Authorizer[FleetJoinRequest] = Authorizer(_to_an_inbox, _invite_signer, self.join_rule)
        return await serve(
            nc, FLEET_JOIN, FleetJoinRequest, FleetReply, self.join, node=self.name, authorize=authorizer,
            queue=FLEET_QUEUE,
        )  # fmt: skip

    async def invite(self, request: FleetInviteRequest) -> FleetInviteReply:
        member = await self.roster.get(request.name)
        if member is not None and member.active:
            raise ConfigError("name", f"{request.name} is a member already; remove it first (epibus fleet remove)")
        lifetime = invite_lifetime(request.ttl_s)
        issued = datetime.now(UTC)
        key_pem, cert_pem, serial = issue_node_certificate(self.directory, request.name, request.hosts)
        seed = new_invite_seed()
        invite = Invite(
            fleet=FLEET_DOMAIN,
            name=request.name,
            hub=self.name,
            urls=[f"nats-leaf://{self.host}:{self.fleet_port}"],
            ca_pem=(self.directory / f"{CA_NAME}.crt").read_text(),
            cert_pem=cert_pem,
            key_pem=key_pem,
            invite_seed=seed,
            expires_at=issued + lifetime,
        )
        record = InviteRecord(
            name=request.name, invite_key=invite.invite_key, serial=f"{serial:x}", issued_at=issued,
            expires_at=invite.expires_at,
        )  # fmt: skip
        self.book.add(record)
        await self._apply()
        log.info("invited node %s until %s", request.name, invite.expires_at.isoformat())
        return FleetInviteReply(node=self.name, token=encode_token(invite), expires_at=invite.expires_at)

    def join_rule(self, asker: Asker, request: FleetJoinRequest) -> None:
        """Who may join: the request signed by a pending invite's key for this name, with a proof by the node key
        it names, which was never removed from the fleet. Raises Forbidden naming which of these fails."""
        if request.invite_key != asker.public_key:
            raise asker.refuse("invite_key must be the key that signed the request")
        try:
            document = join_proof_document(request.name, request.invite_key)
            verify_document(request.node_key, JOIN_PROOF_PURPOSE, document, request.proof)
        except InvalidEvent as e:
            raise asker.refuse("the proof is not signed by the node key it names") from e
        removed = [m for m in self._members if m.public_key == request.node_key and not m.active]
        if removed:
            raise asker.refuse(
                f"its node key was removed from the fleet at {removed[0].revoked_at:%Y-%m-%d %H:%M} UTC; a node "
                "rejoins with a new key (start it with a new --home)"
            )
        try:
            self.book.check(request.invite_key, request.name)
        except Forbidden as e:
            raise asker.refuse(e.rule) from e

    async def join(self, request: FleetJoinRequest) -> FleetReply:
        record = self.book.redeem(request.invite_key, request.name, request.node_key)
        member = FleetMember(
            name=request.name, public_key=request.node_key, host=request.host, role="leaf",
            joined_at=datetime.now(UTC), certificate_serial=record.serial,
        )  # fmt: skip
        await self.roster.put(member)
        self._members = await self.roster.members()
        await self._apply()  # the invite key leaves the users, the node's own key joins them
        log.info("node %s joined the fleet with key %s", member.name, member.public_key)
        return FleetReply(node=self.name, member=member.model_dump(mode="json"))

    async def remove(self, request: FleetRemoveRequest) -> FleetReply:
        member = await self.roster.get(request.name)
        if member is None:
            raise NotFound("fleet member", request.name, "`epibus fleet list` shows the members")
        if member.role == "hub":
            raise ConfigError("name", f"{request.name} is the fleet's hub; a hub is not removed from itself")
        if member.active:
            member = member.model_copy(update={"revoked_at": datetime.now(UTC)})
            await self.roster.put(member)
        self._members = await self.roster.members()
        await self._apply()  # its key is no longer a user: it cannot connect again
        await self.kick(member.name)  # and the connection it has is closed now
        return FleetReply(node=self.name, member=member.model_dump(mode="json"))

    async def refresh(self) -> None:
        """Read the members again (another process of this hub may have changed them)."""
        self._members = await self.roster.members()

    async def kick(self, name: str) -> int:
        """Close every leaf connection of server `name` (a reload keeps a removed user's leaf connection open).
        Returns how many were closed. Raises Unavailable."""
        nc = await self._system()
        closed = 0
        try:
            async with nats_call("leaf connections", timeout_s=KICK_TIMEOUT_S):
                reply = await nc.request("$SYS.REQ.SERVER.PING.LEAFZ", b"{}", timeout=KICK_TIMEOUT_S)
                answer = json.loads(reply.data)
                server_id = answer["server"]["id"]
                for leaf in (answer.get("data") or {}).get("leafs") or []:
                    if leaf.get("name") != name:
                        continue
                    body = json.dumps({"cid": leaf["id"]}).encode()
                    await nc.request(f"$SYS.REQ.SERVER.{server_id}.KICK", body, timeout=KICK_TIMEOUT_S)
                    closed += 1
        except (KeyError, ValueError) as e:
            raise Unavailable("nats-server", f"its leaf connections could not be read: {e}") from e
        self.kicked += closed
        return closed


def hub_listener(home: Path, name: str, host: str, port: int) -> str:
    """The hub server's listener for joining nodes: mutual TLS with the fleet CA (TLS before anything else),
    then each node's nkey. Makes the fleet CA and the hub's certificate at the first start."""
    directory = home / FLEET_DIR
    fleet_authority(directory)
    cert, key = directory / f"{HUB_CERT}.crt", directory / f"{HUB_CERT}.key"
    if not cert.exists() or not key.exists():
        key_pem, cert_pem, _ = issue_node_certificate(directory, name, [host])
        write_private(key, key_pem)
        write_private(cert, cert_pem)
    return leafnode_listener(host, port, directory, HUB_CERT)


def leafnode_listener(host: str, port: int, directory: Path, stem: str) -> str:
    tls = _tls_block(directory, stem, verify=True)
    return f'leafnodes {{\n  listen: "{host}:{port}"\n  {tls}\n}}\n'


def _tls_block(directory: Path, stem: str, *, verify: bool) -> str:
    files = (
        f'cert_file: "{directory / f"{stem}.crt"}", key_file: "{directory / f"{stem}.key"}", '
        f'ca_file: "{directory / f"{CA_NAME}.crt"}"'
    )
    return f"tls {{ {files}, verify: {str(verify).lower()}, handshake_first: true, timeout: 5 }}"


def leaf_remote_block(urls: list[str], seed: str, directory: Path, stem: str) -> str:
    """A joined node's server: a leaf of the hub, authenticated by `seed`, over mutual TLS; its clients' JetStream
    API goes to the hub's domain."""
    remote = {"urls": urls, "nkey": seed}
    tls = _tls_block(directory, stem, verify=True)
    body = json.dumps(remote)[1:-1]
    # KV writes too: a bucket's `$KV.<bucket>.<key>` goes to the hub as `$JS.<domain>.API.$KV.…` (nats-py writes
    # the plain subject; the hub maps the domain form back to the bucket's stream).
    api = in_js_domain(JS_API, FLEET_DOMAIN)
    return (
        f'mappings {{ "$JS.API.>": "{api}.>", "$KV.>": "{api}.$KV.>" }}\n'
        f"leafnodes {{\n  remotes: [ {{ {body}, {tls} }} ]\n}}\n"
    )


def _to_an_inbox(reply: str) -> bool:
    return inbox_owner(reply) is not None


async def _invite_signer(msg: Msg) -> Asker:
    signer = verify_request(msg.headers, msg.subject, msg.reply, msg.data, now=datetime.now(UTC))
    # No enrolment: to a role rule that would read as the node's own key, so this asker is only ever paired with
    # join_rule, which reads no role (the invite book and the proof decide).
    return Asker(signer.agent_id, signer.public_key, msg.subject, None)
