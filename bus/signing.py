"""Agent keys (NATS nkeys, ed25519) and event signatures over canonical JSON.

An agent's key is created on first use and kept as `<home>/keys/<agent>.nk` with mode 0600."""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nacl.exceptions
import nacl.signing
import nkeys

from bus.auth import inbox_prefix, node_identity
from bus.errors import ConfigError, Forbidden, InvalidEvent
from bus.event import AGENT_PATTERN, Actor, Envelope, signing_payload
from bus.home import private_dir

NODE_KEY_FILE = "node.nk"
NODE_IDENTITY = "node"
SIGNER_HEADER = "Epibus-Signer"
SIGNER_KEY_HEADER = "Epibus-Signer-Key"
SIGNED_AT_HEADER = "Epibus-Signed-At"
SIGNATURE_HEADER = "Epibus-Signature"
REQUEST_MAX_AGE_S = 120.0  # a captured request cannot be replayed later than this


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class AgentKey:
    """One agent's signing key. `public_key` is the nkey user public key ('U…')."""

    def __init__(self, agent_id: str, seed: bytes) -> None:
        self.agent_id = agent_id
        self._pair = nkeys.from_seed(seed)
        self.public_key: str = self._pair.public_key.decode()

    @property
    def actor(self) -> Actor:
        return Actor(agent_id=self.agent_id, public_key=self.public_key)

    @classmethod
    def generate(cls, agent_id: str) -> AgentKey:
        return cls(agent_id, nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))

    @classmethod
    def load_or_create(cls, home: Path, agent_id: str) -> AgentKey:
        """The agent's key from `home/keys`, created (0600) on first use."""
        if not AGENT_PATTERN.fullmatch(agent_id):
            raise ConfigError("agent", f"{agent_id!r} must match {AGENT_PATTERN.pattern}")
        return cls.load_or_create_at(home / "keys" / f"{agent_id}.nk", agent_id)

    @classmethod
    def load_or_create_at(cls, path: Path, agent_id: str) -> AgentKey:
        if path.exists():
            return cls(agent_id, path.read_bytes().strip())
        private_dir(path.parent)
        key = cls.generate(agent_id)
        # O_EXCL: two processes creating the same agent's key at once must not overwrite each other.
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return cls(agent_id, path.read_bytes().strip())
        with os.fdopen(fd, "wb") as f:
            f.write(key._pair.seed)
            f.flush()
            os.fsync(f.fileno())
        return key

    @property
    def nats_credentials(self) -> dict[str, Any]:
        """nats-py connect options: authenticate with this nkey and receive replies only on its own inboxes."""
        return {"nkeys_seed_str": self._pair.seed.decode(), "inbox_prefix": inbox_prefix(self.public_key).encode()}

    def sign_request(self, subject: str, reply: str, data: bytes, *, signed_at: datetime) -> dict[str, str]:
        """Headers that prove this key asked `subject` with `data` and wants the answer on `reply`."""
        stamp = signed_at.astimezone(UTC).isoformat()
        signature = self._pair.sign(_request_payload(subject, reply, stamp, data))
        return {
            SIGNER_HEADER: self.agent_id,
            SIGNER_KEY_HEADER: self.public_key,
            SIGNED_AT_HEADER: stamp,
            SIGNATURE_HEADER: _b64(signature),
        }

    def sign_document(self, purpose: str, document: bytes) -> str:
        """A detached signature of `document` (canonical bytes) for one `purpose`: a signature made for one
        purpose never verifies for another, nor as an event or a request."""
        return _b64(self._pair.sign(_document_payload(purpose, document)))

    def sign(self, event: Envelope) -> Envelope:
        """The event signed by this key. Raises InvalidEvent if the event names another actor."""
        if event.actor != self.actor:
            raise InvalidEvent("actor", f"{event.actor.agent_id!r} is not the signing agent {self.agent_id!r}")
        signature = self._pair.sign(signing_payload(event))
        return event.model_copy(update={"signature": _b64(signature)})


def node_key(home: Path) -> AgentKey:
    """The node's own service identity (`<home>/node.nk`, 0600): every broker permission, and an admin of the
    fleet for requests it signs. Whoever can read the home is the node's operator."""
    return AgentKey.load_or_create_at(home / NODE_KEY_FILE, NODE_IDENTITY)


