"""Agent keys (NATS nkeys, ed25519) and event signatures over canonical JSON.

An agent's key is created on first use and kept as `<home>/keys/<agent>.nk` with mode 0600."""

from __future__ import annotations

import base64
import binascii
import functools
import os
from pathlib import Path

import nacl.exceptions
import nacl.signing
import nkeys

from bus.errors import ConfigError, InvalidEvent
from bus.event import AGENT_PATTERN, Actor, Envelope, signing_payload
from bus.home import private_dir


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
        path = home / "keys" / f"{agent_id}.nk"
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

    def sign(self, event: Envelope) -> Envelope:
        """The event signed by this key. Raises InvalidEvent if the event names another actor."""
        if event.actor != self.actor:
            raise InvalidEvent("actor", f"{event.actor.agent_id!r} is not the signing agent {self.agent_id!r}")
        signature = self._pair.sign(signing_payload(event))
        return event.model_copy(update={"signature": _b64(signature)})


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


def verify_signature(event: Envelope) -> None:
    """Raise InvalidEvent unless the event carries a valid signature by `event.actor.public_key`."""
    if event.signature is None:
        raise InvalidEvent("signature", "is missing; every event must be signed by its actor")
    try:
        verify_key(event.actor.public_key).verify(signing_payload(event), _unb64(event.signature))
    except nacl.exceptions.BadSignatureError as e:
        raise InvalidEvent("signature", "does not verify against actor.public_key") from e
