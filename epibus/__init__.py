"""epibus: the shared, durable, searchable memory of a fleet of AI agents, built as an event bus."""

from bus.client import EpibusClient, connect
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
from bus.event import Body, Envelope, Evidence, register_kind
from bus.publish import Receipt
from bus.vocab import EpistemicSource, ReceiptLevel, ResolutionKind, Reversibility, Trust
from epibus import sync
from epibus.node import Node, NodeConfig
from mesh.agent import MeshAgent, Outcome
from mesh.coordinator import Coordinator, parse_policy
from mesh.peer import Inbox, Notification
from observers import reads
from observers.journal import EventQuery, Journal, JournalRow

__all__ = [
    "Body",
    "ConfigError",
    "Conflict",
    "Coordinator",
    "Envelope",
    "EpibusClient",
    "EpibusError",
    "EpistemicSource",
    "EventQuery",
    "Evidence",
    "Forbidden",
    "IllegalTransition",
    "Inbox",
    "InvalidEvent",
    "Journal",
    "JournalRow",
    "MeshAgent",
    "ModelMismatch",
    "Node",
    "NodeConfig",
    "NotFound",
    "Notification",
    "Outcome",
    "Receipt",
    "ReceiptLevel",
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
