"""What brings a node back: its embedded nats-server started again when it exits, and all its services
restarted when the server closes the node's connection for good."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from bus.errors import ConfigError, Unavailable, error_summary
from bus.host.server import NatsServer
from epibus.node.connection import NodeConnection

log = logging.getLogger(__name__)


class Recovery:
    """Counts what it restarted (`connection_restarts`, `server_restarts`: the node's health reports them)."""

    def __init__(
        self, connection: NodeConnection, stop: Callable[[], Awaitable[None]], start: Callable[[], Awaitable[None]]
    ) -> None:
        self.connection = connection
        self.stop = stop  # the node's services
        self.start = start
        self.connection_restarts = 0
        self.server_restarts = 0

    async def watch_server(self, server: NatsServer) -> None:
        """The embedded server is the node's: if it exits, say so once and start it again on the same ports
        (its file store keeps what was fsynced; clients reconnect to the same URL)."""
        while True:
            await asyncio.sleep(1.0)
            if server.running():
                continue
            self.server_restarts += 1
            log.error("embedded nats-server exited (%s); restarting it on %s", server.exit_code, server.url)
            try:
                await asyncio.to_thread(server.start)
            except (Unavailable, ConfigError) as e:  # ConfigError: another process took its port meanwhile
                log.error("embedded nats-server did not restart: %s; trying again", e)

    async def recover_lost_connections(self) -> None:
        """Each time the connection is closed for good, stop every service and start them again (retried with
        backoff until they start)."""
        delay_s = 1.0
        while True:
            await self.connection.wait_until_lost()
            self.connection_restarts += 1
            nc = self.connection.nc
            reason = nc.last_error if nc is not None else None
            log.error("the node's NATS connection closed for good (%s); restarting its services", reason)
            while True:
                try:
                    await self.stop()
                    await self.start()
                    delay_s = 1.0
                    break
                except Exception as e:  # noqa: BLE001 - the node must come back: logged, retried with backoff
                    log.error("restarting the node's services failed: %s; retrying in %.0fs", error_summary(e), delay_s)
                    await asyncio.sleep(delay_s)
                    delay_s = min(delay_s * 2, 30.0)
