"""The client's view of a project before it changes state: the project folded from the stream, or only the
artifacts a decision reads, and the tombstone registry the pre-publish checks ask (one per connection)."""

from __future__ import annotations

import logging

from nats.js import JetStreamContext

from bus.connection import Connection
from bus.event import Envelope
from bus.knowledge import ProjectView, TombstoneRegistry, load_artifact, load_project

log = logging.getLogger(__name__)


class ProjectViews:
    """Views read on `connection`, with the agent registry it keeps."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._tombstones: TombstoneRegistry | None = None
        self._tombstones_js: JetStreamContext | None = None

    async def project(self, project: str) -> ProjectView:
        """The project folded from the stream now (the client's view for validating state changes)."""
        return await load_project(self.connection.js, project, self.connection.registry)

    async def for_change(self, event: Envelope) -> ProjectView:
        """What deciding `event` reads: the artifacts it names and those they link to, read from their own
        subjects (a cost that does not grow with the project), or the whole project when the decision reads
        what only its fold knows (`bus.knowledge.load_artifact`)."""
        read = await load_artifact(self.connection.js, event, self.connection.registry)
        if read.view is not None:
            return read.view
        log.debug(
            "folding project %s to decide %s on %s: %s",
            event.project,
            event.kind,
            event.artifact_id,
            read.whole_project,
        )
        return await self.project(event.project)

    @property
    def tombstones(self) -> TombstoneRegistry:
        js = self.connection.js
        if self._tombstones is None or self._tombstones_js is not js:
            self._tombstones, self._tombstones_js = TombstoneRegistry(js), js
        return self._tombstones
