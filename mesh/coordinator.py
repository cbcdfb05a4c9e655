"""The coordinator service (ECO): follows a project's proposals, decides them through a pluggable policy, and
expires tasks whose deadline passed. Every decision is a signed, journaled step naming the coordinator and the
policy that made it.

Decisions reuse a message id derived from the proposal's own, so a restarted coordinator that sees the same
proposal again sends the same message (idempotent), and a coordinator that loses a race to another gets an
IllegalTransition, which is counted, not retried."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from bus.broker.loops import run_together
from bus.broker.nats_errors import RETRYABLE
from bus.errors import ConfigError, Conflict, Forbidden, IllegalTransition, InvalidEvent, NotFound
from bus.intake.cursor import Cursor
from bus.model.ids import derived_event_id
from mesh.agent import MeshAgent
from mesh.store import TaskEntry
from mesh.task import TaskRecord
from mesh.vocab import ActionCategory, TaskAction, TaskState
from mesh.watch import agent_watcher

log = logging.getLogger(__name__)
OPEN_STATES = frozenset({TaskState.proposed, TaskState.accepted, TaskState.working})


@dataclass(frozen=True)
class Decision:
    action: Literal["accept", "decline"]
    assignee: str | None = None
    reason: str | None = None


class Policy(Protocol):
    """How a coordinator decides a proposal."""

    name: str

    async def decide(self, record: TaskRecord, mesh: MeshAgent) -> Decision | None:
        """A decision, or None to leave the proposal to a person (`epibus mesh accept|decline|change`)."""


class ManualPolicy:
    """A person decides every proposal with the CLI; the service only expires overdue tasks."""

    name = "manual"

    async def decide(self, record: TaskRecord, mesh: MeshAgent) -> Decision | None:
        return None


class CapabilityMatchPolicy:
    """Accept when an agent advertises every capability the proposal needs (among the targeted agents, if
    any), choosing the one with the fewest open tasks; decline, with the reason, when none does."""

    name = "capability-match"

    async def decide(self, record: TaskRecord, mesh: MeshAgent) -> Decision | None:
        assignee = await match_assignee(record, mesh)
        if assignee is not None:
            return Decision("accept", assignee=assignee)
        needed = record.proposal.targets.capabilities
        if not needed and not record.proposal.targets.agents:
            return None  # nothing to match on: a person decides
        return Decision("decline", reason=f"no agent advertises the capabilities {list(needed)}")


class AutoAcceptPolicy:
    """Accept proposals of the given action categories when an assignee is clear (one targeted agent, or a
    capability match); leave everything else to a person."""

    def __init__(self, categories: Sequence[ActionCategory]) -> None:
        self.categories = frozenset(categories)
        self.name = "auto-accept:" + ",".join(sorted(self.categories))

    async def decide(self, record: TaskRecord, mesh: MeshAgent) -> Decision | None:
        if record.proposal.category not in self.categories:
            return None
        assignee = await match_assignee(record, mesh)
        return Decision("accept", assignee=assignee) if assignee is not None else None


async def match_assignee(record: TaskRecord, mesh: MeshAgent) -> str | None:
    """The one targeted agent; else the least-loaded agent that is targeted (if any are) and advertises every
    capability needed; None when nobody qualifies or there is nothing to match on."""
    targets = record.proposal.targets
    needed = frozenset(targets.capabilities)
    if not needed and len(targets.agents) <= 1:
        return targets.agents[0] if targets.agents else None
    if needed:
        advertised = await mesh.store.all_capabilities()
        candidates = [a for a, caps in advertised.items() if needed <= frozenset(caps)]
        if targets.agents:
            candidates = [a for a in candidates if a in targets.agents]
    else:
        candidates = list(targets.agents)
    if not candidates:
        return None
    load = Counter(
        e.record.assignee
        for e in await mesh.store.tasks(record.proposal.project)
        if e.record.state in (TaskState.accepted, TaskState.working)
    )
    return min(candidates, key=lambda a: (load[a], a))


POLICIES = ("manual", "auto-accept", "capability-match")


def parse_policy(spec: str) -> Policy:
    """`manual`, `capability-match` or `auto-accept:<category>[,<category>…]`. Raises ConfigError."""
    name, _, arg = spec.partition(":")
    if name == "manual" and not arg:
        return ManualPolicy()
    if name == "capability-match" and not arg:
        return CapabilityMatchPolicy()
    if name == "auto-accept":
        allowed = [c.value for c in ActionCategory]
        chosen = [c.strip() for c in (arg or "operational").split(",") if c.strip()]
        unknown = [c for c in chosen if c not in allowed]
        if unknown:
            raise ConfigError("policy", f"auto-accept category {unknown[0]!r} is unknown", allowed=allowed)
        return AutoAcceptPolicy([ActionCategory(c) for c in chosen])
    raise ConfigError(
        "policy", f"{spec!r} is not a policy", allowed=["manual", "auto-accept:<categories>", "capability-match"]
    )


@dataclass
class CoordinatorStats:
    decided: Counter[str] = field(default_factory=Counter)
    left_to_person: int = 0
    lost_races: int = 0
    expired: int = 0
    sweep_errors: int = 0
    refused: int = 0  # decisions the mesh refused (e.g. this agent is no longer a coordinator)


class Coordinator:
    """`async with` or `run()`: decide one project's proposals with `policy`, expire overdue tasks."""

    def __init__(
        self,
        mesh: MeshAgent,
        project: str,
        policy: Policy,
        *,
        cursor: Cursor | None = None,
        sweep_interval_s: float = 1.0,
        poll_timeout_s: float = 1.0,
    ) -> None:
        self.mesh = mesh
        self.project = project
        self.policy = policy
        self.sweep_interval_s = sweep_interval_s
        self.stats = CoordinatorStats()
        self.watcher = agent_watcher(
            mesh,
            self._on_revision,
            name=f"coordinator:{mesh.agent}:{project}",
            project=project,
            cursor=cursor,
            poll_timeout_s=poll_timeout_s,
        )

    async def check(self) -> None:
        """Raise Forbidden unless this agent coordinates the project: only coordinators decide."""
        coordinators = await self.mesh.coordinators(self.project)
        if self.mesh.agent not in coordinators:
            raise Forbidden(
                self.mesh.agent,
                "coordinate",
                f"project {self.project}",
                f"it is not among its coordinators ({', '.join(coordinators) or 'none'}); "
                f"add it with `epibus mesh coordinators add --project {self.project} {self.mesh.agent}`",
            )

    async def run(self) -> None:
        await self.check()
        await run_together(
            {
                f"coordinator {self.project} watcher": self.watcher.run(),
                f"coordinator {self.project} sweep": self._sweep_forever(),
            }
        )

    async def _on_revision(self, entry: TaskEntry) -> None:
        record = entry.record
        if record.state is not TaskState.proposed or record.last_step.action is not TaskAction.propose:
            return
        decision = await self.policy.decide(record, self.mesh)
        if decision is None:
            self.stats.left_to_person += 1
            return
        message_id = derived_event_id(record.last_step.message_id, f"decision:{self.mesh.agent}")
        try:
            if decision.action == "accept":
                await self.mesh.accept(
                    record.task_id,
                    assignee=decision.assignee,
                    project=self.project,
                    policy=self.policy.name,
                    message_id=message_id,
                )
            else:
                assert decision.reason is not None
                await self.mesh.decline(
                    record.task_id,
                    decision.reason,
                    project=self.project,
                    policy=self.policy.name,
                    message_id=message_id,
                )
        except IllegalTransition as e:
            self.stats.lost_races += 1  # another coordinator decided first, or the deadline passed
            log.info("coordinator %s: %s", self.mesh.agent, e)
            return
        except (Forbidden, Conflict, InvalidEvent, NotFound) as e:
            # No longer a coordinator, a replayed decision the policy now makes differently, a policy's pick
            # the protocol refuses: the proposal stays for a person; counted and logged, the service goes on.
            self.stats.refused += 1
            log.warning("coordinator %s: decision on task %s refused: %s", self.mesh.agent, record.task_id, e)
            return
        self.stats.decided[decision.action] += 1

    async def _sweep_forever(self) -> None:
        while True:
            try:
                await self.sweep()
            except RETRYABLE as e:
                self.stats.sweep_errors += 1
                log.warning("coordinator %s: deadline sweep failed (%s); trying again", self.mesh.agent, e)
            await asyncio.sleep(self.sweep_interval_s)

    async def sweep(self) -> int:
        """Expire every open task of the project whose deadline passed. Returns how many it expired."""
        now = self.mesh.clock()
        expired = 0
        for entry in await self.mesh.store.tasks(self.project):
            deadline = entry.record.proposal.deadline
            if entry.record.state not in OPEN_STATES or deadline is None or deadline > now:
                continue
            message_id = derived_event_id(entry.record.last_step.message_id, f"expire:{self.mesh.agent}")
            try:
                await self.mesh.expire(entry.record.task_id, project=self.project, message_id=message_id)
            except (IllegalTransition, NotFound) as e:
                log.info("coordinator %s: %s", self.mesh.agent, e)  # it moved on meanwhile
                continue
            except (Forbidden, Conflict, InvalidEvent) as e:
                self.stats.refused += 1
                log.warning("coordinator %s: expiring task %s refused: %s", self.mesh.agent, entry.record.task_id, e)
                continue
            expired += 1
        self.stats.expired += expired
        return expired
