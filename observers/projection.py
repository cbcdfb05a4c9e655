"""The state projection: artifacts' current trust, lifecycle, resolution and links, the verification log and
tombstones, derived from journaled events in stream order by `bus.model.state.decide`.

It runs inside the journal's write transaction, so an event and what it did commit together. An event that
is illegal or forbidden at apply time is marked `rejected` with its reason and changes nothing. The stream's
enrolment records that batches carry are kept in `enrolment_log`, so a rebuild decides with them again."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sqlalchemy import and_, bindparam, delete, func, inspect, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from bus.intake.admission import Delivery
from bus.intake.batch_context import batch_authority, batch_erased
from bus.model.auth import Enrolment, ReviewPolicy
from bus.model.authority import NO_RECORDS, Authority
from bus.model.erasure import ErasedMap, ErasedRecord, erased_record, with_erased
from bus.model.event import Envelope, validate_event
from bus.model.state import REFUSED, ArtifactState, Change, decide, event_references, vouched_of
from bus.model.tombstones import content_hash
from observers.schema import (
    artifacts,
    as_utc,
    enrolment_log,
    events,
    projection_cursor,
    review_policies,
    tombstones,
    verifications,
)

log = logging.getLogger(__name__)
CURSOR = "state"
FORGOTTEN = "forgotten"  # events.status of a redacted event: its content is gone, its audit row stays
REBUILD_CHUNK = 2_000


def state_to_row(s: ArtifactState) -> dict[str, Any]:
    """An `artifacts` row: the state's record, with times as datetimes, flags as one comma-joined string and who
    vouched as JSON lists (NULL when empty)."""
    record = s.to_record()
    return record | {
        "created_at": s.created_at,
        "updated_at": s.updated_at,
        "flags": ",".join(record["flags"]) or None,
        "verified_by": json.dumps(record["verified_by"]) if s.verified_by else None,
        "reviewed_by": json.dumps(record["reviewed_by"]) if s.reviewed_by else None,
        "reviewed_at": s.reviewed_at,
    }


def row_to_state(m: Any) -> ArtifactState:
    """The state an `artifacts` row holds (its datetimes read back in UTC)."""
    updated_at, reviewed_at = m["updated_at"], m["reviewed_at"]
    return ArtifactState.from_record(
        dict(m)
        | {
            "created_at": as_utc(m["created_at"]).isoformat(),
            "updated_at": as_utc(updated_at).isoformat() if updated_at is not None else None,
            "flags": m["flags"].split(",") if m["flags"] else [],
            "verified_by": json.loads(m["verified_by"]) if m["verified_by"] else [],
            "reviewed_by": json.loads(m["reviewed_by"]) if m["reviewed_by"] else [],
            "reviewed_at": as_utc(reviewed_at).isoformat() if reviewed_at is not None else None,
        }
    )


VOUCHED_COLUMNS = (artifacts.c.verified_by, artifacts.c.reviewed_by, artifacts.c.reviewed_at)


def row_vouched(m: Any) -> dict[str, Any]:
    """Who vouched, from an `artifacts` row's (or a join's) three columns; an event of no artifact: no one."""
    reviewed_at = m["reviewed_at"]
    return vouched_of(
        json.loads(m["verified_by"]) if m["verified_by"] else [],
        json.loads(m["reviewed_by"]) if m["reviewed_by"] else [],
        as_utc(reviewed_at) if reviewed_at is not None else None,
    )


class BatchState:
    """Artifact states and tombstones a batch touches, loaded once (by primary key, per project) and written
    back once: the artifacts with one upsert, verifications and tombstones with one insert each."""

    def __init__(self, conn: Connection, batch: Sequence[Envelope]) -> None:
        self.conn = conn
        self.states: dict[tuple[str, str], ArtifactState | None] = {}
        self.dirty: set[tuple[str, str]] = set()
        self.tombstoned: dict[str, set[str]] = {}
        self._hashes_read: dict[str, set[str]] = {}  # per project, the content hashes asked of the table so far
        self._verifications: list[dict[str, Any]] = []
        self._tombstones: list[dict[str, Any]] = []
        self._load({(e.project, ref) for e in batch for ref in event_references(e)})
        claims: dict[str, set[str]] = {}
        for e in batch:
            self.tombstoned.setdefault(e.project, set())
            self._hashes_read.setdefault(e.project, set())
            if not e.body.transition:
                claims.setdefault(e.project, set()).add(content_hash(e.body.content_text()))
        for project, hashes in claims.items():
            self._read_tombstones(project, hashes)

    def _load(self, keys: set[tuple[str, str]]) -> None:
        # project = ? AND artifact_id IN (…) is a primary key search; a row-value IN is a scan in SQLite.
        wanted: dict[str, list[str]] = {}
        for project, artifact_id in sorted(k for k in keys if k not in self.states):
            wanted.setdefault(project, []).append(artifact_id)
        for project, ids in wanted.items():
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                found = self.conn.execute(
                    select(artifacts).where(artifacts.c.project == project, artifacts.c.artifact_id.in_(chunk))
                )
                for row in found:
                    self.states[(row.project, row.artifact_id)] = row_to_state(row._mapping)
                for artifact_id in chunk:
                    self.states.setdefault((project, artifact_id), None)

    def _read_tombstones(self, project: str, hashes: set[str]) -> None:
        """Which of these content hashes the table holds for the project (the batch's own are in memory)."""
        wanted = sorted(hashes - self._hashes_read[project])
        for start in range(0, len(wanted), 500):
            chunk = wanted[start : start + 500]
            self.tombstoned[project].update(
                self.conn.execute(
                    select(tombstones.c.content_hash).where(
                        tombstones.c.project == project, tombstones.c.content_hash.in_(chunk)
                    )
                ).scalars()
            )
        self._hashes_read[project].update(wanted)

    def is_tombstoned(self, project: str) -> Callable[[str], bool]:
        def check(digest: str) -> bool:
            if digest not in self._hashes_read[project]:
                self._read_tombstones(project, {digest})
            return digest in self.tombstoned[project]

        return check

    def lookup(self, project: str) -> Any:
        def get(artifact_id: str) -> ArtifactState | None:
            key = (project, artifact_id)
            if key not in self.states:
                self._load({key})
            return self.states[key]

        return get

    def absorb(self, project: str, change: Change) -> None:
        for state in change.artifacts:
            if state.erased:
                continue  # a forgotten artifact's state: its forget's history holds it, no row does
            key = (state.project, state.artifact_id)
            self.states[key] = state
            self.dirty.add(key)
        if change.verification is not None:
            v = change.verification
            self._verifications.append(
                {
                    "event_id": v.event_id,
                    "project": project,
                    "artifact_id": v.artifact_id,
                    "verifier": v.verifier,
                    "recorded_at": v.recorded_at,
                    "stream_seq": v.stream_seq,
                    "note": v.note,
                    "human_review": v.human_review,
                }
            )
        if change.tombstone is not None and not self.is_tombstoned(project)(change.tombstone.content_hash):
            t = change.tombstone
            self.tombstoned[project].add(t.content_hash)
            self._tombstones.append(
                {
                    "project": project,
                    "content_hash": t.content_hash,
                    "artifact_id": t.artifact_id,
                    "event_id": t.event_id,
                    "reason": t.reason,
                }
            )

    def _insert_pending(self) -> None:
        """The verifications and tombstones absorbed so far, one executemany per table."""
        if self._verifications:
            self.conn.execute(verifications.insert(), self._verifications)
            self._verifications = []
        if self._tombstones:
            self.conn.execute(tombstones.insert(), self._tombstones)
            self._tombstones = []

    def forget(self, project: str, artifact_id: str, forgotten_by: str, forgotten_seq: int) -> None:
        """A privacy delete: the artifact leaves the projection, its events keep an audit row each (who, when,
        which event erased it) with the content gone, and verification notes go too."""
        key = (project, artifact_id)
        self.states[key] = None
        self.dirty.discard(key)
        self._insert_pending()  # its verification notes go too, those of this batch included
        self.conn.execute(
            delete(artifacts).where(artifacts.c.project == project, artifacts.c.artifact_id == artifact_id)
        )
        self.conn.execute(
            update(verifications)
            .where(verifications.c.project == project, verifications.c.artifact_id == artifact_id)
            .values(note=None)
        )
        rows = self.conn.execute(
            select(events.c.event_id, events.c.kind, events.c.actor_id, events.c.recorded_at).where(
                events.c.project == project,
                events.c.artifact_id == artifact_id,
                # What came before the forget, in stream order: the same rows however the events were batched.
                events.c.stream_seq < forgotten_seq,
                events.c.event_id != forgotten_by,
            )
        ).all()
        for row in rows:
            audit = {
                "event_id": row.event_id,
                "kind": row.kind,
                "actor": row.actor_id,
                "redacted": True,
                "forgotten_by": forgotten_by,
            }
            self.conn.execute(
                update(events)
                .where(events.c.event_id == row.event_id)
                .values(envelope=json.dumps(audit), status=FORGOTTEN, reason=f"forgotten by {forgotten_by}", flags=None)
            )

    def flush(self) -> None:
        self._insert_pending()
        rows = [state_to_row(s) for k in sorted(self.dirty) if (s := self.states[k]) is not None]
        if not rows:
            return
        insert = (postgresql.insert if self.conn.dialect.name == "postgresql" else sqlite.insert)(artifacts)
        columns = {c: insert.excluded[c] for c in rows[0] if c not in ("project", "artifact_id")}
        self.conn.execute(insert.on_conflict_do_update(index_elements=["project", "artifact_id"], set_=columns), rows)
        self.dirty.clear()


def cursor(conn: Connection) -> int:
    found = conn.execute(select(projection_cursor.c.last_seq).where(projection_cursor.c.name == CURSOR)).scalar()
    return int(found or 0)


def _set_cursor(conn: Connection, seq: int) -> None:
    if conn.execute(update(projection_cursor).where(projection_cursor.c.name == CURSOR).values(last_seq=seq)).rowcount:
        return
    conn.execute(projection_cursor.insert().values(name=CURSOR, last_seq=seq))


def apply_events(
    conn: Connection, batch: Iterable[tuple[Envelope, int]], erased: ErasedMap, authority: Authority
) -> dict[str, str]:
    """Apply events in stream order; returns {event_id: reason} for those rejected. `erased` holds what later
    forgets recorded of artifacts whose messages the stream no longer has; `authority` the enrolment records."""
    ordered = sorted(batch, key=lambda pair: pair[1])
    if not ordered:
        return {}
    state = BatchState(conn, [e for e, _ in ordered])
    rejected: dict[str, str] = {}
    outcomes = []
    for event, seq in ordered:
        lookup = with_erased(state.lookup(event.project), erased, event.project, seq)
        try:
            change = decide(event, seq, lookup, state.is_tombstoned(event.project), authority)
        except REFUSED as e:
            rejected[str(event.event_id)] = str(e)
            outcomes.append({"b_id": str(event.event_id), "b_status": "rejected", "b_reason": str(e), "b_flags": None})
            continue
        state.absorb(event.project, change)
        if event.kind == "forgotten" and change.artifacts:
            state.forget(event.project, event.artifact_id, str(event.event_id), seq)
        if change.flags:
            flags = ",".join(sorted(change.flags))
            outcomes.append({"b_id": str(event.event_id), "b_status": "applied", "b_reason": None, "b_flags": flags})
    state.flush()
    if outcomes:
        conn.execute(
            update(events)
            # A row a later forget in this batch redacted keeps its forgotten status.
            .where(events.c.event_id == bindparam("b_id"), events.c.status != FORGOTTEN)
            .values(status=bindparam("b_status"), reason=bindparam("b_reason"), flags=bindparam("b_flags")),
            outcomes,
        )
    _set_cursor(conn, max(cursor(conn), ordered[-1][1]))
    return rejected


def project_deliveries(conn: Connection, deliveries: Sequence[Delivery]) -> dict[str, str]:
    """Apply newly journaled deliveries. If any arrives behind the cursor (a redelivery overtaken by later
    events), the whole projection is rebuilt from the journal so the state is the stream-order fold."""
    if not deliveries:
        return {}
    erased = batch_erased(deliveries)
    learned = record_enrolments(conn, batch_authority(deliveries))
    # An enrolment record before events already decided (it was learned late: a journal upgraded from before
    # records existed) changes what they may have done: decide them again, as a fresh journal would.
    behind = min(min(d.stream_seq for d in deliveries), learned or cursor(conn)) < cursor(conn)
    if behind:
        log.warning("an event or enrolment record arrived behind the projection cursor; rebuilding in stream order")
        rebuild(conn)
        found = conn.execute(
            select(events.c.event_id, events.c.reason).where(
                and_(events.c.event_id.in_([str(d.event.event_id) for d in deliveries]), events.c.status == "rejected")
            )
        )
        return {row.event_id: row.reason for row in found}
    return apply_events(conn, [(d.event, d.stream_seq) for d in deliveries], erased, enrolments_in_journal(conn))


def rebuild(conn: Connection) -> int:
    """Recompute the whole projection from the journal's events in stream order. Returns events applied."""
    for table in (artifacts, verifications, tombstones, projection_cursor):
        conn.execute(delete(table))
    conn.execute(update(events).where(events.c.status != FORGOTTEN).values(status="applied", reason=None, flags=None))
    # A journal being migrated to the version that keeps them has no enrolment records yet.
    authority = enrolments_in_journal(conn) if inspect(conn).has_table(enrolment_log.name) else NO_RECORDS
    erased = forgets_in_journal(conn, authority)
    applied, after = 0, 0
    while True:
        rows = conn.execute(
            select(events.c.stream_seq, events.c.envelope, events.c.status)
            .where(events.c.stream_seq > after)
            .order_by(events.c.stream_seq)
            .limit(REBUILD_CHUNK)
        ).all()
        if not rows:
            return applied
        apply_events(
            conn,
            [(validate_event(json.loads(r.envelope)), r.stream_seq) for r in rows if r.status != FORGOTTEN],
            erased,
            authority,
        )
        applied += len(rows)
        after = rows[-1].stream_seq


def forgets_in_journal(conn: Connection, authority: Authority) -> dict[tuple[str, str], tuple[ErasedRecord, ...]]:
    """What the journal's own `forgotten` events recorded (those their actors were allowed to make): a rebuild
    re-applies the links other events had to artifacts whose rows are redacted, as they were applied the first
    time."""
    found: dict[tuple[str, str], tuple[ErasedRecord, ...]] = {}
    rows = conn.execute(
        select(events.c.envelope, events.c.stream_seq)
        .where(events.c.kind == "forgotten", events.c.status != FORGOTTEN)
        .order_by(events.c.stream_seq)
    )
    for row in rows:
        event = validate_event(json.loads(row.envelope))
        record = erased_record(event, row.stream_seq, authority)
        if record is not None:
            key = (event.project, event.artifact_id)
            found[key] = (*found.get(key, ()), record)
    return found


def record_enrolments(conn: Connection, authority: Authority) -> int | None:
    """Keep the enrolment records a batch carries that the journal does not hold yet; returns the stream
    sequence of the first one kept now, if any. A batch carries every record the stream had when it was read,
    so those above the highest kept are the new ones."""
    kept = conn.execute(select(func.max(enrolment_log.c.stream_seq))).scalar() or 0
    new = [(seq, e) for seq, e in authority.in_order() if seq > kept]
    if new:
        rows = [{"stream_seq": seq, "agent_id": e.agent_id, "enrolment": e.model_dump_json()} for seq, e in new]
        conn.execute(enrolment_log.insert(), rows)
    # Review policies decide nothing (reads apply them): kept, never a reason to decide again.
    policies = authority.policies_in_order()
    if policies:  # most batches carry none: no query for them
        kept_policy = conn.execute(select(func.max(review_policies.c.stream_seq))).scalar() or 0
        policies = [(seq, p) for seq, p in policies if seq > kept_policy]
    if policies:
        rows = [{"stream_seq": seq, "project": p.project, "policy": p.model_dump_json()} for seq, p in policies]
        conn.execute(review_policies.insert(), rows)
    return new[0][0] if new else None


def enrolments_in_journal(conn: Connection, *, policies: bool = False) -> Authority:
    """The enrolment records this journal has decided with: a rebuild and an as-of read decide with them again.
    `policies`: with the review policies it keeps too (reads apply them; deciding never does)."""
    rows = conn.execute(select(enrolment_log.c.stream_seq, enrolment_log.c.enrolment))
    records = [(row.stream_seq, Enrolment.model_validate_json(row.enrolment)) for row in rows]
    if not policies:
        return Authority.of(records)
    found = conn.execute(select(review_policies.c.stream_seq, review_policies.c.policy))
    return Authority.of(records, [(row.stream_seq, ReviewPolicy.model_validate_json(row.policy)) for row in found])
