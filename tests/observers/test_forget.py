"""Forget, the privacy delete: proven on the stream, the journal and the mirror by reading each back, and on the
bytes of every file a node owns by scanning them."""

from __future__ import annotations

import json
import sqlite3
import uuid
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
from sqlalchemy import text

from bus.client.client import EpibusClient, connect
from bus.errors import NotFound
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey
from bus.model.forget import ForgetProof
from bus.model.ids import point_id
from bus.model.vocab import ReceiptLevel, Role
from bus.subjects import STREAM, VECTORS_STREAM, vector_subject
from epibus.node.node import Node, NodeConfig
from observers.mirror.embed import text_key
from observers.reads import artifacts, audit_artifacts, snapshot
from tests.conftest import finding
from tests.support import enrol_agent, eventually


async def test_forget_is_proven_on_the_stream_the_journal_and_the_mirror(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    config = NodeConfig(
        home=tmp_path / "node", nats_url=nats_server.url, name="node-a", journal_url=f"sqlite:///{tmp_path / 'j.db'}"
    )
    async with Node(config) as node:
        assert node.journal is not None
        assert node.store is not None
        assert node.mirror is not None
        async with (
            connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice,
            connect(nats_server.url, agent="bob", home=tmp_path / "bob", outbox=False) as bob,
        ):
            secret = alice.event("finding", finding(text="the customer's password is hunter2"), project=project)
            kept = alice.event("finding", finding(text="the login page is slow"), project=project)
            await alice.publish_many([secret, kept], wait_for=ReceiptLevel.journaled)
            await bob.transition(
                "verified", {"note": "saw hunter2 in the log"}, project=project, artifact_id=secret.artifact_id
            )
            await eventually(lambda: node.mirror is not None and node.mirror.indexed == 2, timeout_s=30)

            report = await alice.forget(project, secret.artifact_id, reason="personal data")
            assert len(report.messages) == 2  # the claim and its verification

            async def proven() -> ForgetProof | None:
                proof = await alice.prove_forgotten(report)
                return proof if proof.complete else None  # not clean: the server is not the node's own

            proof = await eventually(proven, timeout_s=30)
            assert proof.erased_seqs
            assert list(proof.nodes) == ["node-a"]
            for seq, _ in report.messages:  # read back by another path than the proof's
                with pytest.raises(nats.js.errors.NotFoundError):
                    await alice.js.get_msg(STREAM, seq)
            with pytest.raises(NotFound):
                await alice.forget(project, secret.artifact_id, reason="again")
            assert (await alice.recall("what is the password", project, k=5)).hits[0]["artifact_id"] == kept.artifact_id

        assert await node.store.retrieve([point_id(secret.event_id)]) == []
        assert [p.id for p in await node.store.retrieve([point_id(kept.event_id)])] == [point_id(kept.event_id)]
        with node.journal.engine.connect() as conn:
            rows = conn.execute(
                text("SELECT status, envelope FROM events WHERE artifact_id = :a AND kind != 'forgotten'"),
                {"a": secret.artifact_id},
            ).all()
            notes = (
                conn.execute(text("SELECT note FROM verifications WHERE artifact_id = :a"), {"a": secret.artifact_id})
                .scalars()
                .all()
            )
        assert {r.status for r in rows} == {"forgotten"}
        assert len(rows) == 2
        assert all("hunter2" not in r.envelope and json.loads(r.envelope)["redacted"] for r in rows)
        assert notes == [None]
        assert [v.state.artifact_id for v in artifacts(node.journal, project)] == [kept.artifact_id]
        assert [v.state.artifact_id for v in audit_artifacts(node.journal, project)] == [kept.artifact_id]
        node.journal.rebuild_projection()
        assert set(snapshot(node.journal, project).states) == {kept.artifact_id}


def secret_claim() -> tuple[str, str]:
    """A claim text with a token found nowhere else, and the token that the file scans look for."""
    token = uuid.uuid4().hex
    return f"the vault under the old mill opens with the code {token}", token


def files_holding(root: Path, token: str) -> list[str]:
    """Every file under root whose bytes hold the token, read by plain Python (not by the node's scanner).
    Symlinks are skipped: the model directory links to the installed model files."""
    needle = token.encode()
    return sorted(
        str(path.relative_to(root))
        for path in root.rglob("*")
        if not path.is_symlink() and path.is_file() and needle in path.read_bytes()
    )


async def forget_and_prove(client: EpibusClient, project: str, artifact_id: str) -> ForgetProof:
    report = await client.forget(project, artifact_id, reason="personal data")

    async def proven() -> ForgetProof | None:
        proof = await client.prove_forgotten(report)
        return proof if proof.clean else None

    return await eventually(proven, timeout_s=60)


async def publish_and_forget_completely(client: EpibusClient, project: str, text: str) -> ForgetProof:
    """Publish a claim, forget it, and wait until every node's proof is complete (clean or not)."""
    claim = client.event("finding", finding(text=text), project=project)
    await client.publish(claim, wait_for=ReceiptLevel.journaled, timeout_s=30)
    report = await client.forget(project, claim.artifact_id, reason="personal data")

    async def complete() -> ForgetProof | None:
        proof = await client.prove_forgotten(report)
        return proof if proof.complete else None

    return await eventually(complete, timeout_s=30)


async def as_admin(node: Node, home: Path, agent: str = "alice") -> None:
    """Enrol the agent under the node's home as an admin of every project before it connects: the stream's
    erase and the files' scrub are requests only admins may make."""
    key = AgentKey.load_or_create(home, agent)
    await enrol_agent(node.nats_url, home, key, roles=[Role.agent, Role.admin], projects=["*"])


async def publish_and_index(node: Node, client: EpibusClient, project: str, text: str) -> str:
    """Publish a claim and wait until the node has journaled and mirrored it. Returns its artifact id."""
    assert node.mirror is not None
    claim = client.event("finding", finding(text=text), project=project)
    await client.publish(claim, wait_for=ReceiptLevel.journaled, timeout_s=30)
    await eventually(lambda: node.mirror is not None and node.mirror.indexed >= 1, timeout_s=60)
    return claim.artifact_id


async def test_after_a_forget_no_file_of_the_node_holds_the_text(tmp_path: Path, project: str) -> None:
    home = tmp_path / "home"
    text_, token = secret_claim()
    async with Node(NodeConfig(home=home, name="node-a")) as node:
        await as_admin(node, home)
        async with connect(node.nats_url, agent="alice", home=home) as alice:
            artifact_id = await publish_and_index(node, alice, project, text_)
            before = {path.split("/")[0].removesuffix("-wal") for path in files_holding(home, token)}
            assert before == {"journal.db", "outbox.db", "mirror", "nats"}  # every store had a copy to erase
            proof = await forget_and_prove(alice, project, artifact_id)
        assert proof.clean
        assert files_holding(home, token) == []


async def test_a_restarted_node_holds_no_copy_of_a_forgotten_text(tmp_path: Path, project: str) -> None:
    home = tmp_path / "home"
    text_, token = secret_claim()
    config = NodeConfig(home=home, name="node-a")
    async with Node(config) as node:
        await as_admin(node, home)
        async with connect(node.nats_url, agent="alice", home=home) as alice:
            artifact_id = await publish_and_index(node, alice, project, text_)
            await forget_and_prove(alice, project, artifact_id)
    async with Node(config) as node, connect(node.nats_url, agent="alice", home=home, outbox=False) as alice:
        kept = alice.event("finding", finding(text="the mill is closed on sundays"), project=project)
        await alice.publish(kept, wait_for=ReceiptLevel.journaled, timeout_s=30)
        await eventually(lambda: node.mirror is not None and node.mirror.indexed >= 1, timeout_s=60)
    assert files_holding(home, token) == []


async def test_the_proof_names_a_file_left_holding_the_text(tmp_path: Path, project: str) -> None:
    home = tmp_path / "home"
    text_, _ = secret_claim()
    config = NodeConfig(home=home, name="node-a")
    async with Node(config) as node:
        await as_admin(node, home)
        async with connect(node.nats_url, agent="alice", home=home) as alice:
            artifact_id = await publish_and_index(node, alice, project, text_)
            clean = await forget_and_prove(alice, project, artifact_id)
            stray = home / "mirror" / "stray-copy.bin"
            stray.write_bytes(b"kept by accident: " + text_.encode())
            proof = await alice.prove_forgotten(clean.report)
    assert not proof.clean
    assert proof.nodes["node-a"]["files"] == [str(stray)]


async def test_a_node_on_a_server_it_does_not_run_names_the_stream_store_unscrubbable(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    home = tmp_path / "home"
    text_, token = secret_claim()
    config = NodeConfig(home=home, nats_url=nats_server.url, name="node-a", mirror="off")
    async with Node(config), connect(nats_server.url, agent="alice", home=home) as alice:
        proof = await publish_and_forget_completely(alice, project, text_)
    assert files_holding(home, token) == []
    assert set(proof.nodes["node-a"]["unscrubbable"]) == {"jetstream"}
    assert not proof.clean


async def test_a_forget_drops_the_cached_and_the_shared_vector_of_the_text(tmp_path: Path, project: str) -> None:
    home = tmp_path / "home"
    text_, _ = secret_claim()

    def cached(key: str) -> int:  # read by another connection than the cache's own
        with sqlite3.connect(f"file:{home / 'embed-cache.db'}?mode=ro", uri=True) as db:
            return int(db.execute("SELECT count(*) FROM vectors WHERE key = ?", (key,)).fetchone()[0])

    config = NodeConfig(home=home, name="node-a")
    async with Node(config) as node:
        await as_admin(node, home)
        async with connect(node.nats_url, agent="alice", home=home) as alice:
            assert node.embedder is not None
            key = text_key(node.embedder.model_id, text_)
            artifact_id = await publish_and_index(node, alice, project, text_)
            assert cached(key) == 1
            assert node.js is not None  # agents may not read shared vectors: the node's own connection does
            shared = await node.js.get_last_msg(VECTORS_STREAM, vector_subject(key))  # the fleet's copy
            with pytest.raises(nats.errors.TimeoutError):  # a permission violation, as nats-py reports one
                await alice.js.get_last_msg(VECTORS_STREAM, vector_subject(key))
            proof = await forget_and_prove(alice, project, artifact_id)
            assert cached(key) == 0
            assert proof.nodes["node-a"]["shared_vectors"] == 0
            assert proof.nodes["node-a"]["scrubbed"]["shared_vectors"] == 1
            with pytest.raises(nats.js.errors.NotFoundError):
                await node.js.get_msg(VECTORS_STREAM, shared.seq)
            with pytest.raises(nats.js.errors.NotFoundError):
                await node.js.get_last_msg(VECTORS_STREAM, vector_subject(key))


async def test_a_postgresql_journal_is_named_unscrubbable(tmp_path: Path, project: str, postgres_url: str) -> None:
    home = tmp_path / "home"
    text_, token = secret_claim()
    config = NodeConfig(home=home, name="node-a", journal_url=postgres_url, mirror="off")
    async with Node(config) as node:
        await as_admin(node, home)
        async with connect(node.nats_url, agent="alice", home=home) as alice:
            proof = await publish_and_forget_completely(alice, project, text_)
    assert files_holding(home, token) == []
    assert set(proof.nodes["node-a"]["unscrubbable"]) == {"journal"}
    assert not proof.clean
