"""The constrained field types every event is made of: texts with their limits, units, counts and flags that
are never coerced, times that must carry their offset, slugs, agent ids, public keys and digests."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import (
    AwareDatetime,
    BeforeValidator,
    Field,
    StringConstraints,
)

from bus.subjects import ARTIFACT_PATTERN, PROJECT_PATTERN

Text = Annotated[str, StringConstraints(min_length=1, max_length=16_000)]
ShortText = Annotated[str, StringConstraints(min_length=1, max_length=200)]
# Numbers, flags and times are never coerced (true is not 1, "0.5" is not 0.5, 1700000000 is not a time):
# an event has one encoding, and bytes that differ from it are refused rather than read as the same event.
Unit = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False, strict=True)]
Count = Annotated[int, Field(ge=1, strict=True)]
Flag = Annotated[bool, Field(strict=True)]


def no_number_as_time(value: Any) -> Any:
    if isinstance(value, int | float):
        raise ValueError("must be an ISO 8601 time with its offset, not a number")
    return value


Timestamp = Annotated[AwareDatetime, BeforeValidator(no_number_as_time)]


def not_a_flag(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is a flag, not the number 1")
    return value


ProjectSlug = Annotated[str, StringConstraints(pattern=PROJECT_PATTERN.pattern)]
ArtifactId = Annotated[str, StringConstraints(pattern=ARTIFACT_PATTERN.pattern)]
AGENT_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
AgentId = Annotated[str, StringConstraints(pattern=AGENT_PATTERN.pattern)]
PublicKey = Annotated[str, StringConstraints(pattern=r"^U[A-Z2-7]{55}$")]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
