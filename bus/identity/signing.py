"""Agent keys (NATS nkeys, ed25519) and the signatures of events, requests and documents.

An event (schema_version 2) is signed as it travels: ed25519 over `EVENT_DOMAIN + subject + "\n" + body`,
the body being the message's bytes exactly as sent; the signature and the signing key ride in the
EVENT_SIGNATURE_HEADER and EVENT_KEY_HEADER headers, so any language verifies without re-serialising.
A legacy event (schema_version 1) carries its signature inside, over the canonical JSON of the rest.

An agent's key is created on first use and kept as `<home>/keys/<agent>.nk` with mode 0600."""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import os
import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nacl.exceptions
import nacl.signing
import nkeys

from bus.errors import ConfigError, Forbidden, InvalidEvent
from bus.host.home import person_key_path, person_refusal, private_dir
from bus.model.auth import inbox_prefix, node_identity
from bus.model.event import LEGACY_SCHEMA_VERSION, SCHEMA_VERSION, Actor, Envelope, encode_event, signing_payload
from bus.model.fields import AGENT_PATTERN
from bus.subjects import (
    EVENT_KEY_HEADER,
    EVENT_SIGNATURE_HEADER,
    SIGNATURE_HEADER,
    SIGNED_AT_HEADER,
    SIGNER_HEADER,
    SIGNER_KEY_HEADER,
    event_subject,
)

NODE_KEY_FILE = "node.nk"
NODE_IDENTITY = "node"
REQUEST_MAX_AGE_S = 120.0  # a captured request cannot be replayed later than this
# Domain separation: an event signature never verifies as a request or a document signature, nor they as it.
EVENT_DOMAIN = b"epibus-event-v2\n"
SIGNATURE_PATTERN = re.compile(r"^[A-Za-z0-9_-]{86}$")  # 64 bytes, unpadded base64url


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


CREDS_ENV = "NATS_CREDS"
CREDS_SEED = re.compile(rb"-----BEGIN USER NKEY SEED-----\s*(SU[A-Z2-7]+)\s*------END USER NKEY SEED------")


def creds_seed(path: Path) -> bytes:
    """The user nkey seed in a NATS credentials file (`nsc`'s and `nats`'s .creds). Its JWT, if any, is not
    used: an epibus node admits keys by enrolment. Raises ConfigError naming the file."""
    try:
        text = path.read_bytes()
    except OSError as e:
        raise ConfigError(CREDS_ENV, f"{path}: {e.strerror}; point it at a readable .creds file") from e
    found = CREDS_SEED.search(text)
    if found is None:
        raise ConfigError(CREDS_ENV, f"{path} holds no USER NKEY SEED block; is it a NATS .creds file?")
    return found.group(1)


class AgentKey:
    """One agent's signing key. `public_key` is the nkey user public key ('U…')."""

    def __init__(self, agent_id: str, seed: bytes) -> None:
        self.agent_id = agent_id
        self._pair = nkeys.from_seed(seed)
        self.public_key: str = self._pair.public_key.decode()

    @property
    def seed(self) -> bytes:
        """The nkey seed (secret): only a key file's writer reads it."""
        return bytes(self._pair.seed)

    @functools.cached_property
    def actor(self) -> Actor:
        return Actor(agent_id=self.agent_id, public_key=self.public_key)

    @classmethod
    def generate(cls, agent_id: str) -> AgentKey:
        return cls(agent_id, nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))

    @classmethod
    def load_or_create(cls, home: Path, agent_id: str) -> AgentKey:
        """The agent's key: from the NATS credentials file $NATS_CREDS names (its nkey seed, as the NATS tools
        read it), else from `home/keys`, created (0600) on first use."""
        if not AGENT_PATTERN.fullmatch(agent_id):
            raise ConfigError("agent", f"{agent_id!r} must match {AGENT_PATTERN.pattern}")
        if person_key_path(home, agent_id).exists():
            raise ConfigError("agent", person_refusal(agent_id))
        if creds := os.environ.get(CREDS_ENV):
            return cls(agent_id, creds_seed(Path(creds)))
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
        """The event (schema_version 2) signed by this key over its subject and body bytes: the signature is
        kept on the returned envelope, and `wire_message` sends it in the headers with the very bytes signed.
        Raises InvalidEvent if the event names another actor."""
        prepared = self.prepare(event)
        return self.seal(prepared, self.sign_prepared([prepared])[0])

    def prepare(self, event: Envelope) -> PreparedEvent:
        """The event as schema_version 2, unsigned, with the one serialisation of it: the bytes signed and sent.
        Raises InvalidEvent if it names another actor or is larger than the limit."""
        self._require_actor(event)
        unsigned = event
        if event.schema_version != SCHEMA_VERSION or event.signature is not None:
            unsigned = event.model_copy(update={"schema_version": SCHEMA_VERSION, "signature": None})
        data = encode_event(unsigned)
        return PreparedEvent(unsigned, event_subject(event.project, event.kind, event.artifact_id), data)

    def sign_prepared(self, prepared: Sequence[PreparedEvent]) -> list[str]:
        """The signatures of prepared events, in order. Bytes in, text out: safe on a worker thread, where
        PyNaCl releases the GIL while it signs."""
        return [_b64(self._pair.sign(event_signed_bytes(p.subject, p.data))) for p in prepared]

    def seal(self, prepared: PreparedEvent, signature: str) -> Envelope:
        """The signed envelope; sending it later reuses the prepared bytes."""
        signed = prepared.event.model_copy(update={"signature": signature})
        _remember(WireMessage(prepared.subject, prepared.data, event_headers(signature, self.public_key)), signed)
        return signed

    def sign_v1(self, event: Envelope) -> Envelope:
        """The event in the legacy format (schema_version 1, the signature inside, over the canonical JSON of
        the rest). Mesh task steps and roster changes use it: the task record keeps the signature and the
        recorder rebuilds the event from it."""
        self._require_actor(event)
        legacy = event.model_copy(update={"schema_version": LEGACY_SCHEMA_VERSION, "signature": None})
        signature = self._pair.sign(signing_payload(legacy))
        return legacy.model_copy(update={"signature": _b64(signature)})

    def _require_actor(self, event: Envelope) -> None:
        if event.actor is not self.actor and event.actor != self.actor:  # a draft holds this very instance
            raise InvalidEvent("actor", f"{event.actor.agent_id!r} is not the signing agent {self.agent_id!r}")


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
    """Raise InvalidEvent unless the event carries a valid signature by `event.actor.public_key`. For
    schema_version 2 this re-encodes the event, which holds only for canonical bodies (what `sign` makes): a
    message from the stream is verified over its own bytes by `verify_message`."""
    if event.signature is None:
        raise InvalidEvent("signature", "is missing; every event must be signed by its actor")
    if event.schema_version == LEGACY_SCHEMA_VERSION:
        payload = signing_payload(event)
    else:
        payload = event_signed_bytes(event_subject(event.project, event.kind, event.artifact_id), encode_event(event))
    try:
        verify_key(event.actor.public_key).verify(payload, _unb64(event.signature))
    except nacl.exceptions.BadSignatureError as e:
        raise InvalidEvent("signature", "does not verify against actor.public_key") from e


