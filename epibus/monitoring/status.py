"""The node's status snapshot, `<home>/status.json`, which `epibus statusline` reads on every shell prompt
without connecting to anything: the node's name and pid, when it was written, each local agent's inbox and
pending acknowledgements per project, and each project's open unknowns.

The figures come from the rules every other reader uses: `mesh.inbox.inbox_reason` (as `epibus mesh inbox`),
`mesh.protocol.awaits_acknowledgement` with the agent as proposer (as `epibus mesh pending`), and
`observers.reads.open_unknown_counts` (what a briefing lists as open unknowns). The mesh is followed, not
re-listed: a TaskWatcher from revision 0 in memory (each revision verified) keeps every task's latest record;
rosters and advertised capabilities are re-read every CONTEXT_REFRESH_S, as an inbox does."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext

from bus.errors import EpibusError
from bus.host.home import write_private
from bus.intake.cursor import MemoryCursor
from bus.services.enrolments import local_agent_keys
from epibus.monitoring.statusline import KEEP_ALIVE_S, STATUS_FILE, STATUS_FORMAT, WRITE_EVERY_S
from mesh.inbox import CONTEXT_REFRESH_S, capabilities_of, coordinators_of, inbox_reason
from mesh.protocol import awaits_acknowledgement
from mesh.store import MeshStore, TaskEntry
from mesh.task import TaskRecord
from mesh.watch import TaskWatcher
from observers.journal import Journal
from observers.reads import open_unknown_counts

log = logging.getLogger(__name__)
AgentFigures = dict[str, dict[str, dict[str, int]]]  # agent -> "inbox" | "ack" -> project -> count


class MeshView:
    """Every task's latest verified record, and what the inbox rule needs besides: who coordinates each
    project and what each agent advertises."""

    def __init__(self, js: Callable[[], JetStreamContext], *, closed: Callable[[], bool]) -> None:
        self._js = js
        self.records: dict[tuple[str, str], TaskRecord] = {}
        self.watcher = TaskWatcher(js, self._keep, cursor=MemoryCursor(), closed=closed, name="status")
        self._store: MeshStore | None = None
        self._coordinators: dict[str, frozenset[str]] = {}
        self._capabilities: dict[str, frozenset[str]] = {}
        self._context_at = float("-inf")
        self._changes = 0  # counts every new record and context read, so unchanged figures are not recounted
        self._counted: tuple[int, tuple[str, ...], AgentFigures] | None = None

    @property
    def caught_up(self) -> bool:
        """Whether the watcher has read to the end of the bucket at least once (an empty poll)."""
        return self.watcher.stats.empty_polls > 0

    async def _keep(self, entry: TaskEntry) -> None:
        record = entry.record  # verified by the watcher
        self.records[(record.proposal.project, record.task_id)] = record
        self._changes += 1

    def _store_for(self) -> MeshStore:
        js = self._js()
        if self._store is None or self._store.js is not js:
            self._store = MeshStore(js)
        return self._store

    async def _refresh(self, agents: tuple[str, ...]) -> None:
        """Re-read rosters and capabilities every CONTEXT_REFRESH_S; read new projects' and agents' at once."""
        if time.monotonic() - self._context_at > CONTEXT_REFRESH_S:
            self._coordinators.clear()
            self._capabilities.clear()
            self._context_at = time.monotonic()
        store = self._store_for()
        while missing := {project for project, _ in self.records} - self._coordinators.keys():
            for project in missing:  # the watcher may bring new projects while these are read
                self._coordinators[project] = await coordinators_of(store, project)
                self._changes += 1
        for agent in set(agents) - self._capabilities.keys():
            self._capabilities[agent] = await capabilities_of(store, agent)
            self._changes += 1

    async def figures(self, agents: tuple[str, ...]) -> AgentFigures:
        """Each agent's inbox and pending acknowledgements per project. Raises Unavailable."""
        await self._refresh(agents)
        if self._counted is not None and self._counted[:2] == (self._changes, agents):
            return self._counted[2]
        found: AgentFigures = {}
        for agent in agents:
            inbox: Counter[str] = Counter()
            ack: Counter[str] = Counter()
            capabilities = self._capabilities[agent]
            for (project, _), record in self.records.items():
                coordinates = agent in self._coordinators[project]
                why = inbox_reason(agent, record, coordinates=coordinates, capabilities=capabilities)
                inbox[project] += why is not None
                ack[project] += awaits_acknowledgement(record, agent)
            found[agent] = {"inbox": _nonzero(inbox), "ack": _nonzero(ack)}
        self._counted = (self._changes, agents, found)
        return found


def _nonzero(counts: Counter[str]) -> dict[str, int]:
    return {project: n for project, n in sorted(counts.items()) if n}


class StatusWriter:
    """Writes the snapshot every WRITE_EVERY_S when a figure changed, and every KEEP_ALIVE_S regardless."""

    def __init__(
        self,
        home: Path,
        node: str,
        js: Callable[[], JetStreamContext],
        journal: Journal,
        *,
        connected: Callable[[], bool],
        closed: Callable[[], bool],
    ) -> None:
        self.home = home
        self.node = node
        self._js = js
        self.journal = journal
        self._connected = connected
        self._closed = closed
        self.writes = 0
        self._failures: list[str] = []
        self.view = MeshView(js, closed=closed)

    async def run(self) -> None:
        """Write until cancelled. The view's watcher runs as its own supervised task (see Node)."""
        written: dict[str, Any] | None = None
        written_at = float("-inf")
        while True:
            figures = await self.figures(self.view)
            if figures != written or time.monotonic() - written_at >= KEEP_ALIVE_S:
                snapshot = {"format": STATUS_FORMAT, "node": self.node, "pid": os.getpid()} | figures
                snapshot["written_at"] = datetime.now(UTC).isoformat()
                write_private(self.home / STATUS_FILE, json.dumps(snapshot, sort_keys=True))
                written, written_at = figures, time.monotonic()
                self.writes += 1
            await asyncio.sleep(WRITE_EVERY_S)

    async def figures(self, view: MeshView) -> dict[str, Any]:
        """What the snapshot says besides who wrote it and when. A figure that cannot be had now is null,
        with the reason among `problems` (a failed read is logged once, when it first fails)."""
        problems: list[str] = []
        failures: list[str] = []
        agents = tuple(agent for agent, _ in local_agent_keys(self.home / "keys"))
        mesh: AgentFigures | None = None
        if not self._connected():
            problems.append("mesh: the node is not connected to NATS")
        elif not view.caught_up:
            problems.append("mesh: still reading the bucket")
        else:
            try:
                mesh = await view.figures(agents)
            except EpibusError as e:
                failures.append(f"mesh: {e}")
        unknowns: dict[str, int] | None = None
        try:
            unknowns = await asyncio.to_thread(open_unknown_counts, self.journal)
        except EpibusError as e:
            failures.append(f"journal: {e}")
        for failure in set(failures) - set(self._failures):
            log.warning("status snapshot: %s", failure)
        self._failures = failures
        problems += failures
        return {
            "agents": mesh,
            "unknowns": unknowns,
            "quarantined": view.watcher.stats.quarantined,
            "problems": problems,
        }
