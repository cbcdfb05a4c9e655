"""The one cache of enrolment answers every guard shares: reused within its bound, read again after it, an error
never remembered, and its size bounded."""

from __future__ import annotations

import pytest

from bus.enrolment.recent import RecentEnrolments
from bus.errors import Unavailable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_an_answer_is_reused_within_the_bound_and_read_again_after_it() -> None:
    clock, reads = Clock(), []

    async def read() -> str:
        reads.append(clock.now)
        return f"answer {len(reads)}"

    recent: RecentEnrolments[str, str] = RecentEnrolments(ttl_s=2.0, clock=clock)
    assert await recent.get("alice", read) == "answer 1"
    clock.now += 1.9
    assert await recent.get("alice", read) == "answer 1"
    clock.now += 0.2
    assert await recent.get("alice", read) == "answer 2"
    recent.drop("alice")
    assert await recent.get("alice", read) == "answer 3"


async def test_a_registry_that_did_not_answer_is_asked_again() -> None:
    answers: list[object] = [Unavailable("nats", "down"), "enrolled"]

    async def read() -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return str(answer)

    recent: RecentEnrolments[str, str] = RecentEnrolments()
    with pytest.raises(Unavailable):
        await recent.get("alice", read)
    assert await recent.get("alice", read) == "enrolled"


async def test_the_cache_never_holds_more_than_its_bound() -> None:
    async def read() -> None:
        return None

    recent: RecentEnrolments[int, None] = RecentEnrolments(max_entries=10)
    for key in range(25):
        await recent.get(key, read)
        assert len(recent) <= 10
