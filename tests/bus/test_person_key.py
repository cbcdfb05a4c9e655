"""A person's key on disk: encrypted with their passphrase, never in clear; a wrong passphrase unlocks nothing;
processes started for an agent refuse to load it; an agent identity cannot hold the reviewer role."""

from __future__ import annotations

import stat
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import ValidationError

from bus.errors import ConfigError, NotFound
from bus.host.home import person_key_path
from bus.identity.person import unlock_person_key, write_person_key
from bus.identity.signing import AgentKey
from bus.model.auth import Enrolment
from bus.model.vocab import Identity, Role

PASSPHRASE = "correct horse battery"


def test_a_persons_key_is_kept_encrypted_and_unlocks_only_with_its_passphrase(tmp_path: Path) -> None:
    key = AgentKey.generate("dana")
    path = write_person_key(tmp_path, key, PASSPHRASE)
    assert path == person_key_path(tmp_path, "dana")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert key.seed not in path.read_bytes()  # the secret is nowhere in clear
    assert unlock_person_key(tmp_path, "dana", PASSPHRASE).public_key == key.public_key
    with pytest.raises(ConfigError, match=r"passphrase: does not unlock dana's key .*; nothing was signed"):
        unlock_person_key(tmp_path, "dana", PASSPHRASE + "!")
    with pytest.raises(NotFound, match="epibus person add erin"):
        unlock_person_key(tmp_path, "erin", PASSPHRASE)


def test_a_short_passphrase_and_a_second_key_under_one_name_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least 10"):
        write_person_key(tmp_path, AgentKey.generate("dana"), "short")
    assert not person_key_path(tmp_path, "dana").exists()
    first = AgentKey.generate("dana")
    write_person_key(tmp_path, first, PASSPHRASE)
    with pytest.raises(ConfigError, match="already has a key"):
        write_person_key(tmp_path, AgentKey.generate("dana"), PASSPHRASE)
    assert unlock_person_key(tmp_path, "dana", PASSPHRASE).public_key == first.public_key  # not overwritten
    AgentKey.load_or_create(tmp_path, "bot")
    with pytest.raises(ConfigError, match="a person needs a name of their own"):
        write_person_key(tmp_path, AgentKey.generate("bot"), PASSPHRASE)


def test_a_process_started_for_an_agent_will_not_run_as_a_person(tmp_path: Path) -> None:
    write_person_key(tmp_path, AgentKey.generate("dana"), PASSPHRASE)
    with pytest.raises(ConfigError, match="dana is a person's identity: it signs only at the CLI"):
        AgentKey.load_or_create(tmp_path, "dana")
    assert not (tmp_path / "keys" / "dana.nk").exists()  # no agent key was made under a person's name


def enrolment(identity: Identity | None, *roles: Role) -> Enrolment:
    return Enrolment(
        agent_id="rita",
        public_key=AgentKey.generate("rita").public_key,
        owner="rita",
        roles=roles,
        projects=("*",),
        enrolled_by="tests",
        enrolled_at=datetime(2026, 1, 1, tzinfo=UTC),
        identity=identity,
    )


def test_only_a_person_holds_the_reviewer_role() -> None:
    assert enrolment(Identity.person, Role.reviewer).is_person
    with pytest.raises(ValidationError, match="rita is an agent identity and only a person may hold the reviewer"):
        enrolment(Identity.agent, Role.agent, Role.reviewer)
    # A record written before identities had a kind still reads (an agent's; it reviews for no person).
    assert not enrolment(None, Role.reviewer).is_person
