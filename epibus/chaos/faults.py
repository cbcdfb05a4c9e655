"""The faults `epibus chaos` injects: one vocabulary, with a line of help each (shown by `--help` and the docs)."""

from __future__ import annotations

from bus.errors import ConfigError

FAULTS: dict[str, str] = {
    "leader": "SIGKILL the event stream leader's nats-server (its node starts it again)",
    "follower": "SIGKILL a nats-server that holds a replica but does not lead (cluster only)",
    "node": "SIGKILL a whole node's process group; its nats-server must die with it (the supervisor restarts it)",
    "pause": "SIGSTOP the stream leader's nats-server for the fault's duration, then SIGCONT",
    "nats-down": "every nats-server down for the fault's duration (nodes paused so none restarts): outboxes hold",
    "observer": "kill a node in the middle of an observer batch: half of it written, none of it acknowledged",
    "mirror": "a node's vector store answers every call with Unavailable for the fault's duration",
    "partition": "cut one server off from the others (network namespaces) for the fault's duration (cluster only)",
}
CLUSTER_ONLY = frozenset({"follower", "partition"})
FAILPOINT_FAULTS = frozenset({"observer", "mirror"})  # they need nodes started with failpoints on


def parse_faults(text: str) -> tuple[str, ...]:
    """`all`, `none`, or names separated by commas, in the order given (each once). Raises ConfigError."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if names == ["all"]:
        return tuple(FAULTS)
    if names == ["none"]:
        return ()
    unknown = [name for name in names if name not in FAULTS]
    if unknown or not names:
        raise ConfigError(
            "--faults", f"{unknown[0] if unknown else text!r} is not a fault", allowed=["all", "none", *FAULTS]
        )
    return tuple(dict.fromkeys(names))
