"""Certificates for a NATS cluster with TLS: a private CA, a certificate per server and one for the epibus node.

Every server certificate is both a server and a client certificate: a route is a TLS connection that each
server of the cluster opens to the others, and with `verify: true` each side must show one the CA signed.
Keys are ECDSA P-256, written owner-only; certificates are public."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bus.errors import ConfigError
from bus.host.home import write_private

DEFAULT_SERVERS = ("nats-1", "nats-2", "nats-3")  # the NATS services of docker-compose.yml
DEFAULT_DAYS = 365
MAX_DAYS = 3650
CA_NAME = "ca"
CLIENT_NAME = "client"  # client.crt / client.key: the certificate the epibus node connects with
CLIENT_CN = "epibus"
LOCAL_NAMES: tuple[str, ...] = ("localhost", "127.0.0.1")  # every server also answers on loopback
# A clock a little behind the machine that signs must not see a certificate from the future.
BACKDATE = timedelta(minutes=5)

_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOSTNAME = re.compile(rf"(?:\*\.)?{_LABEL}(?:\.{_LABEL})*", flags=re.IGNORECASE)
_SERVER_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*", flags=re.IGNORECASE)


@dataclass(frozen=True)
class WrittenFile:
    path: Path
    holds: str  # "CA key", "server certificate", ...
    mode: int
    subject: str
    names: tuple[str, ...]  # subject alternative names (certificates only)
    not_after: datetime | None  # certificates only

    def as_json(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "holds": self.holds,
            "mode": f"{self.mode:04o}",
            "subject": self.subject,
            "names": list(self.names),
            "not_after": self.not_after.isoformat() if self.not_after else None,
        }


def planned_files(directory: Path, servers: Sequence[str]) -> list[Path]:
    """Every file `generate` writes into directory, in the order it writes them."""
    stems = [CA_NAME, *servers, CLIENT_NAME]
    return [directory / f"{stem}.{ext}" for stem in stems for ext in ("key", "crt")]


def generate(
    directory: Path,
    *,
    servers: Sequence[str] = DEFAULT_SERVERS,
    hosts: Sequence[str] = (),
    days: int = DEFAULT_DAYS,
    force: bool = False,
) -> list[WrittenFile]:
    """Write a new CA, a key and certificate per server, and the client's, into directory (made mode 0700).
    Refuses, writing nothing, when a file it would write exists and force is False. Raises ConfigError."""
    servers = _server_names(servers)
    _alt_names(hosts)  # refuse a bad --hosts before anything is written
    if not 1 <= days <= MAX_DAYS:
        raise ConfigError("--days", f"{days} is out of range: certificates last 1 to {MAX_DAYS} days")
    if directory.exists() and not directory.is_dir():
        raise ConfigError("DIR", f"{directory} exists and is not a directory")
    existing = [p.name for p in planned_files(directory, servers) if p.exists()]
    if existing and not force:
        raise ConfigError(
            "DIR",
            f"{directory} already holds {', '.join(existing)}; pass --force to replace them "
            "(certificates signed by the old CA then stop being trusted, so restart every server and client)",
        )
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)

    now = datetime.now(UTC).replace(microsecond=0)
    not_before, not_after = now - BACKDATE, now + timedelta(days=days)
    written: list[WrittenFile] = []

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = _name("epibus CA")
    ca_cert = (
        _builder(ca_subject, ca_subject, ca_key.public_key(), not_before, not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    written += _write_pair(directory, CA_NAME, "CA", ca_key, ca_cert)

    for server in servers:
        names = _alt_names([server, *LOCAL_NAMES, *hosts])
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]  # routes: both ends
        written += _write_pair(directory, server, "server", *_leaf(server, names, usages, ca_key, ca_cert))
    client = _leaf(CLIENT_CN, [], [ExtendedKeyUsageOID.CLIENT_AUTH], ca_key, ca_cert)
    written += _write_pair(directory, CLIENT_NAME, "client", *client)
    return written


def _leaf(
    common_name: str,
    names: list[x509.GeneralName],
    usages: list[x509.ObjectIdentifier],
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    *,
    not_after: datetime | None = None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    until = ca_cert.not_valid_after_utc if not_after is None else not_after
    builder = (
        _builder(_name(common_name), ca_cert.subject, key.public_key(), ca_cert.not_valid_before_utc, until)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )  # fmt: skip
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    not_before: datetime,
    not_after: datetime,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "epibus"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def _write_pair(
    directory: Path, stem: str, role: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate
) -> list[WrittenFile]:
    key_path, cert_path = directory / f"{stem}.key", directory / f"{stem}.crt"
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_private(key_path, pem_key.decode())
    write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM).decode())
    os.chmod(cert_path, 0o644)  # public: a container user other than the owner may read it
    subject = cert.subject.rfc4514_string()
    return [
        WrittenFile(key_path, f"{role} key", 0o600, subject, (), None),
        WrittenFile(cert_path, f"{role} certificate", 0o644, subject, _shown_names(cert), cert.not_valid_after_utc),
    ]


def _shown_names(cert: x509.Certificate) -> tuple[str, ...]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return tuple(str(v) for v in san.get_values_for_type(x509.DNSName)) + tuple(
        str(v) for v in san.get_values_for_type(x509.IPAddress)
    )


def _server_names(servers: Sequence[str]) -> list[str]:
    names = [s.strip() for s in servers if s.strip()]
    if not names:
        raise ConfigError("--servers", "names no server; give the cluster's server host names, comma-separated")
    for name in names:
        if not _SERVER_NAME.fullmatch(name):
            raise ConfigError("--servers", f"{name!r} is not a host name (letters, digits, '-' and '.')")
        if name.lower() in (CA_NAME, CLIENT_NAME):
            raise ConfigError("--servers", f"{name!r} is taken by the {name.lower()} files; name the server otherwise")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError("--servers", f"names {', '.join(repeated)} more than once")
    return names


def _alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """Each host as an IP address or DNS name entry, in order, without repeats."""
    out: list[x509.GeneralName] = []
    for host in (h.strip() for h in hosts):
        if not host:
            continue
        entry: x509.GeneralName
        try:
            entry = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            if not _HOSTNAME.fullmatch(host):
                raise ConfigError("--hosts", f"{host!r} is neither an IP address nor a host name") from None
            entry = x509.DNSName(host.lower())
        if entry not in out:
            out.append(entry)
    return out


# A fleet's own CA: made once by the node that invites others, under <home>/fleet. Every node's certificate is
# both a server and a client certificate: a leaf connection is TLS from the joining node to the inviting one.
FLEET_CA_DAYS = 3650


def fleet_authority(directory: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The fleet CA kept in `directory` (ca.key, ca.crt), made at the first call. Raises ConfigError when the
    files are there but unreadable."""
    key_path, cert_path = directory / f"{CA_NAME}.key", directory / f"{CA_NAME}.crt"
    if key_path.exists() and cert_path.exists():
        try:
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        except (OSError, ValueError) as e:
            raise ConfigError(str(directory), f"the fleet CA cannot be read ({e}); restore it from a backup") from e
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ConfigError(str(key_path), "is not the fleet CA's EC key; restore it from a backup")
        return key, cert
    private_dir_of(directory)
    now = datetime.now(UTC).replace(microsecond=0)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _name("epibus fleet CA")
    cert = (
        _builder(subject, subject, key.public_key(), now - BACKDATE, now + timedelta(days=FLEET_CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write_pair(directory, CA_NAME, "CA", key, cert)
    return key, cert


def issue_node_certificate(
    directory: Path, name: str, hosts: Sequence[str], *, days: int = DEFAULT_DAYS
) -> tuple[str, str, int]:
    """A new key and certificate for node `name`, signed by the fleet CA in `directory`: (key PEM, certificate
    PEM, serial). Raises ConfigError."""
    ca_key, ca_cert = fleet_authority(directory)
    names = _alt_names([*_server_names([name]), *LOCAL_NAMES, *hosts])
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    until = min(ca_cert.not_valid_after_utc, datetime.now(UTC).replace(microsecond=0) + timedelta(days=days))
    key, cert = _leaf(name, names, usages, ca_key, ca_cert, not_after=until)
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    return pem_key, cert.public_bytes(serialization.Encoding.PEM).decode(), cert.serial_number


def private_dir_of(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
