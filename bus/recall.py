"""Asking every node's mirror at once (DESIGN §7): one request on RECALL, every node with a mirror answers,
the answers are merged by event id. The answer says which nodes answered, and which failed and why."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from bus.errors import ConfigError, Unavailable
from bus.jetstream import NATS_UNAVAILABLE
from bus.subjects import PROJECT_PATTERN, RECALL

SETTLE_S = 0.3  # after the first answer, how long to wait for the other nodes


@dataclass
class RecallAnswer:
    query: str
    project: str
    hits: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    failed_nodes: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "query": self.query,
            "project": self.project,
            "hits": self.hits,
            "nodes": self.nodes,
            "failed_nodes": self.failed_nodes,
        }


def recall_request(
    query: str,
    project: str,
    *,
    k: int,
    kinds: list[str] | None,
    include_resolved: bool,
    as_of: datetime | None,
    audit: bool,
) -> dict[str, Any]:
    if not PROJECT_PATTERN.match(project):
        raise ConfigError("project", f"{project!r} must match {PROJECT_PATTERN.pattern}")
    if not query.strip():
        raise ConfigError("query", "is empty; say what to recall")
    return {
        "query": query,
        "project": project,
        "k": k,
        "kinds": kinds,
        "include_resolved": include_resolved,
        "as_of": as_of.isoformat() if as_of else None,
        "audit": audit,
    }


async def ask_all(nc: NatsClient, request: dict[str, Any], *, timeout_s: float = 3.0) -> RecallAnswer:
    """Fan out, merge by event id (best score kept), rank. Raises Unavailable when no node answered."""
    inbox = nc.new_inbox()
    replies: asyncio.Queue[Msg] = asyncio.Queue()

    async def collect(msg: Msg) -> None:
        await replies.put(msg)

    subscription = await nc.subscribe(inbox, cb=collect)
    answer = RecallAnswer(request["query"], request["project"])
    merged: dict[str, dict[str, Any]] = {}
    try:
        await nc.publish(RECALL, json.dumps(request).encode(), reply=inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            wait_s = deadline - loop.time() if not answer.nodes and not answer.failed_nodes else SETTLE_S
            try:
                msg = await asyncio.wait_for(replies.get(), timeout=max(0.0, wait_s))
            except TimeoutError:
                break
            if not msg.data:  # a status message (503: no responders), not an answer
                status = (msg.headers or {}).get("Status", "")
                if status == "503" and not answer.nodes:
                    break
                continue
            body = json.loads(msg.data)
            node = str(body.get("node"))
            if "error" in body:
                answer.failed_nodes[node] = str(body["error"])
                continue
            answer.nodes.append(node)
            for hit in body["hits"]:
                best = merged.get(hit["event_id"])
                if best is None or hit["score"] > best["score"]:
                    merged[hit["event_id"]] = hit | {"answered_by": node}
    except NATS_UNAVAILABLE as e:
        raise Unavailable("nats", f"recall request: {type(e).__name__} {e}") from e
    finally:
        await subscription.unsubscribe()
    if not answer.nodes:
        why = "; ".join(f"{n}: {e}" for n, e in answer.failed_nodes.items()) or "no node with a mirror answered"
        raise Unavailable("recall", f"{why} within {timeout_s}s (is `epibus up` running with its mirror on?)")
    answer.hits = sorted(merged.values(), key=lambda h: -h["score"])[: int(request["k"])]
    return answer
