"""Following task revisions in the mesh bucket from a cursor (a listener that hits errors says
so loudly and keeps its state; an empty poll never resets what was seen). Every revision is verified before it
is handed over (mesh.trust): one that cannot be read or trusted is quarantined and skipped past.

The watcher reads the bucket's stream in revision order from `last_seen + 1` with an ephemeral consumer. It
hands each revision to its handler once, then advances (and saves) the cursor; a revision at or below the
cursor is never handed over again. A lost connection, a restarted server or a vanished consumer makes it
re-subscribe from the cursor, so nothing is missed: the bucket keeps every revision of a task (history 64)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bus.broker.polling import Poller, fetch_batch
from bus.errors import ConfigError, MalformedRecord
from bus.intake.consumers import pull_consumer
from bus.intake.cursor import Cursor, MemoryCursor
from bus.intake.follow import ResumingSubscription, resume_config
from bus.intake.stream_read import last_matching
from bus.model.records import Quarantine
from bus.subjects import MESH_STREAM, kv_subject_key, tasks_key_filter
from mesh.store import MeshStore, TaskEntry, is_value
from mesh.trust import UntrustedRecord

if TYPE_CHECKING:
    from mesh.agent import MeshAgent

log = logging.getLogger(__name__)


@dataclass
class WatchStats:
    handled: int = 0
    skipped_seen: int = 0  # revisions at or below the cursor that a new consumer delivered again
    empty_polls: int = 0
    errors: int = 0
    quarantined: int = 0  # records that could not be understood or trusted, skipped past (see the quarantine)
    untrusted: int = 0  # of those, records that decode but are not trustworthy (a forged or unsigned step...)
    resubscribed: int = 0
    last_error: str | None = None


Handler = Callable[[TaskEntry], Awaitable[None]]


class TaskWatcher(ResumingSubscription):
    """Hands every task revision after the cursor to `handler`, in revision order, once."""

    check_every_s = 5.0  # an idle watcher confirms its consumer still exists this often

    def __init__(
        self,
        js: Callable[[], JetStreamContext],
        handler: Handler,
        *,
        project: str | None = None,
        cursor: Cursor | None = None,
        batch_size: int = 256,
        poll_timeout_s: float = 1.0,
        name: str = "mesh-watch",
        closed: Callable[[], bool] | None = None,
        store: Callable[[], MeshStore] | None = None,
    ) -> None:
        super().__init__()
        self._js = js
        self._closed = closed or (lambda: False)  # True once the connection is closed for good
        self.handler = handler
        self.project = project
        self.cursor = cursor or MemoryCursor()
        self.last_seen = self.cursor.load()
        self.batch_size = batch_size
        self.poll_timeout_s = poll_timeout_s
        self.name = name
        self.stats = WatchStats()
        self.quarantine = Quarantine(name)
        self.label = name
        self._store: MeshStore | None = None
        self._shared_store = store  # an agent's own store: what the watcher verifies, the agent decides on

    def _store_for(self, js: JetStreamContext) -> MeshStore:
        if self._shared_store is not None:
            return self._shared_store()
        if self._store is None or self._store.js is not js:
            self._store = MeshStore(js)
        return self._store

    async def run(self) -> None:
        poller = Poller(self.name, recover=self._recover, closed=self._closed, consequence="resuming after the cursor")
        await poller.forever(self.step)

    async def _recover(self, error: BaseException, failures_in_a_row: int) -> None:
        self.stats.errors += 1
        self.stats.last_error = f"{type(error).__name__}: {error}"
        await self._drop_subscription()

    async def step(self) -> int:
        """One poll: hand over what arrived. Returns how many revisions were handled (0 = nothing new)."""
        subscription = await self._subscribe()
        messages = await fetch_batch(subscription, self.batch_size, self.poll_timeout_s)
        if not messages:  # the cursor stays
            self.stats.empty_polls += 1
            await self._confirm_consumer(subscription)
            return 0
        handled = 0
        for msg in messages:
            revision = msg.metadata.sequence.stream
            if revision <= self.last_seen:
                self.stats.skipped_seen += 1
                continue
            if is_value(msg) and await self._hand_over(msg, revision):
                handled += 1
            self.last_seen = revision
            self.cursor.save(revision)
        self.stats.handled += handled
        self._checked_at = time.monotonic()
        return handled

    async def _hand_over(self, msg: Msg, revision: int) -> bool:
        """Hand one revision to the handler. A record that cannot be understood (this one, or one the handler
        read for it, like a roster or a counter-proposal) is quarantined instead: left in the bucket for
        inspection, counted, logged once, and the cursor moves past it, so no record can stop a watcher."""
        try:
            entry = await self._store_for(self._js()).verified_task(
                msg.data, key=kv_subject_key(msg.subject), revision=revision
            )
            await self.handler(entry)
        except MalformedRecord as e:
            if self.quarantine.add(e):
                self.stats.quarantined += 1
                self.stats.untrusted += isinstance(e, UntrustedRecord)
            return False
        return True

    async def _subscribe(self) -> JetStreamContext.PullSubscription:
        if self._subscription is None:
            js = self._js()
            await self._store_for(js).bucket()  # a watcher may start before anyone wrote: the bucket must exist
            await self._check_cursor(js)
            config = resume_config(tasks_key_filter(self.project), self.last_seen)
            self._subscription = await pull_consumer(js, MESH_STREAM, config)
            self.stats.resubscribed += 1
        return self._subscription

    async def _check_cursor(self, js: JetStreamContext) -> None:
        """A cursor past the bucket's last revision means the bucket was reset (a new server, a wiped store):
        waiting for revisions that will never come would look like an empty inbox, so it is an error."""
        if self.last_seen == 0:
            return
        # the newest revision the watcher could have seen: a direct get, which the broker scopes to an agent's keys
        newest = await last_matching(js, MESH_STREAM, tasks_key_filter(self.project))
        if self.last_seen > newest:
            raise ConfigError(
                "cursor",
                f"{self.name} resumes after revision {self.last_seen}, but the mesh bucket's newest task revision "
                f"is {newest}: it was reset; start the watcher over (--reset, or a new --out file)",
            )


def agent_watcher(
    mesh: MeshAgent,
    handler: Handler,
    *,
    name: str,
    project: str | None = None,
    cursor: Cursor | None = None,
    poll_timeout_s: float = 1.0,
) -> TaskWatcher:
    """A watcher on `mesh`'s connection (followed across reconnects) that verifies records with its store."""
    return TaskWatcher(
        lambda: mesh.client.js,
        handler,
        closed=lambda: mesh.client.closed,
        store=lambda: mesh.store,
        project=project,
        cursor=cursor,
        poll_timeout_s=poll_timeout_s,
        name=name,
    )
