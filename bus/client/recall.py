"""Asking every node's mirror at once: one request on RECALL, every node with a mirror answers,
the answers are merged by event id. The answer says which nodes answered, and which failed and why."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from nats.aio.client import Client as NatsClient

from bus.broker.ask import fan_out, refused_by_all
from bus.errors import Unavailable
from bus.identity.signing import AgentKey
from bus.model.requests import ErrorReply, RecallReply, RecallRequest, build_request
from bus.model.review import safe_review_order
from bus.subjects import RECALL


@dataclass
class RecallAnswer:
    query: str
    project: str
    hits: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    failed_nodes: dict[str, str] = field(default_factory=dict)
    missing_nodes: list[str] = field(default_factory=list)  # live nodes with a mirror that did not answer in time

    @property
    def partial(self) -> bool:
        return bool(self.missing_nodes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "query": self.query,
            "project": self.project,
            "hits": self.hits,
            "nodes": self.nodes,
            "failed_nodes": self.failed_nodes,
            "missing_nodes": self.missing_nodes,
            "partial": self.partial,
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
) -> RecallRequest:
    """Raises ConfigError naming the argument no node would accept (a project no subject could hold, an empty
    query, k out of range...)."""
    return build_request(
        RecallRequest,
        query=query,
        project=project,
        k=k,
        kinds=kinds,
        include_resolved=include_resolved,
        as_of=as_of,
        audit=audit,
    )


async def ask_all(nc: NatsClient, request: RecallRequest, *, signer: AgentKey, timeout_s: float = 3.0) -> RecallAnswer:
    """Fan out (signed by `signer`, see fan_out), merge by event id (best score kept), rank. Nodes that answered
    with an error and replies that were malformed are named in failed_nodes, live nodes with a mirror that did
    not answer within timeout_s in missing_nodes (the answer is then partial). Raises Unavailable when no node
    answered with hits, Forbidden when every node that answered refused the signer."""
    answer = RecallAnswer(request.query, request.project)
    merged: dict[str, dict[str, Any]] = {}
    replies = await fan_out(nc, RECALL, request, RecallReply, signer=signer, timeout_s=timeout_s)
    for reply in replies.answers:
        if isinstance(reply, ErrorReply):
            answer.failed_nodes[reply.node] = reply.error
            continue
        answer.nodes.append(reply.node)
        for hit in reply.hits:
            best = merged.get(hit.event_id)
            if best is None or hit.score > best["score"]:
                merged[hit.event_id] = hit.model_dump(mode="json") | {"answered_by": reply.node}
    answer.failed_nodes |= replies.malformed
    answer.missing_nodes = replies.missing
    refused = refused_by_all(replies, signer, RECALL)
    if refused is not None:
        raise refused
    if not answer.nodes:
        failures = answer.failed_nodes | {n: "no answer" for n in answer.missing_nodes}
        why = "; ".join(f"{n}: {e}" for n, e in failures.items()) or "no node with a mirror answered"
        raise Unavailable("recall", f"{why} within {timeout_s}s (is `epibus up` running with its mirror on?)")
    # Each node ordered its hits under the project's review policy; merged, the same rule orders them again.
    by_score = sorted(merged.values(), key=lambda h: -h["score"])
    answer.hits = safe_review_order(by_score, lambda h: h.get("review"), None)[: request.k]
    return answer
