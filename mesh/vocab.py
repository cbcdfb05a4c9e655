"""The mesh's closed vocabularies, each value with its one-line help: where a task stands, what an agent does to
it, how much a piece of work can change, and who an agent is to a task. The only module that defines them."""

from __future__ import annotations

from enum import StrEnum

from bus.model.vocab import register_help


class TaskState(StrEnum):
    """Where a mesh task stands; terminal states have no exit."""

    proposed = "proposed"
    accepted = "accepted"
    working = "working"
    completed = "completed"
    acknowledged = "acknowledged"
    declined = "declined"
    changed = "changed"
    failed = "failed"
    canceled = "canceled"
    expired = "expired"


class TaskAction(StrEnum):
    """A mesh protocol message: what an agent does to a task."""

    propose = "propose"
    accept = "accept"
    decline = "decline"
    change = "change"
    start = "start"
    complete = "complete"
    fail = "fail"
    cancel = "cancel"
    acknowledge = "acknowledge"
    expire = "expire"


class ActionCategory(StrEnum):
    """How much a proposed piece of work can change, which coordinator policies key on."""

    operational = "operational"
    tactical = "tactical"
    strategic = "strategic"
    irreversible = "irreversible"


class MeshRole(StrEnum):
    """Who an agent is to a task."""

    proposer = "proposer"
    coordinator = "coordinator"
    assignee = "assignee"


register_help(
    TaskState,
    {
        "proposed": "waiting for a coordinator's decision",
        "accepted": "a coordinator accepted it and named the assignee",
        "working": "the assignee started it",
        "completed": "done, with a commit SHA; waiting for the proposer's acknowledgement",
        "acknowledged": "the proposer closed the handshake; terminal",
        "declined": "a coordinator declined it, with a reason; terminal",
        "changed": "a coordinator counter-proposed a linked new task instead; terminal",
        "failed": "the assignee gave up, with a reason; terminal",
        "canceled": "withdrawn by its proposer or a coordinator; terminal",
        "expired": "its deadline passed before it was decided or completed; terminal",
    },
)

register_help(
    TaskAction,
    {
        "propose": "a peer proposes work to a project's coordinators",
        "accept": "a coordinator accepts a proposal and names the assignee",
        "decline": "a coordinator declines a proposal (reason required)",
        "change": "a coordinator counter-proposes: a new proposal linked to this one",
        "start": "the assignee starts accepted work",
        "complete": "the assignee finishes, with a commit SHA (40 or 64 lowercase hex)",
        "fail": "the assignee gives up (reason required)",
        "cancel": "the proposer or a coordinator withdraws the task",
        "acknowledge": "the proposer confirms a completion, closing the handshake",
        "expire": "a coordinator closes a task whose deadline passed",
    },
)

register_help(
    ActionCategory,
    {
        "operational": "routine work inside current plans (restart, rerun, small fix)",
        "tactical": "changes how a goal is reached (refactor, new dependency)",
        "strategic": "changes what the goals are",
        "irreversible": "cannot be undone (deleting data, publishing, spending)",
    },
)

register_help(
    MeshRole,
    {
        "proposer": "the agent that proposed the task",
        "coordinator": "an agent registered to decide the project's work",
        "assignee": "the agent a coordinator gave the work to",
    },
)
