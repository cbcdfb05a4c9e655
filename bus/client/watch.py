"""An agent's watches: standing questions registered with a node (one node of the group answers; every node with
a mirror matches), and the notices pushed to the agent, read from a sequence (the caller's cursor) through a
consumer a node opens on the agent's own notices."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from bus.broker.ask import ask_one
from bus.identity.signing import AgentKey
from bus.intake.cursor import LineLog
from bus.intake.follow import StreamFollower
from bus.model.requests import build_request
from bus.model.watch import (
    DEFAULT_THRESHOLD,
    DEFAULT_WATCH_DAYS,
    Notice,
    WatchListReply,
    WatchListRequest,
    WatchRegisterRequest,
    WatchReply,
    WatchStopReply,
    WatchStopRequest,
    WatchView,
)
from bus.subjects import WATCH_LIST, WATCH_REGISTER, WATCH_STOP, WATCH_STREAM, notices_filter, parse_notice_subject

log = logging.getLogger(__name__)
WATCH_TIMEOUT_S = 10.0  # a registration embeds the words on the node
POLL_IDLE_S = 1.5  # a poll that got notices ends when no other follows this soon


@dataclass(frozen=True)
class PushedNotice:
    """A notice as read, with its sequence in the notices' stream: the cursor to resume after."""

    seq: int
    notice: Notice


def decode_notice(subject: str, data: bytes) -> Notice:
    """A notice read from the stream. Raises ValueError (pydantic's ValidationError is one) for bytes that are no
    notice or a notice its subject does not address."""
    notice = Notice.model_validate_json(data)
    address = parse_notice_subject(subject)
    if address is None or (address.watch_id, address.artifact_id) != (notice.watch_id, notice.artifact_id):
        raise ValueError(f"its subject {subject[:200]!r} names another watch or artifact")
    return notice


def notice_line(pushed: PushedNotice) -> dict[str, Any]:
    """A notice as one JSON object, with its sequence (`epibus watch --json`, `--out`)."""
    return {"seq": pushed.seq, **pushed.notice.model_dump(mode="json")}


class NoticeLog(LineLog):
    """Notices appended to a JSON-lines file: what the agent was told, and its cursor (the last line's `seq`)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "seq", what="notice")

    def append(self, pushed: PushedNotice) -> None:
        self.append_line(notice_line(pushed), pushed.seq)


@dataclass
class NoticeReadStats:
    read: int = 0
    unreadable: int = 0  # messages on the agent's notice subjects that are no notice (skipped, logged)


class Watches:
    """`client.watches`: register, list and stop the agent's watches, and read what they pushed."""

    def __init__(self, nc: Callable[[], NatsClient], js: Callable[[], JetStreamContext], key: AgentKey,
                 closed: Callable[[], bool]) -> None:  # fmt: skip
        self._nc = nc
        self._js = js
        self.key = key
        self.closed = closed
        self.stats = NoticeReadStats()

    async def register(
        self,
        about: str,
        projects: Sequence[str],
        *,
        kinds: Sequence[str] | None = None,
        threshold: float = DEFAULT_THRESHOLD,
        days: float = DEFAULT_WATCH_DAYS,
        audit: bool = False,
        timeout_s: float = WATCH_TIMEOUT_S,
    ) -> WatchView:
        """Keep a standing question (see WatchRegisterRequest). Raises ConfigError naming an argument no node
        would accept, Forbidden (not a member of a project; an audit watch without the role), Refused (the
        node refused, e.g. the agent holds its limit of watches), Unavailable (no node with a mirror answered)."""
        request = build_request(
            WatchRegisterRequest,
            about=about,
            projects=list(projects),
            kinds=list(kinds) if kinds is not None else None,
            threshold=threshold,
            days=days,
            audit=audit,
        )
        reply = await ask_one(self._nc(), WATCH_REGISTER, request, WatchReply, signer=self.key, timeout_s=timeout_s)
        return reply.watch

    async def list_own(self, *, timeout_s: float = WATCH_TIMEOUT_S) -> tuple[list[WatchView], int]:
        """The agent's watches (expired ones too, until they are dropped) and how many it may hold."""
        reply = await ask_one(
            self._nc(), WATCH_LIST, WatchListRequest(), WatchListReply, signer=self.key, timeout_s=timeout_s
        )
        return list(reply.watches), reply.limit

    async def stop(self, watch_id: str, *, timeout_s: float = WATCH_TIMEOUT_S) -> bool:
        """Stop one of the agent's watches: False when it has no watch of that id (stopped already)."""
        request = build_request(WatchStopRequest, watch_id=watch_id)
        reply = await ask_one(self._nc(), WATCH_STOP, request, WatchStopReply, signer=self.key, timeout_s=timeout_s)
        return reply.stopped

    async def notices(self, *, after_seq: int = 0) -> AsyncGenerator[PushedNotice, None]:
        """Every notice pushed to this agent after stream sequence `after_seq`, in order, then each as it comes
        (until closed: use `contextlib.aclosing`, which frees the agent's consumer at once). Notices are kept for
        the notice window: a reader away for longer misses the older ones. Raises Unavailable (no server),
        LimitReached (every consumer slot of the agent in use)."""
        follower = StreamFollower(
            self._js(), WATCH_STREAM, notices_filter(self.key.public_key), start_seq=after_seq + 1, closed=self.closed
        )
        async with contextlib.aclosing(follower.messages()) as messages:
            async for msg in messages:
                seq = msg.metadata.sequence.stream
                try:
                    notice = decode_notice(msg.subject, msg.data)
                except ValueError as e:  # only nodes may publish there; on an open server anyone could
                    self.stats.unreadable += 1
                    log.warning("notice at seq %d is unreadable, skipped: %s", seq, str(e).splitlines()[0])
                    continue
                self.stats.read += 1
                yield PushedNotice(seq, notice)

    async def poll(self, *, after_seq: int, limit: int, wait_s: float) -> list[PushedNotice]:
        """At most `limit` notices after `after_seq`: those kept now, or else the first to come within `wait_s`
        (once one came, the read ends when no other follows within POLL_IDLE_S)."""
        found: list[PushedNotice] = []
        loop = asyncio.get_running_loop()
        try:
            async with (
                asyncio.timeout(wait_s) as deadline,
                contextlib.aclosing(self.notices(after_seq=after_seq)) as stream,
            ):
                async for pushed in stream:
                    found.append(pushed)
                    if len(found) >= limit:
                        break
                    until = deadline.when()
                    deadline.reschedule(min(until, loop.time() + POLL_IDLE_S) if until is not None else None)
        except TimeoutError:
            pass  # nothing more within the wait: what came is the answer
        return found
