"""Times and ages given on the command line: a value no reader could compare in UTC is one error naming the
option, never an OverflowError traceback from deep in a query."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from bus.errors import ConfigError
from epibus.times import parse_time


@pytest.mark.parametrize(
    "value",
    ["9999-12-31T23:59:59.999999-23:59", "0001-01-01T00:00:00+23:59", "999999999d", "99999999999d", "1" * 400 + "w"],
)
def test_a_time_or_age_outside_the_utc_calendar_is_a_config_error_naming_the_option(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^--as-of: .* is out of range: times run from year 1 to 9999 in UTC$"):
        parse_time(value, "--as-of")


def test_a_deadline_past_the_last_day_is_refused_and_a_near_one_is_kept_with_its_offset() -> None:
    with pytest.raises(ConfigError, match=r"^--deadline: '999999999d' is out of range"):
        parse_time("999999999d", "--deadline", ahead=True)
    kept = parse_time("2030-01-01T12:00:00+02:00", "--deadline", ahead=True)
    assert kept is not None
    assert kept.utcoffset() == timedelta(hours=2)
    assert kept == datetime(2030, 1, 1, 10, 0, tzinfo=UTC)
