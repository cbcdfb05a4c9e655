"""Counts a node keeps for its metrics: per-key counters whose number of keys is capped (a hostile agent can
name any number of projects and kinds; memory and label cardinality must not follow), and latency histograms
with fixed buckets. Plain counting only: the node's metrics module turns them into an exposition."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Protocol

from bus.model.event import Envelope
from bus.subjects import parse_event_subject

# Keys past the cap count here. It cannot collide with a real project or kind: both are slugs that start
# with a letter or digit (bus/subjects.py PROJECT_PATTERN, KIND_PATTERN).
OTHER = "_other"
# A dead letter whose subject names no project and kind (it was not a well-formed event subject).
UNPARSED = "_unparsed"
DEFAULT_MAX_KEYS = 200
# Seconds; from a fast local commit to an outage waited out, then +Inf.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class CappedTally:
    """Counts per key tuple. The first `max_keys` distinct keys count as themselves; any later new key counts
    under (OTHER, ...). A key already counted keeps counting as itself, so a series never moves."""

    def __init__(self, width: int, *, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if width < 1 or max_keys < 1:
            raise ValueError(f"width ({width}) and max_keys ({max_keys}) must be at least 1")
        self.width = width
        self.max_keys = max_keys
        self.overflow = (OTHER,) * width
        self._counts: dict[tuple[str, ...], int] = {}
        self.folded = 0  # how many counts went to the overflow key

    def add(self, key: tuple[str, ...], n: int = 1) -> None:
        if len(key) != self.width:
            raise ValueError(f"tally key {key!r} must have {self.width} parts")
        if key not in self._counts and len(self._counts) >= self.max_keys:
            key = self.overflow
            self.folded += n
        self._counts[key] = self._counts.get(key, 0) + n

    def items(self) -> list[tuple[tuple[str, ...], int]]:
        return sorted(self._counts.items())

    def total(self) -> int:
        return sum(self._counts.values())


def fold_top(counts: dict[tuple[str, ...], int], max_keys: int = DEFAULT_MAX_KEYS) -> dict[tuple[str, ...], int]:
    """A gauge's values with at most max_keys keys (+1 for OTHER): the largest keep their own, the rest are summed
    under the overflow key. For figures recomputed at every read, where there is no first-seen order to keep."""
    if len(counts) <= max_keys:
        return dict(counts)
    ordered = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    kept = dict(ordered[:max_keys])
    width = len(ordered[0][0])
    overflow = (OTHER,) * width
    kept[overflow] = kept.get(overflow, 0) + sum(n for _, n in ordered[max_keys:])
    return kept


class LatencyHistogram:
    """Observations of seconds in fixed buckets: per-bucket counts (not cumulative), their sum and count."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS_S) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError("histogram buckets must be distinct and ascending")
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bucket (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        """A negative value (a publisher's clock ahead of ours) counts as 0; a NaN is not counted."""
        if math.isnan(seconds):
            return
        seconds = max(0.0, seconds)
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or under it), ending with (inf, count)."""
        running = 0
        found: list[tuple[float, int]] = []
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            running += n
            found.append((bound, running))
        return found


class Applied(Protocol):
    """What the tally reads of an applied delivery (bus.intake.admission.Delivery, a floor above)."""

    @property
    def event(self) -> Envelope: ...


class RunnerTally:
    """What the runner's observer applied and what it dead-lettered, per project and kind (capped: see
    bus/broker/tally.py), and how long events took from their recording to the observer's durable write."""

    def __init__(self) -> None:
        self.handled = CappedTally(2)  # (project, kind)
        self.dead_lettered = CappedTally(3)  # (project, kind, reason)
        self.latency = LatencyHistogram()  # recorded_at (publisher's clock) -> written (ours)

    def applied(self, deliveries: Sequence[Applied]) -> None:
        now = datetime.now(UTC)
        for delivery in deliveries:
            self.handled.add((delivery.event.project, delivery.event.kind))
            self.latency.observe((now - delivery.event.recorded_at).total_seconds())

    def rejected(self, subject: str, reason: str) -> None:
        address = parse_event_subject(subject)
        project, kind = (address.project, address.kind) if address is not None else (UNPARSED, UNPARSED)
        self.dead_lettered.add((project, kind, reason))
