"""The node's safety net for the mesh: every task step in the bucket reaches the stream as its event, and every
change's counter-proposal task exists, even when the agent that asked for the step (or the node that wrote it)
stopped right after the KV write. Steps are signed by their actors (mesh.task.Step.signature), so the recorder
republishes them verbatim and cannot be used to forge one: its watcher verifies every revision (mesh.trust),
and one that is not trustworthy is quarantined (`watcher.stats.untrusted`), never published."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from nats.js import JetStreamContext

from bus.broker.nats_errors import JS_TIMEOUT_S
from bus.broker.streams import ensure_streams
from bus.errors import Conflict, InvalidEvent, MalformedRecord
from bus.intake.cursor import Cursor
from bus.model.event import Envelope
from bus.outbox.outbox_file import OutboxRow
from bus.outbox.publish import send_one
from mesh.events import step_event
from mesh.store import MeshStore, TaskEntry, ensure_counter_task
from mesh.task import Step
from mesh.vocab import TaskAction
from mesh.watch import TaskWatcher

log = logging.getLogger(__name__)


@dataclass
class RecorderStats:
    published: int = 0
    duplicates: int = 0  # already on the stream (the agent published it): the usual case
    children_created: int = 0
    refused: int = 0  # published nowhere, or its counter-proposal not created: logged with the reason


class MeshRecorder:
    """Follows every task revision from a cursor and publishes the step each revision added."""

    def __init__(
        self,
        js: Callable[[], JetStreamContext],
        *,
        cursor: Cursor | None = None,
        closed: Callable[[], bool] | None = None,
    ) -> None:
        self._js = js
        self.stats = RecorderStats()
        self.watcher = TaskWatcher(js, self._on_revision, cursor=cursor, closed=closed, name="mesh-recorder")
        self._streams_ready = False

    async def run(self) -> None:
        await self.watcher.run()

    async def _on_revision(self, entry: TaskEntry) -> None:
        record = entry.record  # verified by the watcher
        index = len(record.steps) - 1  # each write adds exactly one step
        step = record.steps[index]
        event = step_event(record, index)
        try:
            await self._publish(event)
        except InvalidEvent as e:  # JetStream refused it (e.g. over the stream's message size): kept in KV
            self.stats.refused += 1
            log.error("mesh recorder: revision %d of task %s refused: %s", entry.revision, record.task_id, e)
            return
        if step.action is TaskAction.change and step.child_id is not None:
            await self._ensure_child(entry, step)

    async def _ensure_child(self, entry: TaskEntry, step: Step) -> None:
        """Create the change's counter-proposal task if its coordinator stopped first. An unreadable child
        record (MalformedRecord) goes to the watcher's quarantine."""
        store = MeshStore(self._js())
        record = entry.record
        try:
            if await store.get_task(record.proposal.project, step.child_id or "") is None:
                await ensure_counter_task(store, step)
                self.stats.children_created += 1
        except MalformedRecord:
            raise
        except (InvalidEvent, Conflict) as e:  # a change without a counter-proposal, or another child under its id
            self.stats.refused += 1
            log.error(
                "mesh recorder: revision %d of task %s: counter-proposal not created: %s",
                entry.revision,
                record.task_id,
                e,
            )

    async def _publish(self, event: Envelope) -> None:
        """Publish with the event id as Nats-Msg-Id: a step its agent already published is a duplicate."""
        js = self._js()
        if not self._streams_ready:
            await ensure_streams(js)
            self._streams_ready = True
        row = OutboxRow.of(event)
        ack = await send_one(js, row, timeout_s=JS_TIMEOUT_S)
        if ack.duplicate:
            self.stats.duplicates += 1
        else:
            self.stats.published += 1
