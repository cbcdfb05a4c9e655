"""`epibus doctor` for a node of a fleet across machines: its certificates (valid, not near expiry), every
member's reachability (its heartbeat, which crosses the hub) and clock (the time its signed heartbeat states,
against ours). Only read: nothing is repaired."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from nats.js import JetStreamContext

from bus.broker.presence import HEARTBEAT_S, live_nodes
from bus.errors import Unavailable
from epibus.fleet.certs import CA_NAME
from epibus.fleet.hub import HUB_CERT, FleetRoster
from epibus.fleet.invites import FLEET_DIR
from epibus.fleet.join import NODE_CERT, load_leaf
from epibus.ops.doctor_local import FAIL, OK, WARN, Check

EXPIRY_WARN = timedelta(days=30)
SKEW_WARN_S = 1.0


def fleet_role(home: Path) -> str | None:
    """ "hub", "leaf" or None (a node of no fleet)."""
    if load_leaf(home) is not None:
        return "leaf"
    return "hub" if (home / FLEET_DIR / f"{HUB_CERT}.crt").exists() else None


def certificate_checks(home: Path, *, now: datetime | None = None) -> list[Check]:
    """The fleet CA's and this node's certificates: readable, in force, and not expiring within 30 days."""
    role = fleet_role(home)
    if role is None:
        return []
    moment = now or datetime.now(UTC)
    own = HUB_CERT if role == "hub" else NODE_CERT
    return [_certificate(home / FLEET_DIR / f"{stem}.crt", moment) for stem in (CA_NAME, own)]


def _certificate(path: Path, now: datetime) -> Check:
    name = f"certificate {path.name}"
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as e:
        return Check(name, FAIL, f"{path} cannot be read ({e})", "join again with a new invite (a new --home)")
    until = cert.not_valid_after_utc
    if until <= now:
        return Check(name, FAIL, f"expired at {until:%Y-%m-%d}", "rotate: `epibus fleet remove` it, invite it again")
    if until - now < EXPIRY_WARN:
        days = (until - now).days
        return Check(name, WARN, f"expires in {days} days ({until:%Y-%m-%d})", "rotate it before: remove, invite again")
    return Check(name, OK, f"valid until {until:%Y-%m-%d}")


async def member_checks(js: JetStreamContext, *, now: datetime | None = None) -> list[Check]:
    """Each active member: reachable (its heartbeat reached the hub's bucket lately) and its clock in step (the
    time its last heartbeat states is no further from ours than one heartbeat period plus a second)."""
    try:
        members = [m for m in await FleetRoster(js).members() if m.active]
        live = await live_nodes(js)
    except Unavailable as e:
        return [Check("fleet", FAIL, f"the fleet's members cannot be read ({e})", "is the hub reachable from here?")]
    if not members:
        return []
    moment = now or datetime.now(UTC)
    checks: list[Check] = []
    for member in members:
        name = f"fleet node {member.name}"
        beat = live.nodes.get(member.name)
        if beat is None:
            why = live.why or "no heartbeat within the last seconds"
            checks.append(Check(name, FAIL, f"unreachable ({member.host}): {why}", "start it, or check its network"))
            continue
        age_s = (moment - beat.at).total_seconds()
        if age_s < -SKEW_WARN_S or age_s > HEARTBEAT_S + 3 + SKEW_WARN_S:
            side = "ahead of" if age_s < 0 else "behind"
            detail = f"reachable; its clock is about {abs(age_s):.1f}s {side} this machine's"
            checks.append(Check(name, WARN, detail, "synchronise the clocks (chrony or systemd-timesyncd)"))
            continue
        checks.append(Check(name, OK, f"reachable ({member.role}, {member.host}), clock in step"))
    return checks
