"""Pushing notices: each claim the mirror indexes is matched against the node's book of watches and every match
is published to its owner's notices, deduplicated by the server on watch id + event id, so several nodes pushing
the same match leave one notice. A claim that stops being trusted after a push sends a follow-up to everyone it
was pushed to; a forgotten claim's notices are erased from the stream."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from nats.js import JetStreamContext
from pydantic import ValidationError

from bus.broker.nats_errors import message_gone, nats_call
from bus.errors import EpibusError, Unavailable
from bus.intake.stream_read import read_stream
from bus.model.auth import ReviewPolicy
from bus.model.review import review_status, withheld
from bus.model.state import UNSAFE_RESOLUTIONS, UNSAFE_TRUST, ArtifactState
from bus.model.watch import Notice, WatchRecord
from bus.outbox.outbox_file import OutboxRow
from bus.outbox.publish import send_batch
from bus.subjects import WATCH_STREAM, notice_subject, parse_notice_subject, pushed_filter
from observers.mirror.listener import IndexedClaim
from observers.watch.match import WatchBook

log = logging.getLogger(__name__)
MSG_ID_HEADER = "Nats-Msg-Id"
MAX_PUBLISHING = 64  # follow-up notices in flight at once
MATCHES_IN_FLIGHT = 1024  # a batch's notices are pipelined: one claim may reach hundreds of watches
PUSH_TIMEOUT_S = 30.0


@dataclass
class PushStats:
    claims: int = 0  # claims matched against the book
    matched: int = 0
    pushed: int = 0  # notices the stream stored
    duplicates: int = 0  # notices another node (or an earlier delivery) had pushed already
    follow_ups: int = 0
    erased: int = 0  # notices of forgotten claims erased
    unreadable: int = 0  # stored notices a follow-up could not read (logged)
    withheld: int = 0  # matches not pushed: the project's policy withholds the claim until a person reviews it
    match_s: float = 0.0  # time spent in the matrix products


class WatchPusher:
    """The mirror's listener for watches (observers.mirror.listener.MirrorListener)."""

    def __init__(
        self,
        js: Callable[[], JetStreamContext],
        book: WatchBook,
        *,
        node: str,
        policy: Callable[[str], ReviewPolicy | None] | None = None,
    ) -> None:
        self._js = js
        self.book = book
        self.node = node
        # A project's review policy (blocking: read in a thread): a claim the safe door withholds until a person
        # reviews it is pushed only to audit watches.
        self._policy = policy
        self.stats = PushStats()
        self._publishing = asyncio.Semaphore(MAX_PUBLISHING)

    async def indexed(self, claims: Sequence[IndexedClaim]) -> None:
        if not claims or not len(self.book):
            return
        started = time.perf_counter()
        matches = self.book.match(claims, datetime.now(UTC))
        self.stats.match_s += time.perf_counter() - started
        self.stats.claims += len(claims)
        self.stats.matched += len(matches)
        policies = await self._policies({m.claim.state.project for m in matches})
        rows = []
        for m in matches:
            policy = policies.get(m.claim.state.project)
            review = review_status(m.claim.state, policy)
            if not m.watch.audit and withheld(review, policy):
                self.stats.withheld += 1
                continue  # withheld from the safe door until a person reviews it
            notice = _notice("match", m.watch, m.claim.state, m.claim.event_id, m.score, self.node, review)
            subject = notice_subject(m.watch.owner_key, m.watch.watch_id, notice.project, notice.artifact_id)
            # The row's id is the message id the server deduplicates on: watch id + event id.
            rows.append(OutboxRow(f"{m.watch.watch_id}.{notice.event_id}", subject, notice.model_dump_json().encode()))
        results = await send_batch(self._js(), rows, max_in_flight=MATCHES_IN_FLIGHT, timeout_s=PUSH_TIMEOUT_S)
        failed = [result for result in results.values() if isinstance(result, EpibusError)]
        stored = [result for result in results.values() if not isinstance(result, EpibusError)]
        self.stats.duplicates += sum(1 for ack in stored if ack.duplicate)
        self.stats.pushed += sum(1 for ack in stored if not ack.duplicate)
        if failed:  # the mirror's batch is held and delivered again: what was stored is then a duplicate
            raise failed[0]

    async def _policies(self, projects: set[str]) -> dict[str, ReviewPolicy | None]:
        if self._policy is None or not projects:
            return {}
        read = self._policy
        return await asyncio.to_thread(lambda: {project: read(project) for project in projects})

    async def changed(self, states: Sequence[ArtifactState]) -> None:
        """A follow-up to every watch a claim was pushed to, once it is no longer trusted (an audit watch is
        told too: it was told the claim when it was trusted)."""
        if not len(self.book):
            return  # no watch left to tell: no stream lookups on the mirror's path
        for state in states:
            untrusted = state.trust in UNSAFE_TRUST or state.resolution in UNSAFE_RESOLUTIONS
            if not untrusted or state.forgotten:
                continue  # still trusted (a stale or superseded claim is not refuted), or erased by forget
            for subject, earlier in (await self._pushed(state.project, state.artifact_id)).items():
                address = parse_notice_subject(subject)
                watch = self.book.get(address.watch_id) if address is not None else None
                if watch is None or earlier.notice != "match":
                    continue  # a stopped or expired watch, or a follow-up already
                notice = _notice("no_longer_trusted", watch, state, earlier.event_id, earlier.score, self.node)
                await self._push(watch, notice, f"{earlier.event_id}.{state.last_seq}")
                self.stats.follow_ups += 1

    async def forgotten(self, artifacts: Sequence[tuple[str, str]]) -> None:
        await self.erase(artifacts)

    async def erase(self, artifacts: Sequence[tuple[str, str]]) -> int:
        """Erase every notice of a forgotten claim from the stream (its text was in them): `delete_msg` overwrites
        the bytes, so forget's scan of the store's files finds none; a purge would leave them on disk. Returns
        how many this call erased (another node may have erased the rest). Idempotent."""
        js = self._js()
        erased = 0
        for project, artifact_id in artifacts:
            if not await self.notices_left(project, artifact_id):
                continue
            seqs: list[int] = []
            async for batch in read_stream(js, WATCH_STREAM, filter_subject=pushed_filter(project, artifact_id)):
                seqs += [msg.metadata.sequence.stream for msg in batch]
            for seq in seqs:
                try:
                    async with nats_call(f"erasing notice {seq} of {project}/{artifact_id}"):
                        await js.delete_msg(WATCH_STREAM, seq)
                except Unavailable as e:
                    if e.__cause__ is not None and message_gone(e.__cause__):
                        continue  # erased meanwhile (another node forgot it too)
                    raise
                erased += 1
        self.stats.erased += erased
        return erased

    async def notices_left(self, project: str, artifact_id: str) -> int:
        """Notices about the artifact the stream still holds, whoever they were pushed to (forget's proof)."""
        return sum((await self._pushed_subjects(project, artifact_id)).values())

    async def _pushed_subjects(self, project: str, artifact_id: str) -> dict[str, int]:
        """Each subject holding notices about the artifact, with how many."""
        async with nats_call(f"the notices of {project}/{artifact_id}"):
            info = await self._js().stream_info(WATCH_STREAM, subjects_filter=pushed_filter(project, artifact_id))
        return dict(info.state.subjects or {})

    async def _pushed(self, project: str, artifact_id: str) -> dict[str, Notice]:
        """The last notice on each subject about the artifact, whoever it was pushed to."""
        found: dict[str, Notice] = {}
        for subject in sorted(await self._pushed_subjects(project, artifact_id)):
            async with nats_call(f"a notice on {subject}"):
                msg = await self._js().get_last_msg(WATCH_STREAM, subject)
            try:
                found[subject] = Notice.model_validate_json(msg.data or b"")
            except ValidationError as e:  # only nodes publish there: one this node cannot read is counted, not fatal
                self.stats.unreadable += 1
                log.error("notice on %s (seq %s) is unreadable: %s", subject, msg.seq, str(e).splitlines()[0])
        return found

    async def _push(self, watch: WatchRecord, notice: Notice, dedupe: str) -> None:
        subject = notice_subject(watch.owner_key, watch.watch_id, notice.project, notice.artifact_id)
        headers = {MSG_ID_HEADER: f"{watch.watch_id}.{dedupe}"}  # a fresh dict per publish: nats-py writes into it
        async with self._publishing, nats_call(f"pushing a notice of watch {watch.watch_id}"):
            ack = await self._js().publish(subject, notice.model_dump_json().encode(), stream=WATCH_STREAM,
                                           headers=headers)  # fmt: skip
        if ack.duplicate:
            self.stats.duplicates += 1
        else:
            self.stats.pushed += 1


def _notice(
    kind: str,
    watch: WatchRecord,
    state: ArtifactState,
    event_id: str,
    score: float,
    node: str,
    review: str | None = None,
) -> Notice:
    return Notice.model_validate(
        {
            "notice": kind,
            "watch_id": watch.watch_id,
            "about": watch.about,
            "event_id": event_id,
            "project": state.project,
            "kind": state.kind,
            "artifact_id": state.artifact_id,
            "score": round(score, 4),
            "text": state.content,
            "author": state.author,
            "trust": state.trust.value,
            "lifecycle": state.lifecycle.value,
            "resolution": state.resolution.value if state.resolution is not None else None,
            "recorded_at": state.created_at,
            "review": review,
            "node": node,
        }
    )
