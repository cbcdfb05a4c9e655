"""`epibus certs DIR`, run as a user runs it: the files it writes, read back with `cryptography` and checked as
a TLS peer checks them, and what it refuses."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from bus.errors import ConfigError
from epibus.fleet.certs import generate, planned_files

SERVERS = ("nats-1", "nats-2", "nats-3")


def certs(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")}
    return subprocess.run(
        [sys.executable, "-m", "epibus", "certs", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def san_of(cert: x509.Certificate) -> list[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [*san.get_values_for_type(x509.DNSName), *map(str, san.get_values_for_type(x509.IPAddress))]


def usages_of(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_certs_writes_a_ca_a_pair_per_server_and_the_client_pair(tmp_path: Path) -> None:
    out = tmp_path / "deploy" / "certs"
    result = certs(str(out), "--hosts", "nats.example.org, 10.1.2.3", "--days", "30", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    expected = planned_files(out, SERVERS)
    assert [Path(f["path"]) for f in report["files"]] == expected
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in expected), "stray files in DIR"

    assert out.stat().st_mode & 0o777 == 0o700
    for path in expected:
        mode = path.stat().st_mode & 0o777
        assert mode == (0o600 if path.suffix == ".key" else 0o644), f"{path.name} has mode {mode:o}"

    ca = load_cert(out / "ca.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    for stem in (*SERVERS, "client"):
        cert = load_cert(out / f"{stem}.crt")
        cert.verify_directly_issued_by(ca)  # raises when the CA did not sign it
        key = serialization.load_pem_private_key((out / f"{stem}.key").read_bytes(), password=None)
        assert key.public_key() == cert.public_key(), f"{stem}.key is not the key of {stem}.crt"
        assert cert.not_valid_after_utc <= ca.not_valid_after_utc
        assert 29 <= (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 31

    for server in SERVERS:
        cert = load_cert(out / f"{server}.crt")
        assert sorted(san_of(cert)) == sorted([server, "localhost", "nats.example.org", "127.0.0.1", "10.1.2.3"])
        # Servers dial each other on routes: each certificate is presented as a client too.
        assert usages_of(cert) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    client = load_cert(out / "client.crt")
    assert usages_of(client) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    assert client.subject.rfc4514_string() == "CN=epibus,O=epibus"

    by_name = {Path(f["path"]).name: f for f in report["files"]}
    assert by_name["nats-2.key"]["mode"] == "0600"
    assert by_name["nats-2.crt"]["names"] == ["nats-2", "localhost", "nats.example.org", "127.0.0.1", "10.1.2.3"]
    assert by_name["ca.crt"]["not_after"] == ca.not_valid_after_utc.isoformat()


def test_certs_refuses_to_overwrite_without_force_and_replaces_everything_with_it(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    first = certs(str(out), "--servers", "a,b")
    assert first.returncode == 0, first.stderr
    for name in ("ca.crt", "a.key", "b.crt", "client.key"):
        assert name in first.stdout, f"the table does not show {name}:\n{first.stdout}"
    before = snapshot(out)

    again = certs(str(out), "--servers", "a,b")
    assert again.returncode == 1
    assert again.stderr.count("\n") == 1, again.stderr
    assert "already holds ca.key" in again.stderr
    assert "--force" in again.stderr
    assert snapshot(out) == before, "a refused run changed files"

    # A new server alone would still write a new CA and client pair over the old ones: refused too.
    assert certs(str(out), "--servers", "c").returncode == 1
    assert snapshot(out) == before

    forced = certs(str(out), "--servers", "a,b", "--force", "--json")
    assert forced.returncode == 0, forced.stderr
    after = snapshot(out)
    assert sorted(after) == sorted(before)
    assert all(after[name] != before[name] for name in before), "--force kept some old files"
    load_cert(out / "a.crt").verify_directly_issued_by(load_cert(out / "ca.crt"))
    assert (out / "ca.key").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"servers": ["ok", "bad/name"]}, "--servers: 'bad/name' is not a host name"),
        ({"servers": ["n1", "n1"]}, "--servers: names n1 more than once"),
        ({"servers": ["ca"]}, "--servers: 'ca' is taken"),
        ({"servers": []}, "--servers: names no server"),
        ({"hosts": ["not a host"]}, "--hosts: 'not a host' is neither an IP address nor a host name"),
        ({"days": 0}, "--days: 0 is out of range"),
    ],
)
def test_certs_refuses_bad_options_naming_the_option_and_writes_nothing(
    tmp_path: Path, options: dict[str, Any], says: str
) -> None:
    out = tmp_path / "certs"
    with pytest.raises(ConfigError) as refused:
        generate(out, **options)
    assert str(refused.value).startswith(says), refused.value
    assert not out.exists(), f"a refused run wrote {sorted(p.name for p in out.iterdir())}"


def test_ip_address_hosts_become_ip_entries_not_names(tmp_path: Path) -> None:
    # A client checking 10.0.0.7 matches an IP entry only; as a DNS name it would be refused.
    out = tmp_path / "certs"
    assert certs(str(out), "--servers", "n", "--hosts", "10.0.0.7,::1").returncode == 0
    san = load_cert(out / "n.crt").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("10.0.0.7"),
        ipaddress.ip_address("::1"),
    }
    assert "10.0.0.7" not in san.get_values_for_type(x509.DNSName)
