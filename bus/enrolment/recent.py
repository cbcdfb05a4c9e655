"""Enrolments read recently, the one cache behind every guard that asks the registry who a signer is (the node
services, the mesh service, an MCP session): each reuses an answer for ENROLMENT_CACHE_S, so a revocation made
on another node takes effect everywhere within that same bound, and none of them grows without limit."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

ENROLMENT_CACHE_S = 2.0  # how long a signer's enrolment is reused: a revocation elsewhere takes effect within it
MAX_REMEMBERED = 4096  # signers remembered at once; past it, all are forgotten (and read again when they ask)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class RecentEnrolments(Generic[K, V]):
    """`await recent.get(key, read)`: the answer `read()` gave for `key` within the last ttl_s, or a fresh one.
    An error from `read` is raised and never remembered (a registry that did not answer is asked again)."""

    def __init__(
        self,
        *,
        ttl_s: float = ENROLMENT_CACHE_S,
        max_entries: int = MAX_REMEMBERED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._answers: dict[K, tuple[float, V]] = {}

    async def get(self, key: K, read: Callable[[], Awaitable[V]]) -> V:
        now = self._clock()
        remembered = self._answers.get(key)
        if remembered is not None and now - remembered[0] < self.ttl_s:
            return remembered[1]
        answer = await read()
        if len(self._answers) >= self.max_entries:
            self._answers.clear()
        self._answers[key] = (now, answer)
        return answer

    def put(self, key: K, answer: V) -> None:
        """Remember an answer read another way (a connect reads the agent's own enrolment)."""
        self._answers[key] = (self._clock(), answer)

    def drop(self, key: K) -> None:
        """Forget one answer (this process changed it)."""
        self._answers.pop(key, None)

    def __len__(self) -> int:
        return len(self._answers)