def node_event_key(node: AgentKey) -> AgentKey:
    """The identity a node signs events with (its enrolment records): `node-<its public key>`, the same key."""
    return AgentKey(node_identity(node.public_key), node._pair.seed)


@dataclass(frozen=True)
class RequestSigner:
    agent_id: str
    public_key: str


def _request_payload(subject: str, reply: str, signed_at: str, data: bytes) -> bytes:
    return "\n".join((subject, reply, signed_at, hashlib.sha256(data).hexdigest())).encode()


def verify_request(
    headers: Mapping[str, str] | None, subject: str, reply: str, data: bytes, *, now: datetime
) -> RequestSigner:
    """Who signed this request. Raises Forbidden unless it carries a signature by the key it names, made
    within REQUEST_MAX_AGE_S of `now`, over this subject, this reply subject and these bytes, and the reply
    goes to that key's own inbox (nobody else can read the answer)."""
    headers = headers or {}
    agent_id = headers.get(SIGNER_HEADER, "")
    public_key = headers.get(SIGNER_KEY_HEADER, "")
    stamp = headers.get(SIGNED_AT_HEADER, "")
    signature = headers.get(SIGNATURE_HEADER, "")

    def refuse(rule: str) -> Forbidden:
        return Forbidden(agent_id or "(unsigned)", "ask", subject, rule)

    if not (agent_id and public_key and stamp and signature):
        raise refuse(f"the request is not signed; sign it with the agent's key ({SIGNATURE_HEADER} header)")
    try:
        signed_at = datetime.fromisoformat(stamp)
        key = verify_key(public_key)
        key.verify(_request_payload(subject, reply, stamp, data), _unb64(signature))
    except (ValueError, InvalidEvent, nacl.exceptions.BadSignatureError, binascii.Error) as e:
        raise refuse("its signature does not verify against the key it names") from e
    if signed_at.tzinfo is None or abs((now - signed_at).total_seconds()) > REQUEST_MAX_AGE_S:
        raise refuse(f"it was signed at {stamp}, not within {REQUEST_MAX_AGE_S:.0f}s of now; check the clock")
    if not reply.startswith(inbox_prefix(public_key) + "."):
        raise refuse("its reply subject is not an inbox of the signing key")
    return RequestSigner(agent_id, public_key)


@functools.lru_cache(maxsize=4096)  # a fleet has few keys and every event needs one
def verify_key(public_key: str) -> nacl.signing.VerifyKey:
    """Decode an nkey user public key; raises InvalidEvent when it is malformed or fails its checksum."""
    try:
        raw = base64.b32decode(public_key + "=" * (-len(public_key) % 8))
    except binascii.Error as e:
        raise InvalidEvent("actor.public_key", "is not base32") from e
    if len(raw) != 35 or raw[0] != nkeys.PREFIX_BYTE_USER:
        raise InvalidEvent("actor.public_key", "is not an nkey user public key ('U…')")
    if nkeys.crc16_checksum(raw[:33]) != raw[33:]:
        raise InvalidEvent("actor.public_key", "fails its checksum")
    return nacl.signing.VerifyKey(raw[1:33])


def _document_payload(purpose: str, document: bytes) -> bytes:
    return b"epibus-document\n" + purpose.encode() + b"\n" + hashlib.sha256(document).hexdigest().encode()


def verify_document(public_key: str, purpose: str, document: bytes, signature: str) -> None:
    """Raise InvalidEvent unless `signature` is `public_key`'s signature of `document` for `purpose`."""
    try:
        verify_key(public_key).verify(_document_payload(purpose, document), _unb64(signature))
    except (nacl.exceptions.BadSignatureError, binascii.Error, ValueError) as e:
        raise InvalidEvent("signature", f"does not verify against {public_key[:12]}… for {purpose}") from e


def verify_signature(event: Envelope) -> None:
    """Raise InvalidEvent unless the event carries a valid signature by `event.actor.public_key`."""
    if event.signature is None:
        raise InvalidEvent("signature", "is missing; every event must be signed by its actor")
    try:
        verify_key(event.actor.public_key).verify(signing_payload(event), _unb64(event.signature))
    except nacl.exceptions.BadSignatureError as e:
        raise InvalidEvent("signature", "does not verify against actor.public_key") from e
