"""Helpers the tests share: waiting without sleeping blindly, and reading stores back by another path."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar, overload

import nats
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from sqlalchemy import text

from bus.client import enrol
from bus.identity.signing import AgentKey, node_event_key, node_key
from bus.model.auth import Enrolment
from bus.model.requests import EnrolRequest, build_request
from bus.model.vocab import Identity, Role
from bus.services.enrolments import record_enrolment
from observers.journal_engine import make_engine

T = TypeVar("T")


NATS_ENV = frozenset({"NATS_URL", "NATS_CREDS"})  # what the NATS tools read, and epibus too: never the caller's


def cli_env(home: Path, *, columns: int | None = None) -> dict[str, str]:
    """The environment of an `epibus` command run for `home`: none of the caller's EPIBUS_ settings leak in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_") and k not in NATS_ENV}
    env |= {"EPIBUS_HOME": str(home)}
    return env | ({"COLUMNS": str(columns)} if columns is not None else {})


def run_epibus(
    home: Path,
    *args: str,
    check: bool = True,
    timeout_s: float = 60,
    columns: int | None = None,
    stdin_text: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """`epibus ARGS` as a user runs it, in its own process, with no stdin (or `stdin_text` piped in). `check`:
    fail the test on a non-zero exit, naming the command and what it printed. `columns`: a terminal width (wide,
    so no table cell folds)."""
    stdin = {"input": stdin_text} if stdin_text is not None else {"stdin": subprocess.DEVNULL}
    result = subprocess.run(
        [sys.executable, "-m", "epibus", *args],
        env=cli_env(home, columns=columns),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        **stdin,
    )
    if check:
        assert result.returncode == 0, (
            f"epibus {' '.join(args)} exited {result.returncode}: {result.stdout}{result.stderr}"
        )
    return result


def last_json(result: subprocess.CompletedProcess[str]) -> Any:
    """The last line of a command's stdout as parsed JSON (what `--json` prints last)."""
    return json.loads(result.stdout.strip().splitlines()[-1])


# What a check returns once it holds is truthy, so never None: `X | None` comes back as X.
@overload
async def eventually(
    check: Callable[[], Awaitable[T | None]], *, timeout_s: float = ..., interval_s: float = ...
) -> T: ...


@overload
async def eventually(check: Callable[[], T | None], *, timeout_s: float = ..., interval_s: float = ...) -> T: ...


async def eventually(check: Callable[[], Any], *, timeout_s: float = 10.0, interval_s: float = 0.05) -> Any:
    """Poll `check` until it returns something truthy; fail with its last value after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s; last value: {result!r}")
        await asyncio.sleep(interval_s)


def journal_event_ids(url: str, project: str) -> list[str]:
    """Event ids in the journal for a project, by plain SQL (not through the Journal class), with repeats."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT event_id FROM events WHERE project = :p"), {"p": project})
            return [row[0] for row in rows]
    finally:
        engine.dispose()


def missing_and_extra(expected: set[str], found: list[str]) -> dict[str, Any]:
    """What a store lacks, what it has that nobody published, and what it has twice."""
    seen: set[str] = set()
    doubled = {x for x in found if x in seen or seen.add(x)}  # type: ignore[func-returns-value]
    return {
        "missing": sorted(expected - set(found)),
        "extra": sorted(set(found) - expected),
        "doubled": sorted(doubled),
    }


def eventually_sync(check: Callable[[], T | None], *, timeout_s: float = 10.0, interval_s: float = 0.1) -> T:
    """`eventually` for tests that drive subprocesses without an event loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s; last value: {result!r}")
        time.sleep(interval_s)


def journal_rows_of_kind(url: str, project: str, kind: str) -> list[tuple[str, dict[str, Any], str, str]]:
    """(event_id, body, actor, status) of a project's events of one kind, in stream order, by plain SQL."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT event_id, envelope, actor_id, status FROM events "
                    "WHERE project = :p AND kind = :k ORDER BY stream_seq"
                ),
                {"p": project, "k": kind},
            )
            return [(r[0], json.loads(r[1])["body"], r[2], r[3]) for r in rows]
    finally:
        engine.dispose()


def start_node_process(
    home: Path, *up_args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """`epibus up --json` as a user runs it (no EPIBUS_* from the caller's environment but the home and `env`),
    and the status line it prints once it runs. Fails with the node's stderr if it exits instead."""
    own = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_") and k not in NATS_ENV}
    own |= {"EPIBUS_HOME": str(home)}
    process = subprocess.Popen(
        [sys.executable, "-m", "epibus", "up", "--json", *up_args],
        env=own | (env or {}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, f"`epibus up` exited with {process.poll()}: {process.stderr.read() if process.stderr else ''}"
    return process, json.loads(line)


def stop_node_process(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def operator_credentials(home: Path) -> dict[str, Any]:
    """nats-py connect options for the operator of the node under `home` (its node key): what a raw client
    needs to reach a node that authenticates, for tests that write what no agent may (forged dead letters)."""
    return node_key(home).nats_credentials


def identity_for(roles: list[Role]) -> Identity:
    """A test's identity for these roles: a reviewer is a person (only persons may be), anyone else an agent."""
    return Identity.person if Role.reviewer in roles else Identity.agent


async def enrol_agent(url: str, home: Path, agent: AgentKey, *, roles: list[Role], projects: list[str]) -> None:
    """Enrol `agent` with these roles and projects, signed by the operator of the node under `home` (the node's
    key): what `epibus agent add` does. Returns once the agent's key connects (a client refused at its first
    connect would enrol itself again with the defaults)."""
    admin = node_key(home)
    nc = await nats.connect(url, **admin.nats_credentials)
    try:
        request = build_request(
            EnrolRequest,
            agent_id=agent.agent_id,
            public_key=agent.public_key,
            projects=projects,
            roles=roles,
            identity=identity_for(roles),
        )
        await enrol.enrol(nc, admin, request)
    finally:
        await nc.close()

    async def connects() -> bool:
        try:
            probe = await nats.connect(url, allow_reconnect=False, connect_timeout=2, **agent.nats_credentials)
        except (nats.errors.Error, OSError, TimeoutError):
            return False
        await probe.close()
        return True

    await eventually(connects)


async def enrol_on_stream(
    js: JetStreamContext,
    key: AgentKey,
    *roles: Role,
    owner: str | None = None,
    projects: tuple[str, ...] = ("*",),
    revoked: bool = False,
) -> int:
    """Record an enrolment on the stream as a node records `epibus agent add` (signed by a node identity of its
    own): on a server without authentication, the agent holds these roles, owner and projects from the returned
    stream sequence on. Roles default to agent."""
    at = datetime.now(UTC)
    enrolment = Enrolment(
        agent_id=key.agent_id,
        public_key=key.public_key,
        owner=owner or key.agent_id,
        roles=roles or (Role.agent,),
        projects=projects,
        enrolled_by="tests",
        enrolled_at=at,
        revoked_at=at if revoked else None,
    )
    return await record_enrolment(js, node_event_key(AgentKey.generate("node")), enrolment, session_id="tests")


def headers_of(msg: Msg) -> dict[str, str]:
    """A message's headers, which a dead letter always carries (each names its reason)."""
    assert msg.headers is not None, f"a message on {msg.subject} without headers"
    return msg.headers
