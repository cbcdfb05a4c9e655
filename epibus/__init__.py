"""epibus: the shared, durable, searchable memory of a fleet of AI agents, built as an event bus."""

from bus.client import EpibusClient, connect
from bus.errors import (
    ConfigError,
    Conflict,
    EpibusError,
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
from observers import reads
from observers.journal import EventQuery, Journal, JournalRow

__all__ = [
    "Body",
    "ConfigError",
    "Conflict",
    "Envelope",
    "EpibusClient",
    "EpibusError",
    "EpistemicSource",
    "EventQuery",
    "Evidence",
    "IllegalTransition",
    "InvalidEvent",
    "Journal",
    "JournalRow",
    "ModelMismatch",
    "Node",
    "NodeConfig",
    "NotFound",
    "Receipt",
    "ReceiptLevel",
    "ResolutionKind",
    "Reversibility",
    "Trust",
    "Unavailable",
    "connect",
    "reads",
    "register_kind",
    "sync",
]
