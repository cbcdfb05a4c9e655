"""TLS for the NATS connection: which CA to trust and which client certificate to show, from the environment.

Read by `bus.client.connection.open_nats` each time it opens a connection; nats-py's own reconnects keep the context
the connection began with."""

from __future__ import annotations

import os
import ssl

from bus.errors import ConfigError

CA_ENV = "EPIBUS_NATS_CA"
CERT_ENV = "EPIBUS_NATS_CERT"
KEY_ENV = "EPIBUS_NATS_KEY"


def nats_tls_context() -> ssl.SSLContext | None:
    """The TLS context for NATS, or None when none of EPIBUS_NATS_CA, _CERT, _KEY is set (a `tls://` URL then
    trusts the system CAs). With a CA file only that CA is trusted; CERT and KEY (both or neither) are the client
    certificate a server with `verify: true` asks for. Raises ConfigError naming the setting and the fix."""
    ca, cert, key = (os.environ.get(name) or None for name in (CA_ENV, CERT_ENV, KEY_ENV))
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        given, missing = (CERT_ENV, KEY_ENV) if key is None else (KEY_ENV, CERT_ENV)
        raise ConfigError(given, f"is set but {missing} is not; set both (the client certificate and its key)")
    try:
        context = ssl.create_default_context(cafile=ca)
    except OSError as e:  # ssl.SSLError (not PEM, no certificate in it) is an OSError too
        raise ConfigError(CA_ENV, _problem(ca, e, "a PEM file holding the CA certificate")) from None
    if cert is not None and key is not None:
        for name, path in ((CERT_ENV, cert), (KEY_ENV, key)):
            _check_readable(name, path)
        try:
            context.load_cert_chain(cert, key)
        except OSError as e:
            raise ConfigError(
                f"{CERT_ENV}/{KEY_ENV}", _problem(f"{cert} with {key}", e, "a PEM certificate and its own key")
            ) from None
    return context


def _check_readable(setting: str, path: str) -> None:
    # load_cert_chain names neither file nor cause when one cannot be opened; say which and why.
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ConfigError(setting, _problem(path, e, "a file readable by the user epibus runs as")) from None


def _problem(what: str | None, error: BaseException, wanted: str) -> str:
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return f"cannot use {what}: {type(error).__name__} {reason}; it must be {wanted}"
