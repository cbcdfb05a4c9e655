"""The documentation in docs/ cannot drift from the code: every table that restates code is generated here from
the code and must appear verbatim in its document; every relative link, every repository path and every
`bus.…`/`observers.…`/`mesh.…` name a document mentions must exist; no file cites a document outside the
repository.

`python -m tests.test_docs` prints every generated table under the document it belongs to;
`python -m tests.test_docs NAME` prints one (NAME as listed in the assertion message)."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from bus import subjects
from bus.broker.streams import BUCKETS, managed_streams
from bus.model.auth import Enrolment, agent_permissions
from bus.model.authority import (
    RULE_AUTHOR_OR_ADMIN,
    RULE_ENROLMENT,
    RULE_MEMBERSHIP,
    RULE_ONE_OWNER,
    RULE_REVOKED,
    RULE_VERIFIER_ROLE,
)
from bus.model.kinds import kind_names, require_kind
from bus.model.state import TRANSITION_TRUST, TRUST_TRANSITIONS, UNSAFE_RESOLUTIONS
from bus.model.vocab import HELP, DeadLetterReason, Lifecycle, ReceiptLevel, ResolutionKind, Role, Trust
from mesh import events as mesh_events
from mesh.protocol import A2A_STATE, TERMINAL, TRANSITIONS
from mesh.vocab import ActionCategory, MeshRole, TaskAction, TaskState

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# -- docs/state-rules.md ------------------------------------------------------------------------------------


def event_kinds() -> str:
    """Every registered kind (bus.model.event, bus.model.authority and mesh.events register them): transition or claim,
    and whether it is a system record."""
    assert mesh_events.TASK_KIND in kind_names(), "mesh.events registers the mesh's kinds on import"
    rows = [
        (
            f"`{name}`",
            "yes" if require_kind(name).transition else "no",
            "yes" if require_kind(name).body.system_record else "no",
        )
        for name in kind_names()
    ]
    return _table(("kind", "transition", "system record"), rows)


def trust_values() -> str:
    """bus.model.vocab.Trust with its one-line help."""
    return _table(("trust", "meaning"), [(f"`{t}`", HELP[Trust][t.value]) for t in Trust])


def lifecycle_values() -> str:
    """bus.model.vocab.Lifecycle with its one-line help."""
    return _table(("lifecycle", "meaning"), [(f"`{v}`", HELP[Lifecycle][v.value]) for v in Lifecycle])


def trust_transitions() -> str:
    """bus.model.state.TRUST_TRANSITIONS: the legal trust moves."""
    rows = [
        (f"`{trust}`", ", ".join(f"`{t}`" for t in sorted(TRUST_TRANSITIONS[trust])) or "nothing (terminal)")
        for trust in TRUST_TRANSITIONS
    ]
    return _table(("from", "may move to"), rows)


def transition_kinds() -> str:
    """bus.model.state.TRANSITION_TRUST: which event kind moves trust where."""
    return _table(
        ("event kind", "sets trust to"), [(f"`{kind}`", f"`{trust}`") for kind, trust in TRANSITION_TRUST.items()]
    )


def resolution_kinds() -> str:
    """bus.model.vocab.ResolutionKind with its one-line help, and whether the safe door shows it (bus.model.state)."""
    rows = [
        (
            f"`{kind}`",
            HELP[ResolutionKind][kind.value],
            "never" if kind in UNSAFE_RESOLUTIONS else "only when resolved ones are asked for",
        )
        for kind in ResolutionKind
    ]
    return _table(("resolution", "meaning", "safe door shows it"), rows)


def authority_rules() -> str:
    """The rule names bus.model.authority gives in a refusal."""
    names = (RULE_MEMBERSHIP, RULE_REVOKED, RULE_VERIFIER_ROLE, RULE_ONE_OWNER, RULE_AUTHOR_OR_ADMIN, RULE_ENROLMENT)
    return "\n".join(f"- `{name}`" for name in names)


def roles() -> str:
    """bus.model.vocab.Role with its one-line help."""
    return _table(("role", "what it may do"), [(f"`{role}`", HELP[Role][role.value]) for role in Role])


# -- docs/mesh-protocol.md ----------------------------------------------------------------------------------


def mesh_roles() -> str:
    """mesh.vocab.MeshRole with its one-line help."""
    return _table(("role", "who"), [(f"`{role}`", HELP[MeshRole][role.value]) for role in MeshRole])


def mesh_messages() -> str:
    """mesh.vocab.TaskAction with its one-line help."""
    return _table(("message", "what it does"), [(f"`{a}`", HELP[TaskAction][a.value]) for a in TaskAction])


def action_categories() -> str:
    """mesh.vocab.ActionCategory with its one-line help."""
    return _table(("category", "meaning"), [(f"`{c}`", HELP[ActionCategory][c.value]) for c in ActionCategory])


def mesh_transitions() -> str:
    """mesh.protocol.TRANSITIONS: message, source states, target state, who may send it."""
    rows = [
        (
            f"`{action}`",
            ", ".join(sorted(s.value for s in move.sources)) or "(none: creates the task)",
            move.target.value,
            " or ".join(sorted(r.value for r in move.roles)),
        )
        for action, move in TRANSITIONS.items()
    ]
    return _table(("message", "from", "to", "sent by"), rows)


def mesh_states() -> str:
    """mesh.vocab.TaskState with its help, whether it is terminal, and its A2A state (mesh.protocol.A2A_STATE)."""
    rows = [
        (f"`{state}`", "yes" if state in TERMINAL else "no", A2A_STATE[state], HELP[TaskState][state.value])
        for state in TaskState
    ]
    return _table(("state", "terminal", "A2A state", "meaning"), rows)


# -- docs/subjects-and-streams.md ---------------------------------------------------------------------------


def names() -> str:
    """Every name constant of bus.subjects, with its value."""
    rows = [
        (f"`{name}`", ", ".join(f"`{v}`" for v in value) if isinstance(value, tuple) else f"`{value}`")
        for name, value in vars(subjects).items()
        if name.isupper() and isinstance(value, str | tuple) and not name.endswith("PATTERN")
    ]
    return _table(("bus.subjects", "value"), rows)


NAME_BUILDERS = (
    "event_subject",
    "artifact_filter",
    "dlq_subject",
    "dlq_filter",
    "task_key",
    "tasks_key_filter",
    "roster_key",
    "capabilities_key",
    "node_key_record",
    "project_subjects",
    "kv_stream",
    "kv_subject",
)


def name_patterns() -> str:
    """The name builders of bus.subjects, called with placeholders."""
    rows = []
    for name in NAME_BUILDERS:
        builder = getattr(subjects, name)
        args = [f"<{p}>" for p in inspect.signature(builder).parameters]
        rows.append((f"`{name}({', '.join(p.strip('<>') for p in args)})`", f"`{builder(*args)}`"))
    return _table(("function", "builds"), rows)


def streams() -> str:
    """bus.broker.streams.managed_streams(): every stream epibus creates, with the settings it manages."""
    rows = []
    for stream in managed_streams():
        c = stream.config
        rows.append(
            (
                f"`{c.name}`",
                ", ".join(f"`{s}`" for s in c.subjects or ()),
                str(c.storage.value if c.storage else None),
                str(c.retention.value if c.retention else None),
                str(c.discard.value if c.discard else None),
                f"{c.duplicate_window:g} s",
                "forever" if not c.max_age else f"{c.max_age:g} s",
                "none" if (c.max_msg_size or -1) < 0 else f"{c.max_msg_size} B",
                "unlimited" if (c.max_msgs_per_subject or -1) < 0 else str(c.max_msgs_per_subject),
            )
        )
    header = ("stream", "subjects", "storage", "retention", "discard", "duplicate window", "max age", "max message")
    return _table((*header, "per subject"), rows)


def name_rules() -> str:
    """The *_PATTERN regular expressions of bus.subjects: what a project, kind, artifact or consumer name may be."""
    rows = [(f"`{name}`", f"`{value.pattern}`") for name, value in vars(subjects).items() if name.endswith("_PATTERN")]
    return _table(("bus.subjects", "must match"), rows)


def buckets() -> str:
    """bus.broker.streams.BUCKETS: every KV bucket, its history and description."""
    rows = [(f"`{b.name}`", str(b.history), b.description) for b in BUCKETS.values()]
    return _table(("bucket", "history", "description"), rows)


def dead_letter_reasons() -> str:
    """bus.model.vocab.DeadLetterReason with its one-line help."""
    rows = [(f"`{reason}`", HELP[DeadLetterReason][reason.value]) for reason in DeadLetterReason]
    return _table(("reason", "meaning"), rows)


def dead_letter_headers() -> str:
    """The DLQ_* headers of bus.subjects, which bus.intake.runner writes on every dead letter."""
    rows = [
        (f"`{value}`", f"`{name}`")
        for name, value in vars(subjects).items()
        if name.startswith("DLQ_") and isinstance(value, str) and value.startswith("Epibus-Dlq-")
    ]
    return _table(("header", "bus.subjects"), rows)


def request_headers() -> str:
    """The headers of a signed request (named in bus.subjects, signed and checked by bus.identity.signing)."""
    # An event's own headers (EVENT_*) and JetStream's belong to the wire format, not to a request's signature.
    found = [
        (f"`{value}`", f"`{name}`")
        for name, value in vars(subjects).items()
        if name.endswith("_HEADER")
        and isinstance(value, str)
        and value.startswith("Epibus-")
        and "Event" not in value
        and "Vector" not in value
    ]
    return _table(("header", "bus.subjects"), found)


def agent_broker_permissions() -> str:
    """bus.model.auth.agent_permissions for an agent enrolled in project `demo` (its key shown as <key>), with two
    consumer slots (`epibus up --agent-consumers`, 8 by default)."""
    key = "U" + "A" * 55
    enrolment = Enrolment(
        agent_id="alice",
        public_key=key,
        owner="alice",
        roles=(Role.agent,),
        projects=("demo",),
        enrolled_by="admin",
        enrolled_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    permissions = agent_permissions(enrolment, consumer_slots=2)  # each slot: the same three calls, numbered
    rows = [
        (f"{direction} {verdict}", f"`{subject.replace(key, '<key>')}`")
        for direction in ("publish", "subscribe")
        for verdict in ("allow", "deny")
        for subject in permissions[direction].get(verdict, [])
    ]
    return _table(("permission", "subject"), rows)


# -- docs/architecture.md -----------------------------------------------------------------------------------


def receipt_levels() -> str:
    """bus.model.vocab.ReceiptLevel with its one-line help."""
    return _table(("level", "meaning"), [(f"`{level}`", HELP[ReceiptLevel][level.value]) for level in ReceiptLevel])


GENERATED: dict[str, tuple[Callable[[], str], ...]] = {
    "architecture.md": (receipt_levels,),
    "state-rules.md": (
        event_kinds,
        trust_values,
        lifecycle_values,
        trust_transitions,
        transition_kinds,
        resolution_kinds,
        authority_rules,
        roles,
    ),
    "mesh-protocol.md": (mesh_roles, mesh_messages, action_categories, mesh_transitions, mesh_states),
    "subjects-and-streams.md": (
        names,
        name_patterns,
        name_rules,
        streams,
        buckets,
        dead_letter_reasons,
        dead_letter_headers,
        request_headers,
        agent_broker_permissions,
    ),
}
CASES = [(doc, table) for doc, tables in GENERATED.items() for table in tables]


@pytest.mark.parametrize(("doc", "table"), CASES, ids=[f"{d}:{t.__name__}" for d, t in CASES])
def test_generated_table_appears_verbatim(doc: str, table: Callable[[], str]) -> None:
    if table() not in (DOCS / doc).read_text():
        pytest.fail(
            f"docs/{doc} does not show the {table.__name__} table the code has now; print it with "
            f"`python -m tests.test_docs {table.__name__}` and put it in place of the old one"
        )


# -- links, paths and names ---------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w/.<>*-])((?:[\w-]+/)+[\w-]+\.(?:py|md|toml|json|sh|yml|yaml))\b")
LAYER_NAME = re.compile(r"`((?:bus|observers|mesh|epibus)(?:\.\w+)+)(?:\(\))?`")
EXTERNAL = ("http://", "https://", "mailto:")


def doc_files() -> list[Path]:
    return [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]


def _problems(found: dict[str, list[str]]) -> str:
    return "\n".join(f"{doc}: {', '.join(items)}" for doc, items in found.items() if items)


def anchors(markdown: str) -> set[str]:
    """The anchors a Markdown renderer gives the headings: lowercased, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6} +(.+?) *$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_resolves() -> None:
    broken: dict[str, list[str]] = {}
    for doc in doc_files():
        for target in LINK.findall(doc.read_text()):
            path, _, anchor = target.partition("#")
            if target.startswith(EXTERNAL):
                continue
            linked = doc.parent / path if path else doc
            if not linked.exists():
                broken.setdefault(doc.name, []).append(target)
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
                broken.setdefault(doc.name, []).append(f"{target} (no such heading)")
    assert not broken, "links to files or headings that do not exist:\n" + _problems(broken)


