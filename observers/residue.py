"""What a forget may leave in a node's files: erasing it from each store the node owns, then scanning every
file of those stores for fingerprints of the forgotten content and naming each file that still holds one.
A store whose files the node cannot scan or rewrite is named unscrubbable, with the reason."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from sqlalchemy.engine import make_url

from bus.enrolment.service_rules import forget_proof_rule
from bus.model.ids import point_id
from bus.model.requests import ForgetProofReply, ForgetProofRequest
from bus.outbox.outbox import Outbox
from bus.services.responder import Service
from bus.subjects import PROVE_FORGOTTEN
from observers.journal import Journal
from observers.mirror.embed import CachedEmbedder
from observers.mirror.fleet_vectors import FleetEmbedder
from observers.mirror.store import VectorStore
from observers.watch.pusher import WatchPusher

CHUNK_BYTES = 1 << 20  # files are read in pieces: a mirror WAL or a stream block can be large
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


@runtime_checkable
class CompactableStore(Protocol):
    """A vector store in local files that can rewrite them without its deleted points."""

    path: Path

    async def compact(self) -> int: ...


def compactable(store: object) -> CompactableStore | None:
    """The store, if it keeps its points in local files it can rewrite (qdrant-edge); None otherwise."""
    return store if isinstance(store, CompactableStore) else None


@dataclass(frozen=True)
class NodeFiles:
    """One node's stores, by handle (to scrub them) and by file (to scan them)."""

    home: Path
    journal: Journal
    outbox: Outbox | None = None
    cache: CachedEmbedder | None = None
    shared: FleetEmbedder | None = None  # the fleet's shared vectors, as this node reads and writes them
    store: VectorStore | None = None
    notices: WatchPusher | None = None  # watch notices pushed about the claim (None: the node runs no mirror)
    nats_store: Path | None = None  # the embedded server's store; None when the node joined a server by URL
    nats_url: str = ""

    def roots(self) -> list[Path]:
        """Every file and directory to scan: the home, and each store kept outside it."""
        roots = [self.home]
        for db in (sqlite_file(self.journal), self.outbox.path if self.outbox else None):
            if db is not None:
                roots += [db] + [db.with_name(db.name + suffix) for suffix in SQLITE_SIDE_FILES]
        local = compactable(self.store)
        if local is not None:
            roots.append(local.path)
        if self.nats_store is not None:
            roots.append(self.nats_store)
        return roots

    def unscrubbable(self) -> dict[str, str]:
        """Stores whose bytes this node can neither scan nor rewrite, and why: never counted as clean."""
        found: dict[str, str] = {}
        if self.journal.dialect != "sqlite":
            found["journal"] = (
                f"{self.journal.dialect} keeps old row versions in its data files until reused and in its WAL; "
                "those are the server's files (the journal's tables were vacuumed; scan the server's disk)"
            )
        if self.nats_store is None:
            found["jetstream"] = (
                f"the server at {self.nats_url or 'its URL'} is not this node's: the messages were erased with "
                "delete_msg (the server overwrites them) but its files cannot be scanned from here"
            )
        if self.store is not None and compactable(self.store) is None:
            found["mirror"] = (
                "a Qdrant server keeps deleted points in its own WAL and segments until it optimizes; they "
                "cannot be scanned or rewritten from here"
            )
        return found


def sqlite_file(journal: Journal) -> Path | None:
    database = make_url(journal.url).database
    return Path(database) if journal.dialect == "sqlite" and database and database != ":memory:" else None


@dataclass
class Scan:
    files: list[str] = field(default_factory=list)  # files that hold a fingerprint
    unreadable: list[str] = field(default_factory=list)  # files the scan could not read, with the reason
    scanned: int = 0


def scan_files(roots: Sequence[Path], needles: Sequence[bytes]) -> Scan:
    """Every regular file under the roots (symlinks are not followed) that holds any of the needles."""
    scan = Scan()
    if not needles:
        return scan
    seen: set[Path] = set()
    for path in _files(roots):
        if path in seen:
            continue
        seen.add(path)
        try:
            held = _holds(path, needles)
        except FileNotFoundError:
            continue  # removed while the scan ran (a rotated log or temporary file): it holds nothing now
        except OSError as e:
            scan.unreadable.append(f"{path}: {e.strerror or e}")
            continue
        scan.scanned += 1
        if held:
            scan.files.append(str(path))
    scan.files.sort()
    return scan


