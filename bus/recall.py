"""Asking every node's mirror at once: one request on RECALL, every node with a mirror answers,
the answers are merged by event id. The answer says which nodes answered, and which failed and why."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, get_args

from nats.aio.client import Client as NatsClient

from bus.ask import fan_out, refused_by_all
from bus.errors import Unavailable
from bus.event import Body, Text
from bus.requests import ErrorReply, RecallReply, RecallRequest, build_request
from bus.signing import AgentKey
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


TEXT_CONSTRAINTS = get_args(Text)[1]  # how a free-text field is declared on an event body
MIN_FINGERPRINT_CHARS = 16  # a shorter text matches unrelated bytes, so its absence proves nothing
FINGERPRINT_CHARS = 64  # long enough that a kept text rarely shares a window; short enough to fit in one page


def free_texts(body: Body) -> list[str]:
    """What an event says in its own words: the values of its free-text (`Text`) fields. Labels, ids and
    enums are left out: other events share them, so a file holding one would prove nothing."""
    values = body.model_dump(mode="json")
    found: list[str] = []
    for name, info in type(body).model_fields.items():
        value = values.get(name)
        if isinstance(value, str) and _is_free_text(info.annotation, info.metadata):
            found.append(value)
    return found


def _is_free_text(annotation: Any, metadata: Sequence[Any]) -> bool:
    """`Text`, alone or in an optional (`Text | None`): its StringConstraints are those of Text."""
    if TEXT_CONSTRAINTS in metadata:
        return True
    return any(_is_free_text(arg, getattr(arg, "__metadata__", ())) for arg in get_args(annotation))


def content_fingerprints(texts: Sequence[str]) -> list[str]:
    """Distinctive pieces of each text (its start, middle and end, FINGERPRINT_CHARS long), each as written and
    as escaped in JSON: a file holding any of them holds a copy. Texts shorter than MIN_FINGERPRINT_CHARS
    give none. Three windows, because a long text can be split across storage pages."""
    forms: set[str] = set()
    for text in texts:
        core = text.strip()
        if len(core) < MIN_FINGERPRINT_CHARS:
            continue
        n = min(FINGERPRINT_CHARS, len(core))
        middle = (len(core) - n) // 2
        for piece in {core[:n], core[middle : middle + n], core[-n:]}:
            forms |= {piece, json.dumps(piece)[1:-1], json.dumps(piece, ensure_ascii=False)[1:-1]}
    return sorted(forms)


@dataclass(frozen=True)
class ForgetReport:
    project: str
    artifact_id: str
    forgotten_event_id: str
    messages: list[tuple[int, str | None]]  # (stream seq, event id) erased from the stream
    # What the nodes look for on disk, and the texts their mirrors embedded (to drop cached vectors of them).
    # Sent with each proof request: no node keeps the content once it has forgotten it.
    fingerprints: list[str] = field(default_factory=list)
    embedded_texts: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ForgetProof:
    """What reading every store back showed. `nodes[name]` has, for that node: journal_rows,
    journal_content_left, projection_rows, mirror_points (read back by id), cached_vectors (embeddings of
    the content still cached); files (every file that still holds a fingerprint of the content), unreadable
    (files the scan could not read), unscrubbable (store -> why its bytes cannot be checked or erased from
    there) and scrubbed (what this round erased)."""

    report: ForgetReport
    erased_seqs: list[int]
    nodes: dict[str, dict[str, Any]]
    malformed: dict[str, str] = field(default_factory=dict)  # replies that were no node's answer, and why

    @property
    def stream_clean(self) -> bool:
        return sorted(self.erased_seqs) == sorted(seq for seq, _ in self.report.messages)

    @property
    def provable(self) -> bool:
        """False when the content was too short to fingerprint: no byte scan can show it is gone."""
        return bool(self.report.fingerprints)

    def node_done(self, node: str) -> bool:
        """Nothing this node can check or scrub still holds the content."""
        answer = self.nodes[node]
        if "error" in answer or "files" not in answer:  # a node that did not scan proves nothing on bytes
            return False
        left = ("journal_content_left", "projection_rows", "mirror_points", "cached_vectors", "files", "unreadable")
        return not any(answer.get(key) for key in left)

    def node_clean(self, node: str) -> bool:
        """Done, and no store of this node is beyond checking (a store named unscrubbable is never clean)."""
        return self.node_done(node) and not self.nodes[node].get("unscrubbable")

    @property
    def complete(self) -> bool:
        """Every store epibus can check was read back and scanned, and none holds the content: nothing more
        will change by asking again."""
        return self.stream_clean and bool(self.nodes) and all(self.node_done(n) for n in self.nodes)

    @property
    def clean(self) -> bool:
        return self.complete and self.provable and all(self.node_clean(n) for n in self.nodes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "project": self.report.project,
            "artifact_id": self.report.artifact_id,
            "forgotten_event_id": self.report.forgotten_event_id,
            "stream": {
                "messages": len(self.report.messages),
                "erased": len(self.erased_seqs),
                "clean": self.stream_clean,
            },
            "fingerprints": len(self.report.fingerprints),
            "provable": self.provable,
            "nodes": {n: a | {"clean": self.node_clean(n)} for n, a in self.nodes.items()},
            "malformed_replies": self.malformed,
            "complete": self.complete,
            "clean": self.clean,
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
    answer.hits = sorted(merged.values(), key=lambda h: -h["score"])[: request.k]
    return answer
