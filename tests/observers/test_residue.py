"""Finding what a forget left on disk: the file scan, the fingerprints it looks for, the proof's verdict, and
the mirror rewrite that removes a deleted point's bytes. No server needed."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import qdrant_edge as qe

from bus.model.forget import ForgetProof, ForgetReport, content_fingerprints, free_texts
from bus.model.kinds import FindingBody, VerifiedBody
from observers.mirror.edge import EdgeVectorStore
from observers.mirror.seal import create_shard
from observers.mirror.store import Point
from observers.residue import CHUNK_BYTES, scan_files

TEXT = "the vault under the old mill opens with the code 7-3-9-1-5, ask for Jürgen at the gate"


def needles(text: str) -> list[bytes]:
    return [f.encode() for f in content_fingerprints([text])]


def test_a_file_holding_the_text_is_named_and_the_others_are_not(tmp_path: Path) -> None:
    (tmp_path / "deep" / "er").mkdir(parents=True)
    holder = tmp_path / "deep" / "er" / "page.dat"
    holder.write_bytes(b"\x00" * 100 + TEXT.encode() + b"\x00" * 100)
    (tmp_path / "other.dat").write_bytes(b"the mill is closed on sundays")
    scan = scan_files([tmp_path], needles(TEXT))
    assert scan.files == [str(holder)]
    assert scan.scanned == 2


def test_a_text_split_across_two_read_chunks_is_found(tmp_path: Path) -> None:
    holder = tmp_path / "big.blk"
    holder.write_bytes(b"x" * (CHUNK_BYTES - 10) + TEXT.encode())
    assert scan_files([tmp_path], needles(TEXT)).files == [str(holder)]


def test_a_text_escaped_as_json_is_found(tmp_path: Path) -> None:
    holder = tmp_path / "envelope.json"
    holder.write_text(json.dumps({"body": {"text": TEXT}}))  # ensure_ascii: ü is written as \u00fc
    assert "ü" not in holder.read_text()
    assert scan_files([tmp_path], needles(TEXT)).files == [str(holder)]


def test_a_part_of_a_long_text_is_found(tmp_path: Path) -> None:
    long_text = " ".join(f"sentence {i} of a long report on the vault" for i in range(200))
    holder = tmp_path / "overflow.page"
    holder.write_text(long_text[-300:])  # only the tail made it into this page
    assert scan_files([tmp_path], needles(long_text)).files == [str(holder)]


def test_a_symlink_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "copy.txt").write_text(TEXT)
    home = tmp_path / "home"
    home.mkdir()
    (home / "link.txt").symlink_to(outside / "copy.txt")
    assert scan_files([home], needles(TEXT)).files == []


def test_only_free_texts_are_fingerprinted_not_labels_shared_with_other_events() -> None:
    body = FindingBody(
        text=TEXT, impact=0.5, confidence=0.5, subject="payments service outage", supersedes=str(uuid.uuid4())
    )
    assert free_texts(body) == [TEXT]
    assert free_texts(VerifiedBody(note="seen in the gate log on monday")) == ["seen in the gate log on monday"]


def test_a_text_too_short_to_fingerprint_gives_no_fingerprint() -> None:
    assert content_fingerprints(["ok", "  short text  "]) == []


def done_node(**changes: object) -> dict[str, object]:
    answer: dict[str, object] = {
        "journal_rows": 1,
        "journal_content_left": 0,
        "projection_rows": 0,
        "mirror_points": 0,
        "cached_vectors": 0,
        "files": [],
        "unreadable": [],
        "unscrubbable": {},
    }
    return answer | changes


def proof(node: dict[str, object], *, content: str = TEXT) -> ForgetProof:
    report = ForgetReport("p", "a", "e", [(1, "x")], content_fingerprints([content]))
    return ForgetProof(report, [1], {"node-a": node})


def test_a_proof_with_nothing_left_anywhere_is_clean() -> None:
    assert proof(done_node()).clean


def test_a_file_holding_the_text_makes_the_proof_not_clean() -> None:
    assert not proof(done_node(files=["/home/mirror/x"])).clean


def test_an_unreadable_file_makes_the_proof_not_clean() -> None:
    assert not proof(done_node(unreadable=["/home/x: Permission denied"])).clean


def test_a_cached_vector_of_the_text_makes_the_proof_not_clean() -> None:
    assert not proof(done_node(cached_vectors=1)).clean


def test_an_unscrubbable_store_makes_the_proof_complete_but_not_clean() -> None:
    found = proof(done_node(unscrubbable={"jetstream": "not this node's server"}))
    assert found.complete
    assert not found.clean


def test_a_node_that_did_not_scan_proves_nothing() -> None:
    node = done_node()
    del node["files"]
    assert not proof(node).complete


def test_content_too_short_to_fingerprint_is_never_clean() -> None:
    assert not proof(done_node(), content="ok").clean


async def test_compacting_the_edge_mirror_leaves_no_byte_of_a_deleted_point(tmp_path: Path) -> None:
    store = await EdgeVectorStore.open(tmp_path / "mirror", "test/model-4d", 4)
    try:
        kept = [Point(uuid.uuid4(), [0.1, 0.2, 0.3, 0.4], {"project": "p", "content": f"kept {i}"}) for i in range(300)]
        gone = Point(uuid.uuid4(), [0.4, 0.3, 0.2, 0.1], {"project": "p", "content": TEXT})
        await store.upsert([*kept, gone])
        await store.delete([gone.id])
        assert scan_files([tmp_path], needles(TEXT)).files  # a delete alone leaves the payload on disk
        assert await store.compact() == 300
        assert scan_files([tmp_path], needles(TEXT)).files == []
        assert [p.payload["content"] for p in await store.retrieve([kept[7].id])] == ["kept 7"]
    finally:
        await store.close()


async def test_a_compaction_interrupted_before_the_swap_is_undone_on_open(tmp_path: Path) -> None:
    path = tmp_path / "mirror"
    store = await EdgeVectorStore.open(path, "test/model-4d", 4)
    point = Point(uuid.uuid4(), [0.1, 0.2, 0.3, 0.4], {"project": "p"})
    await store.upsert([point])
    await store.close()
    create_shard(path / "hot-99", 4, False).close()  # the copy a compaction was writing when it was killed
    store = await EdgeVectorStore.open(path, "test/model-4d", 4)
    try:
        assert [p.id for p in await store.retrieve([point.id])] == [point.id]
        assert not (path / "hot-99").exists()
    finally:
        await store.close()


async def test_a_compaction_of_the_one_shard_layout_cut_short_is_undone_on_open(tmp_path: Path) -> None:
    """A mirror written before shards were sealed, killed between its compaction's two renames."""
    path = tmp_path / "mirror"
    path.mkdir()
    legacy = create_shard(path / "shard.retired", 4, False)
    point = Point(uuid.uuid4(), [0.1, 0.2, 0.3, 0.4], {"project": "p"})
    legacy.update(qe.UpdateOperation.upsert_points([qe.Point(str(point.id), list(point.vector), dict(point.payload))]))
    legacy.flush()
    legacy.close()
    create_shard(path / "shard.compacting", 4, False).close()
    (path / "collection.json").write_text(json.dumps({"model_id": "test/model-4d", "dimension": 4, "store_id": "s"}))
    store = await EdgeVectorStore.open(path, "test/model-4d", 4)
    try:
        assert [p.id for p in await store.retrieve([point.id])] == [point.id]
        assert not (path / "shard.retired").exists()
        assert not (path / "shard.compacting").exists()
    finally:
        await store.close()
