"""epibus: the shared, durable, searchable memory of a fleet of AI agents, built as an event bus.

The public names load on first use (a module `__getattr__`), so `import epibus` and the command line's lean
paths (`epibus statusline`) do not pay for NATS, pydantic and SQLAlchemy until a name needs them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from epibus.layers import require_own_layers

# The layers are installed under short top-level names (bus, observers, mesh): fail here, in words, if another
# package by one of those names would be imported in their place.
require_own_layers()

if TYPE_CHECKING:
    from bus.client.client import EpibusClient, connect
    from bus.client.consume import Consumer, Received
    from bus.errors import (
        ConfigError,
        Conflict,
        EpibusError,
        Forbidden,
        IllegalTransition,
        InvalidEvent,
        ModelMismatch,
        NotFound,
        Unavailable,
    )
    from bus.intake.cursor import FileCursor, MemoryCursor
    from bus.model.event import Envelope
    from bus.model.kinds import Body, Evidence, register_kind
    from bus.model.vocab import EpistemicSource, ReceiptLevel, ResolutionKind, Reversibility, Trust
    from bus.outbox.publish import Receipt
    from epibus import sync
    from epibus.node.node import Node, NodeConfig
    from mesh.agent import MeshAgent, Outcome
    from mesh.coordinator import Coordinator, parse_policy
    from mesh.inbox import Inbox, Notification
    from observers import reads
    from observers.journal import EventQuery, Journal, JournalRow

# Where each public name lives: (module, attribute), attribute None for a module itself.
_WHERE: dict[str, tuple[str, str | None]] = {
    **{name: ("bus.client.client", name) for name in ("EpibusClient", "connect")},
    **{name: ("bus.client.consume", name) for name in ("Consumer", "Received")},
    **{name: ("bus.intake.cursor", name) for name in ("FileCursor", "MemoryCursor")},
    **{
        name: ("bus.errors", name)
        for name in (
            "ConfigError",
            "Conflict",
            "EpibusError",
            "Forbidden",
            "IllegalTransition",
            "InvalidEvent",
            "ModelMismatch",
            "NotFound",
            "Unavailable",
        )
    },
    "Envelope": ("bus.model.event", "Envelope"),
    **{name: ("bus.model.kinds", name) for name in ("Body", "Evidence", "register_kind")},
    "Receipt": ("bus.outbox.publish", "Receipt"),
    **{
        name: ("bus.model.vocab", name)
        for name in ("EpistemicSource", "ReceiptLevel", "ResolutionKind", "Reversibility", "Trust")
    },
    "sync": ("epibus.sync", None),
    **{name: ("epibus.node.node", name) for name in ("Node", "NodeConfig")},
    **{name: ("mesh.agent", name) for name in ("MeshAgent", "Outcome")},
    **{name: ("mesh.coordinator", name) for name in ("Coordinator", "parse_policy")},
    **{name: ("mesh.inbox", name) for name in ("Inbox", "Notification")},
    "reads": ("observers.reads", None),
    **{name: ("observers.journal", name) for name in ("EventQuery", "Journal", "JournalRow")},
}

__all__ = [
    "Body",
    "ConfigError",
    "Conflict",
    "Consumer",
    "Coordinator",
    "Envelope",
    "EpibusClient",
    "EpibusError",
    "EpistemicSource",
    "EventQuery",
    "Evidence",
    "FileCursor",
    "Forbidden",
    "IllegalTransition",
    "Inbox",
    "InvalidEvent",
    "Journal",
    "JournalRow",
    "MemoryCursor",
    "MeshAgent",
    "ModelMismatch",
    "Node",
    "NodeConfig",
    "NotFound",
    "Notification",
    "Outcome",
    "Receipt",
    "ReceiptLevel",
    "Received",
    "ResolutionKind",
    "Reversibility",
    "Trust",
    "Unavailable",
    "connect",
    "parse_policy",
    "reads",
    "register_kind",
    "sync",
]


def __getattr__(name: str) -> Any:
    try:
        module_name, attribute = _WHERE[name]
    except KeyError:
        raise AttributeError(f"module 'epibus' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