def test_every_path_mentioned_exists() -> None:
    missing: dict[str, list[str]] = {}
    for doc in doc_files():
        for path in sorted(set(PATH.findall(doc.read_text()))):
            if not (ROOT / path).exists():
                missing.setdefault(doc.name, []).append(path)
    assert not missing, "paths named in docs that are not in the repository:\n" + _problems(missing)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            fields = {**getattr(obj, "model_fields", {}), **getattr(obj, "__dataclass_fields__", {})}
            if hasattr(obj, name):
                obj = getattr(obj, name)
            elif name in fields or name in getattr(obj, "__annotations__", {}):
                return name == parts[-1]  # a field: nothing further to follow
            else:
                return False
        return True
    return False


def _subject_names() -> set[str]:
    return {v for k, v in vars(subjects).items() if k.isupper() and isinstance(v, str)}


def test_every_code_name_mentioned_exists() -> None:
    """`bus.model.state.decide`, `mesh.protocol.TRANSITIONS`, ...: what a doc names in code font is in the code."""
    unknown: dict[str, list[str]] = {}
    subject_values = _subject_names()
    for doc in doc_files():
        for dotted in sorted(set(LAYER_NAME.findall(doc.read_text()))):
            if dotted in subject_values or "__mutmut_" in dotted:
                continue  # a request subject, or a mutant's name (docs/mutation.md), not a name in the code
            if not _resolves(dotted):
                unknown.setdefault(doc.name, []).append(dotted)
    assert not unknown, "names in docs that the code does not have:\n" + _problems(unknown)