def _files(roots: Sequence[Path]) -> Iterator[Path]:
    for root in roots:
        root = root.absolute()
        if root.is_symlink():
            continue
        if root.is_file():
            yield root
            continue
        for folder, _dirs, names in os.walk(root):
            for name in names:
                path = Path(folder) / name
                if not path.is_symlink() and path.is_file():
                    yield path


def _holds(path: Path, needles: Sequence[bytes]) -> bool:
    overlap = max(len(n) for n in needles) - 1  # a needle split across two chunks is still found
    tail = b""
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            window = tail + chunk
            if any(needle in window for needle in needles):
                return True
            tail = window[-overlap:] if overlap else b""
    return False


async def scrub(
    files: NodeFiles, project: str, artifact_id: str, embedded_texts: Sequence[str]
) -> dict[str, int | bool]:
    """Erase what a forget leaves in the outbox, the embedding cache, the fleet's shared vectors, the watch notices
    pushed about the claim and the journal's WAL: what each held. Idempotent."""
    done: dict[str, int | bool] = {}
    if files.outbox is not None:
        done["outbox_rows"] = await files.outbox.forget(project, artifact_id)
    if files.cache is not None:
        done["cached_vectors"] = await files.cache.forget(embedded_texts)
    if files.shared is not None:
        done["shared_vectors"] = await files.shared.erase(embedded_texts)
    if files.notices is not None:
        done["watch_notices"] = await files.notices.erase([(project, artifact_id)])
    done["journal_wal_reset"] = await asyncio.to_thread(files.journal.scrub)
    return done


async def prove_forgotten(files: NodeFiles, request: ForgetProofRequest, *, node: str) -> ForgetProofReply:
    """Answer a proof request: read the journal and the mirror back by event id and, once both have applied
    the forget, scrub (when asked) and scan every file for the request's fingerprints. Rewrites the mirror
    only when its files still hold one. Raises Unavailable."""
    ids = [str(e) for e in request.event_ids]
    project, artifact_id = request.project, request.artifact_id
    rows = await asyncio.to_thread(files.journal.forgotten_check, project, artifact_id, ids)
    points = await files.store.retrieve([point_id(uuid.UUID(e)) for e in ids]) if files.store else []
    applied = not (rows["journal_content_left"] or rows["projection_rows"] or points)
    texts = list(request.embedded_texts)
    needles = sorted({f.encode() for f in request.fingerprints})
    scrubbed = await scrub(files, project, artifact_id, texts) if applied and request.scrub else {}
    found = await asyncio.to_thread(scan_files, files.roots(), needles)
    store = compactable(files.store)
    if scrubbed and store is not None and _under(found.files, store.path):
        scrubbed["mirror_points_kept"] = await store.compact()
        found = await asyncio.to_thread(scan_files, files.roots(), needles)
    return ForgetProofReply(
        node=node,
        journal_rows=rows["journal_rows"],
        journal_content_left=rows["journal_content_left"],
        projection_rows=rows["projection_rows"],
        mirror_points=len(points),
        scrubbed=scrubbed,
        cached_vectors=await files.cache.count_cached(texts) if files.cache else 0,
        shared_vectors=await files.shared.count_shared(texts) if files.shared else 0,
        watch_notices=await files.notices.notices_left(project, artifact_id) if files.notices else None,
        files=found.files,
        unreadable=found.unreadable,
        scanned=found.scanned,
        unscrubbable=files.unscrubbable(),
    )


def _under(paths: Sequence[str], folder: Path) -> bool:
    root = folder.absolute()
    return any(Path(p).is_relative_to(root) for p in paths)


def forget_proof_service(files: Callable[[], NodeFiles], *, node: str) -> Service[ForgetProofRequest]:
    """The PROVE_FORGOTTEN service: finish a forget on the node's files as they stand (when asked) and prove
    it: rows, points and bytes."""

    async def answer(request: ForgetProofRequest) -> ForgetProofReply:
        return await prove_forgotten(files(), request, node=node)

    return Service(PROVE_FORGOTTEN, ForgetProofRequest, ForgetProofReply, answer, forget_proof_rule)
