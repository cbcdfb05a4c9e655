"""A person's signing key: made by `epibus person add`, kept encrypted with a passphrase the person types (never
stored in clear), unlocked for one command at a time. The key itself is an ordinary nkey (`AgentKey`); what
makes it a person's is the enrolment (`identity: person`) and that it lives only in this encrypted form."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import nacl.exceptions
import nacl.pwhash
import nacl.secret
import nacl.utils

from bus.errors import ConfigError, NotFound
from bus.host.home import person_key_path, private_dir
from bus.identity.signing import AgentKey
from bus.model.fields import AGENT_PATTERN

FORMAT = "epibus-person-key/1"
MIN_PASSPHRASE_CHARS = 10
# libsodium's interactive limits: about 0.1 s and 64 MiB per unlock, against a guess as against the person.
OPS_LIMIT = nacl.pwhash.argon2id.OPSLIMIT_INTERACTIVE
MEM_LIMIT = nacl.pwhash.argon2id.MEMLIMIT_INTERACTIVE


def _box(passphrase: str, salt: bytes, ops: int, mem: int) -> nacl.secret.SecretBox:
    key = nacl.pwhash.argon2id.kdf(
        nacl.secret.SecretBox.KEY_SIZE, passphrase.encode(), salt, opslimit=ops, memlimit=mem
    )
    return nacl.secret.SecretBox(key)


def require_passphrase_shape(passphrase: str) -> None:
    """Raise ConfigError when a new passphrase is too short to stand against a guess."""
    if len(passphrase) < MIN_PASSPHRASE_CHARS:
        raise ConfigError(
            "passphrase", f"has {len(passphrase)} characters; a person's key needs at least {MIN_PASSPHRASE_CHARS}"
        )


def write_person_key(home: Path, key: AgentKey, passphrase: str) -> Path:
    """Write a person's key (`AgentKey.generate(name)`) encrypted (0600 in a 0700 directory); returns the file.
    Raises ConfigError when the name is not an identity name, the passphrase is too short, or the name already
    has a key here (a person's or an agent's)."""
    name = key.agent_id
    if not AGENT_PATTERN.fullmatch(name):
        raise ConfigError("NAME", f"{name!r} must match {AGENT_PATTERN.pattern}")
    require_passphrase_shape(passphrase)
    path = person_key_path(home, name)
    if (home / "keys" / f"{name}.nk").exists():
        raise ConfigError(
            "NAME", f"{name} is an agent under {home} ({home / 'keys'}); a person needs a name of their own"
        )
    salt = nacl.utils.random(nacl.pwhash.argon2id.SALTBYTES)
    sealed = _box(passphrase, salt, OPS_LIMIT, MEM_LIMIT).encrypt(key.seed)
    document = {
        "format": FORMAT,
        "name": name,
        "public_key": key.public_key,
        "kdf": {"name": "argon2id", "ops": OPS_LIMIT, "mem": MEM_LIMIT, "salt": base64.b64encode(salt).decode()},
        "sealed": base64.b64encode(bytes(sealed)).decode(),
    }
    private_dir(path.parent)
    try:  # O_EXCL: a second `person add` never overwrites the first one's key
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(
            "NAME", f"{name} already has a key at {path}; choose another name or remove that file"
        ) from None
    with os.fdopen(fd, "w") as f:
        json.dump(document, f)
        f.flush()
        os.fsync(f.fileno())
    return path


def require_person_key(home: Path, name: str) -> str:
    """The public half of the person's key here (readable without the passphrase). Raises NotFound naming the
    file and `epibus person add`, or ConfigError for a file that is not a person's key."""
    return str(_document(home, name)["public_key"])


def unlock_person_key(home: Path, name: str, passphrase: str) -> AgentKey:
    """The person's key, for one command. Raises NotFound (no key here) or ConfigError (wrong passphrase, or a
    file that is not a person's key); nothing is signed with a key that did not unlock."""
    document = _document(home, name)
    kdf = document["kdf"]
    path = person_key_path(home, name)
    try:
        box = _box(passphrase, base64.b64decode(kdf["salt"]), int(kdf["ops"]), int(kdf["mem"]))
        seed = box.decrypt(base64.b64decode(document["sealed"]))
    except nacl.exceptions.CryptoError:
        raise ConfigError("passphrase", f"does not unlock {name}'s key ({path}); nothing was signed") from None
    key = AgentKey(name, seed)
    if key.public_key != document["public_key"]:
        raise ConfigError("NAME", f"{path} holds a key whose public half is not the one it names; restore the file")
    return key


def _document(home: Path, name: str) -> dict[str, Any]:
    path = person_key_path(home, name)
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise NotFound(
            "person", name, f"no key at {path}; an admin makes one with `epibus person add {name}`"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError("NAME", f"{path} is not readable as a person's key: {e}") from e
    if not isinstance(document, dict) or document.get("format") != FORMAT or document.get("name") != name:
        raise ConfigError("NAME", f"{path} is not {name}'s key ({FORMAT})")
    return document
