"""The node's metric counts: a capped tally never holds more keys than its cap (and loses no count), a folded
gauge keeps the largest keys, and a latency histogram's buckets are cumulative and bounded."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bus.broker.tally import OTHER, CappedTally, LatencyHistogram, fold_top
from bus.subjects import KIND_PATTERN, PROJECT_PATTERN

keys = st.tuples(st.sampled_from([f"p{i}" for i in range(30)]), st.sampled_from(["finding", "unknown", "decision"]))


@given(st.lists(keys, max_size=300), st.integers(min_value=1, max_value=20))
def test_a_capped_tally_holds_at_most_its_cap_plus_other_and_loses_no_count(
    added: list[tuple[str, str]], cap: int
) -> None:
    tally = CappedTally(2, max_keys=cap)
    for key in added:
        tally.add(key)
    counted = dict(tally.items())
    assert len(counted) <= cap + 1
    assert tally.total() == len(added)
    first_seen = list(dict.fromkeys(added))[:cap]
    assert set(counted) - {(OTHER, OTHER)} == set(first_seen)  # the first keys keep their own series
    for key in first_seen:
        assert counted[key] == added.count(key)
    assert counted.get((OTHER, OTHER), 0) == tally.folded == len(added) - sum(added.count(k) for k in first_seen)


def test_the_overflow_label_cannot_be_a_real_project_or_kind() -> None:
    assert not PROJECT_PATTERN.fullmatch(OTHER)
    assert not KIND_PATTERN.fullmatch(OTHER)


def test_a_key_of_the_wrong_width_is_refused() -> None:
    with pytest.raises(ValueError, match="must have 2 parts"):
        CappedTally(2).add(("only-one",))


def test_fold_top_keeps_the_largest_and_sums_the_rest_under_other() -> None:
    counts: dict[tuple[str, ...], int] = {("a",): 5, ("b",): 1, ("c",): 3, ("d",): 2}
    assert fold_top(counts, 2) == {("a",): 5, ("c",): 3, (OTHER,): 3}
    assert fold_top(counts, 4) == counts


@given(st.lists(st.floats(min_value=-10, max_value=1e6) | st.just(math.nan), max_size=200))
def test_a_latency_histogram_is_cumulative_and_counts_every_number(observed: list[float]) -> None:
    histogram = LatencyHistogram()
    for seconds in observed:
        histogram.observe(seconds)
    numbers = [s for s in observed if not math.isnan(s)]
    cumulative = histogram.cumulative()
    assert histogram.count == len(numbers) == cumulative[-1][1]
    assert cumulative[-1][0] == math.inf
    assert [n for _, n in cumulative] == sorted(n for _, n in cumulative)
    for bound, n in cumulative:
        assert n == sum(1 for s in numbers if max(0.0, s) <= bound)
    assert histogram.sum == pytest.approx(sum(max(0.0, s) for s in numbers))
