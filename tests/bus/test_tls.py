"""EPIBUS_NATS_CA / _CERT / _KEY: the TLS context every NATS connection is opened with, and one-line errors
naming the setting for each way they can be wrong. (A connection through it to a TLS cluster is in
tests/deploy/test_tls_cluster.py.)"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import cast

import pytest

from bus.errors import ConfigError
from bus.host.tls import CA_ENV, CERT_ENV, KEY_ENV, nats_tls_context
from epibus.fleet.certs import generate


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    generate(tmp_path / "certs", servers=["n1"])
    return tmp_path / "certs"


@pytest.fixture(autouse=True)
def no_tls_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (CA_ENV, CERT_ENV, KEY_ENV):
        monkeypatch.delenv(name, raising=False)


def test_without_settings_there_is_no_context() -> None:
    assert nats_tls_context() is None


def test_the_ca_setting_trusts_that_ca_alone_and_checks_host_names(
    certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CA_ENV, str(certs / "ca.crt"))
    context = nats_tls_context()
    assert context is not None
    # A subject is a tuple of relative names, each a tuple of (attribute, value) pairs.
    subjects = [cast("tuple[tuple[tuple[str, str], ...], ...]", ca["subject"]) for ca in context.get_ca_certs()]
    assert [dict(x[0] for x in subject)["commonName"] for subject in subjects] == ["epibus CA"]
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname is True


def test_an_empty_setting_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CA_ENV, "")
    assert nats_tls_context() is None


@pytest.mark.parametrize(("given", "missing"), [(CERT_ENV, KEY_ENV), (KEY_ENV, CERT_ENV)])
def test_a_client_certificate_needs_both_settings(
    given: str, missing: str, certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(given, str(certs / "client.crt"))
    with pytest.raises(ConfigError) as refused:
        nats_tls_context()
    assert str(refused.value).startswith(f"{given}: is set but {missing} is not"), refused.value


def test_a_missing_ca_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CA_ENV, str(tmp_path / "nowhere.crt"))
    with pytest.raises(ConfigError) as refused:
        nats_tls_context()
    message = str(refused.value)
    assert message.startswith(f"{CA_ENV}: cannot use {tmp_path / 'nowhere.crt'}: FileNotFoundError"), message
    assert "\n" not in message


def test_a_ca_file_that_holds_no_certificate_is_named(certs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CA_ENV, str(certs / "ca.key"))  # a key where the certificate belongs
    with pytest.raises(ConfigError) as refused:
        nats_tls_context()
    assert str(refused.value).startswith(f"{CA_ENV}: cannot use {certs / 'ca.key'}: SSLError"), refused.value


def test_an_unreadable_key_is_named_with_its_path(certs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CERT_ENV, str(certs / "client.crt"))
    monkeypatch.setenv(KEY_ENV, str(certs))  # a directory: cannot be read as a file, even by root
    with pytest.raises(ConfigError) as refused:
        nats_tls_context()
    assert str(refused.value).startswith(f"{KEY_ENV}: cannot use {certs}: IsADirectoryError"), refused.value


def test_a_key_that_is_not_the_certificates_own_is_refused(certs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CA_ENV, str(certs / "ca.crt"))
    monkeypatch.setenv(CERT_ENV, str(certs / "client.crt"))
    monkeypatch.setenv(KEY_ENV, str(certs / "n1.key"))
    with pytest.raises(ConfigError) as refused:
        nats_tls_context()
    message = str(refused.value)
    assert message.startswith(f"{CERT_ENV}/{KEY_ENV}: cannot use {certs / 'client.crt'} with {certs / 'n1.key'}")
    assert "KEY_VALUES_MISMATCH" in message, message