def test_the_index_names_every_document() -> None:
    index = (DOCS / "README.md").read_text()
    unnamed = [p.name for p in sorted(DOCS.iterdir()) if p.is_file() and p.name != "README.md" and p.name not in index]
    assert not unnamed, f"docs/README.md does not list {', '.join(unnamed)}; add one line for each"


# Spelled in pieces so that this file does not match itself.
OUTSIDE = ("DES" + "IGN.md", "sha" + "red/")


def test_no_file_mentions_documents_outside_the_repository() -> None:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    found = []
    for name in sorted(filter(None, listed.stdout.decode().split("\0"))):
        path = ROOT / name
        if not path.is_file():
            continue  # deleted in the working tree
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        for number, line in enumerate(data.decode(errors="replace").splitlines(), start=1):
            if any(word in line for word in OUTSIDE):
                found.append(f"{name}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)


def main(argv: list[str]) -> int:
    wanted = set(argv)
    known = {table.__name__ for _, table in CASES}
    if wanted - known:
        print(f"unknown table {sorted(wanted - known)[0]!r}; known: {', '.join(sorted(known))}", file=sys.stderr)
        return 2
    for doc, table in CASES:
        if not wanted or table.__name__ in wanted:
            print(f"<!-- docs/{doc}: {table.__name__} -->\n{table()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# -- the module map -----------------------------------------------------------------------------------------

MODULE_LINE = re.compile(r"^- `((?:bus|observers|mesh|epibus)/[\w/]+\.py)`: \S", re.M)


def test_the_architecture_page_maps_every_module_in_one_line() -> None:
    """docs/architecture.md has exactly one `- \\`path\\`: what it owns` line per module, and no line for a
    module that is gone: a newcomer's map of where each concept lives cannot drift from the tree."""
    listed = MODULE_LINE.findall((DOCS / "architecture.md").read_text())
    modules = sorted(
        str(path.relative_to(ROOT))
        for layer in ("bus", "observers", "mesh", "epibus")
        for path in (ROOT / layer).rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    )
    repeated = sorted({m for m in listed if listed.count(m) > 1})
    assert repeated == []
    assert sorted(set(modules) - set(listed)) == []  # modules with no line
    assert sorted(set(listed) - set(modules)) == []  # lines for no module