# -- the wire --------------------------------------------------------------------------------------------


def event_signed_bytes(subject: str, data: bytes) -> bytes:
    """Exactly what an event's signature covers: the domain, the subject, a newline, the body as sent."""
    return EVENT_DOMAIN + subject.encode() + b"\n" + data


def event_headers(signature: str, public_key: str) -> dict[str, str]:
    """A fresh dict per publish: nats-py writes into the dict it is given."""
    return {EVENT_SIGNATURE_HEADER: signature, EVENT_KEY_HEADER: public_key}


@dataclass(frozen=True)
class PreparedEvent:
    """An unsigned schema_version 2 event and what its signature will cover: `event_signed_bytes(subject, data)`."""

    event: Envelope
    subject: str
    data: bytes


@dataclass(frozen=True)
class WireMessage:
    """An event as it travels: subject, body bytes, and its signature headers (none for a legacy event)."""

    subject: str
    data: bytes
    headers: Mapping[str, str]


# Events `sign` made, by identity, with their bytes: sending one does not serialise it again. An envelope is
# frozen, so the same object is the same event; a copy with any change is a new object and is encoded anew. An
# entry lives as long as its event does.
_sealed: dict[int, tuple[weakref.ref[Envelope], WireMessage]] = {}


def _remember(message: WireMessage, event: Envelope) -> None:
    key = id(event)
    _sealed[key] = (weakref.ref(event), message)
    weakref.finalize(event, _sealed.pop, key, None)


def wire_message(event: Envelope) -> WireMessage:
    """The subject, bytes and headers to publish a signed event with. Raises InvalidEvent when it is unsigned
    or larger than the limit."""
    if event.signature is None:
        raise InvalidEvent("signature", "is missing; sign the event with its actor's key first")
    cached = _sealed.get(id(event))
    if cached is not None and cached[0]() is event:
        return WireMessage(cached[1].subject, cached[1].data, dict(cached[1].headers))
    subject = event_subject(event.project, event.kind, event.artifact_id)
    if event.schema_version == LEGACY_SCHEMA_VERSION:
        return WireMessage(subject, encode_event(event), {})
    return WireMessage(subject, encode_event(event), event_headers(event.signature, event.actor.public_key))


def message_format(headers: Mapping[str, str] | None) -> int:
    """The one rule that says which format a stream message is in: with an event signature or key header it is
    schema_version 2 (the signature beside the body), without either it is legacy (schema_version 1)."""
    headers = headers or {}
    if EVENT_SIGNATURE_HEADER in headers or EVENT_KEY_HEADER in headers:
        return SCHEMA_VERSION
    return LEGACY_SCHEMA_VERSION


def verify_message(subject: str, data: bytes, headers: Mapping[str, str], event: Envelope) -> Envelope:
    """`event` (decoded from `data`) with its signature, once the headers prove that its actor's key signed
    `subject` and `data` exactly. Raises InvalidEvent naming what does not hold; never re-serialises."""
    signature = headers.get(EVENT_SIGNATURE_HEADER, "")
    public_key = headers.get(EVENT_KEY_HEADER, "")
    if not SIGNATURE_PATTERN.fullmatch(signature):
        raise InvalidEvent(EVENT_SIGNATURE_HEADER, "must be the 64-byte ed25519 signature in unpadded base64url")
    if public_key != event.actor.public_key:
        raise InvalidEvent(EVENT_KEY_HEADER, f"{public_key[:12]!r}… is not the key the event names (actor.public_key)")
    try:
        verify_key(public_key).verify(event_signed_bytes(subject, data), _unb64(signature))
    except (nacl.exceptions.BadSignatureError, binascii.Error, ValueError) as e:
        raise InvalidEvent(EVENT_SIGNATURE_HEADER, "does not verify over this subject and these body bytes") from e
    return event.model_copy(update={"signature": signature})
