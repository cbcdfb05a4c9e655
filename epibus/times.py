"""Times as people and agents write them: ISO 8601, or an age or duration like 30m, 2h, 7d (every CLI option
and MCP argument that takes a time reads it here)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from bus.errors import ConfigError

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_time(value: str | None, option: str, *, ahead: bool = False) -> datetime | None:
    """ISO 8601 (UTC if no offset) or a duration like 30m, 2h, 7d: an age (that long ago) or, with ahead,
    that long from now (a deadline)."""
    if value is None:
        return None
    match = _RELATIVE.match(value.strip())
    try:
        if match:
            span = timedelta(**{_UNITS[match.group(2)]: float(match.group(1))})
            return datetime.now(UTC) + span if ahead else datetime.now(UTC) - span
        parsed = datetime.fromisoformat(value)
        parsed = parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed
        parsed.astimezone(UTC)  # every reader compares it in UTC: 9999-12-31T23:59-23:59 is past the last day
    except OverflowError:
        raise ConfigError(option, f"{value!r} is out of range: times run from year 1 to 9999 in UTC") from None
    except ValueError:
        shape = "a duration" if ahead else "an age"
        raise ConfigError(option, f"{value!r} is neither ISO 8601 nor {shape} like 30m, 2h, 7d") from None
    return parsed
