"""Ids as a person types them: every command that takes an artifact or task id takes any unique prefix of it
(bus.model.ids.id_prefix: 4 or more hex digits, dashes ignored), resolved here, one function per id space, before
anything is sent: the whole id travels on the wire, never the prefix."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from bus.host.home import epibus_home, resolve_journal_url
from bus.model.ids import id_digits, id_prefix, only_match

if TYPE_CHECKING:
    from mesh.agent import MeshAgent


def artifact_id(value: str, *, field: str, project: str | None, journal: str | None, home: Path | None) -> str:
    """The artifact id `value` abbreviates, looked up in the journal (--journal, else the node's) within the
    project (every project when None); `value` itself when it is a whole id. Raises NotFound or AmbiguousId."""
    digits = id_prefix(value)
    if digits is None:
        return value
    # Loaded here, not at the top: SQLAlchemy is a large part of every CLI start, and few commands read the journal.
    from observers.journal import Journal
    from observers.reads import artifact_ids_like

    store = Journal(resolve_journal_url(journal, epibus_home(home)))
    try:
        store.migrate()
        found = artifact_ids_like(store, project, value, digits)
    finally:
        store.close()
    where = f"in project {project!r}" if project else "in any project"
    hint = f"list them with `epibus audit -p {project}`" if project else "list them with `epibus events`"
    return only_match(value, field, found, what="artifact", where=where, hint=hint)


def optional_artifact_id(
    value: str | None, *, field: str, project: str | None, journal: str | None, home: Path | None
) -> str | None:
    return None if value is None else artifact_id(value, field=field, project=project, journal=journal, home=home)


async def task_id(mesh: MeshAgent, value: str, *, field: str, project: str | None) -> str:
    """The task id `value` abbreviates, looked up in the mesh bucket within the project (every project when
    None); `value` itself when it is a whole id. Raises NotFound or AmbiguousId."""
    digits = id_prefix(value)
    if digits is None:
        return value
    ids = sorted({entry.record.task_id for entry in await mesh.store.tasks(project)})
    found = [value] if value in ids else [i for i in ids if id_digits(i).startswith(digits)]
    where = f"in project {project!r}" if project else "in any project"
    return only_match(value, field, found, what="task", where=where, hint="list them with `epibus mesh outbox`")
