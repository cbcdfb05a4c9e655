"""Where a client connects and as whom: the servers (a given URL, or the running local node found in the home
and followed if it moves), the agent's key in the home, the outbox file, whether the client only outboxes (no
node runs), and whether a key the server refuses is enrolled locally first."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from bus.client.enrol import enrol_locally
from bus.host.home import (
    NodeFollower,
    default_agent,
    epibus_home,
    explicit_nats_url,
    outbox_path,
    read_node_info,
    resolve_nats_url,
    split_servers,
)
from bus.identity.signing import AgentKey


@dataclass(frozen=True)
class Placement:
    home: Path
    servers: list[str]
    key: AgentKey
    outbox: Path | None
    follow: NodeFollower | None
    offline: bool
    given_key: bool = False  # a key handed in (a person's) is enrolled by an admin, never on first connect

    @classmethod
    def find(
        cls,
        nats_url: str | None,
        *,
        agent: str | None,
        home: Path | str | None,
        outbox: bool | Path,
        offline_without_node: bool,
        key: AgentKey | None = None,
    ) -> Placement:
        """Raises ConfigError with no URL given and no node running, unless `offline_without_node`. `key`: sign
        with this key (a person's, unlocked) instead of the agent's key in the home."""
        where = epibus_home(home)
        explicit = explicit_nats_url(nats_url)
        box = outbox_path(where) if outbox is True else (outbox or None)
        offline = offline_without_node and explicit is None and box is not None and read_node_info(where) is None
        servers = [] if offline else split_servers(resolve_nats_url(explicit, where))
        follow = NodeFollower(where, servers) if explicit is None and not offline else None
        signer = key or AgentKey.load_or_create(where, agent or default_agent())
        return cls(where, servers, signer, box, follow, offline, given_key=key is not None)

    def local_enrolment(self) -> Callable[[], Awaitable[object]] | None:
        """Agents under a node's home are enrolled with the node's key on first connect, unless the node runs
        with auto-enrolment off (`epibus up --no-auto-enrol`) or EPIBUS_AUTO_ENROL=0."""
        if self.given_key:
            return None
        info = read_node_info(self.home)
        if (info is not None and not info.auto_enrol) or os.environ.get("EPIBUS_AUTO_ENROL", "1") == "0":
            return None
        servers, home, key = self.servers, self.home, self.key
        return lambda: enrol_locally(servers, home, key)
