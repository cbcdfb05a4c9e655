"""What a forget reports and proves: the fingerprints of the forgotten content that every node scans its files
for, the stream messages erased, and each node's answer on reading its stores back."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

from bus.model.fields import Text
from bus.model.kinds import Body

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
    the content still cached), shared_vectors (still on the fleet's vectors stream), watch_notices (notices
    pushed to watches about the claim, still on the notices' stream; None where the node has no mirror); files
    (every file that still holds a fingerprint of the content), unreadable (files the scan could not read),
    unscrubbable (store -> why its bytes cannot be checked or erased from
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
        left = (
            "journal_content_left", "projection_rows", "mirror_points", "cached_vectors", "shared_vectors",
            "watch_notices", "files", "unreadable",
        )  # fmt: skip
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
