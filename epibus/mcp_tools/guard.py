"""The unknown-argument guard: a tool call is parsed into the tool's input model or refused with one line naming
the argument. Nothing undeclared is ignored, nothing is coerced ("0.5" is not 0.5, 1 is not true), nothing
oversized is cut."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from bus.errors import InvalidEvent, validation_message
from bus.model.event import MAX_EVENT_BYTES

M = TypeVar("M", bound=BaseModel)
# A call's arguments, encoded, may be no larger than the event they could become.
MAX_ARGUMENT_BYTES = MAX_EVENT_BYTES


def parse_arguments(tool: str, model: type[M], arguments: dict[str, Any] | None) -> M:
    """The validated arguments of `tool`. Raises InvalidEvent naming the first argument that is undeclared,
    missing, of the wrong type, out of range or too long, and what is allowed."""
    raw = arguments or {}
    try:
        # allow_nan=False: NaN and Infinity are not JSON, and no event could carry them
        encoded = json.dumps(raw, ensure_ascii=False, allow_nan=False, default=_refuse_unencodable).encode()
    except RecursionError:
        raise InvalidEvent(tool, "its arguments are nested too deeply") from None
    except ValueError as e:  # NaN or Infinity, or an integer longer than Python's 4300-digit conversion limit
        raise InvalidEvent(tool, f"its arguments hold a value JSON cannot carry ({e})") from None
    except UnicodeEncodeError:
        raise InvalidEvent(tool, "its arguments hold text that is not valid Unicode (a lone surrogate)") from None
    if len(encoded) > MAX_ARGUMENT_BYTES:
        raise InvalidEvent(tool, f"its arguments are {len(encoded)} bytes; the limit is {MAX_ARGUMENT_BYTES}")
    declared = list(model.model_fields)
    unknown = sorted(set(raw) - set(declared))
    if unknown:
        takes = ", ".join(declared) or "no arguments"
        raise InvalidEvent(f"{tool}.{unknown[0]}", f"is not an argument of {tool}; it takes {takes}")
    try:
        # JSON mode with strict=True: enums and times are read from their JSON forms, nothing else converts.
        return model.model_validate_json(encoded, strict=True)
    except ValidationError as e:
        raise _invalid(tool, e) from None


def _invalid(tool: str, error: ValidationError) -> InvalidEvent:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    field = f"{tool}.{where}" if where else tool
    got = first.get("input")
    shown = "" if isinstance(got, dict | list) or first["type"] == "missing" else f"={_short(got)}"
    ctx = first.get("ctx") or {}
    if "expected" in ctx:
        return InvalidEvent(f"{field}{shown}", f"expected {ctx['expected']}")
    return InvalidEvent(f"{field}{shown}", validation_message(first))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}… ({len(str(value))} characters)"


def _refuse_unencodable(value: Any) -> Any:
    raise InvalidEvent("arguments", f"hold a {type(value).__name__}, which JSON cannot carry")
