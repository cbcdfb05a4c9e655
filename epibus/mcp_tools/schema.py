"""Tool input models and the JSON schemas an MCP client sees: generated from the models the bus validates with,
so a closed vocabulary reaches the model as an enum carrying every value's one-line help."""

from __future__ import annotations

import copy
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from bus.model.vocab import HELP, describe

# Every string an agent sends has a bound: these for what the event models do not already limit.
Query = Annotated[str, StringConstraints(min_length=1, max_length=2_000)]
When = Annotated[
    str,
    StringConstraints(min_length=1, max_length=64),
    Field(description="ISO 8601 time (UTC if no offset) or an age like 30m, 2h, 7d."),
]
TaskId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,128}$")]
MessageId = Annotated[
    str,
    StringConstraints(pattern=r"^[0-9a-fA-F-]{32,36}$"),
    Field(description="A UUIDv7 for this message; sending the same id again is a safe retry."),
]
Capability = Annotated[str, StringConstraints(min_length=1, max_length=100)]
# Absolute (the server's working directory is not the caller's) and without NUL (no path holds one).
RepoPath = Annotated[str, StringConstraints(pattern=r"^/[^\x00]{0,4095}$")]
Limit = Annotated[int, Field(ge=1, le=500, description="How many at most; the result says when more exist.")]

_VOCABULARIES: dict[str, type[StrEnum]] = {vocab.__name__: vocab for vocab in HELP}


class ToolInput(BaseModel):
    """The arguments of one tool: nothing undeclared, nothing coerced (see guard.parse_arguments)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def tool_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema, self-contained (references inlined, which every MCP client reads), without
    pydantic's generated titles, and with each closed vocabulary's values explained where it is chosen."""
    raw = model.model_json_schema()
    definitions = raw.pop("$defs", {})
    schema: dict[str, Any] = _inline(raw, definitions)
    schema.pop("title", None)
    schema["additionalProperties"] = False
    return schema


def _inline(node: Any, definitions: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_inline(item, definitions) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        merged = copy.deepcopy(definitions[name]) | {k: v for k, v in node.items() if k != "$ref"}
        return _inline(_explained(name, merged), definitions)
    inlined = {key: _inline(value, definitions) for key, value in node.items() if key not in ("title", "properties")}
    if isinstance(node.get("properties"), dict):  # property names are arguments (one may be called "title")
        inlined["properties"] = {name: _inline(value, definitions) for name, value in node["properties"].items()}
    return inlined


def _explained(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    vocab = _VOCABULARIES.get(name)
    if vocab is None or "enum" not in schema:
        return schema
    lead = schema.get("description", "").rstrip(".")
    return schema | {"description": f"{lead}. {describe(vocab)}".lstrip(". ")}
