"""The fleet's shared vectors, with a real nats-server, the real model and the real agent registry: a text one node
embedded is taken by another without its model; forged, tampered, foreign and lying vectors are refused and the
text embedded locally; a forget erases what was shared; a stream that does not answer costs only the model's time."""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import cast

import nats
import nats.js.errors
import pytest
from nats.js import JetStreamContext

from bus.broker.streams import ensure_streams
from bus.enrolment.registry import AgentRegistry
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey
from bus.subjects import (
    SIGNATURE_HEADER,
    SIGNER_KEY_HEADER,
    VECTOR_DIMENSION_HEADER,
    VECTOR_MODEL_HEADER,
    VECTORS_STREAM,
    vector_subject,
)
from observers.mirror.embed import FastEmbedder, text_key
from observers.mirror.fleet_vectors import VECTOR_PURPOSE, FleetEmbedder, pack, unpack, vector_document

TEXTS = [
    "the cache is cold after every deploy",
    "disks fill up at night when logs rotate late",
    "dns lookups flap under load",
    "the queue backs up when a consumer restarts",
    "certificates expire on the first of the month",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> FastEmbedder:
    return FastEmbedder(tmp_path_factory.mktemp("home")).load_blocking()


class CountingModel:
    """The real model, counting the texts it is asked to embed (what sharing is meant to save)."""

    def __init__(self, model: FastEmbedder) -> None:
        self.inner = model
        self.texts: list[str] = []

    @property
    def model_id(self) -> str:
        return self.inner.model_id

    @property
    def dimension(self) -> int:
        return self.inner.dimension

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.texts += texts
        return await self.inner.embed(texts)


@pytest.fixture
async def js(nats_server: NatsServer) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await ensure_streams(js, replicas=1)
    yield js
    await nc.close()


async def a_node(js: JetStreamContext, model: FastEmbedder, name: str, *, check_every: int = 1000) -> FleetEmbedder:
    key = AgentKey.generate("node")
    registry = AgentRegistry(js)
    await registry.register_node(key.public_key, name)
    return FleetEmbedder(CountingModel(model), lambda: js, key, AgentRegistry(js).is_node_key, check_every=check_every)


def counted(fleet: FleetEmbedder) -> list[str]:
    assert isinstance(fleet.model, CountingModel)
    return fleet.model.texts


def close(a: Sequence[float], b: Sequence[float]) -> bool:
    return all(math.isclose(x, y, abs_tol=1e-6) for x, y in zip(a, b, strict=True))


async def stored(js: JetStreamContext, model_id: str, text: str) -> list[float] | None:
    try:
        msg = await js.get_last_msg(VECTORS_STREAM, vector_subject(text_key(model_id, text)))
    except nats.js.errors.NotFoundError:
        return None
    return unpack(msg.data or b"")


async def put(
    js: JetStreamContext, key: AgentKey, text: str, vector: list[float], *, model_id: str, **changes: str
) -> None:
    """A vector on the stream as a node (or a forger) would put it; `changes` overrides headers."""
    subject = vector_subject(text_key(model_id, text))
    data = pack(vector)
    headers = {
        VECTOR_MODEL_HEADER: model_id,
        VECTOR_DIMENSION_HEADER: str(len(vector)),
        SIGNER_KEY_HEADER: key.public_key,
        SIGNATURE_HEADER: key.sign_document(VECTOR_PURPOSE, vector_document(subject, model_id, len(vector), data)),
    } | changes
    await js.publish(subject, data, stream=VECTORS_STREAM, headers=headers)


def random_unit(dimension: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    vector = [rng.gauss(0, 1) for _ in range(dimension)]
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector]


async def test_a_text_one_node_embedded_is_taken_by_another_without_its_model(
    js: JetStreamContext, model: FastEmbedder
) -> None:
    first = await a_node(js, model, "node-a")
    made = await first.embed(TEXTS)
    assert counted(first) == TEXTS
    assert first.stats.shared == len(TEXTS)
    for text, vector in zip(TEXTS, made, strict=True):  # read back from the stream, not from the embedder
        found = await stored(js, model.model_id, text)
        assert found is not None
        assert close(found, vector)
    second = await a_node(js, model, "node-b")
    taken = await second.embed(TEXTS)
    assert all(close(a, b) for a, b in zip(made, taken, strict=True))
    assert counted(second) == TEXTS[:1]  # only the first vector of a new signer is checked against its own model
    assert (second.stats.taken, second.stats.checked, second.stats.refused) == (len(TEXTS), 1, 0)
    assert second.stats.shared == 0  # nothing new to share


async def test_a_vector_not_signed_by_a_registered_node_is_refused_and_embedded_here(
    js: JetStreamContext, model: FastEmbedder
) -> None:
    forger = AgentKey.generate("mallory")  # a valid signature, but an agent's key, not a node's
    planted = random_unit(model.dimension, 1)
    await put(js, forger, TEXTS[0], planted, model_id=model.model_id)
    node = await a_node(js, model, "node-a")
    (vector,) = await node.embed(TEXTS[:1])
    (own,) = await model.embed(TEXTS[:1])
    assert close(vector, own)
    assert not close(vector, planted)
    assert node.stats.refused == 1
    assert "not a registered node" in (node.stats.last_problem or "")
    assert counted(node) == TEXTS[:1]
    shared = await stored(js, model.model_id, TEXTS[0])  # the planted vector is replaced by a true one
    assert shared is not None
    assert close(shared, own)


async def test_a_tampered_vector_from_a_registered_node_fails_its_signature(
    js: JetStreamContext, model: FastEmbedder
) -> None:
    honest = await a_node(js, model, "node-a")
    (own,) = await model.embed(TEXTS[:1])
    other = AgentKey.generate("node")
    signature = other.sign_document(VECTOR_PURPOSE, b"something else")
    await put(js, honest._key, TEXTS[0], own, model_id=model.model_id, **{SIGNATURE_HEADER: signature})
    node = await a_node(js, model, "node-b")
    await node.embed(TEXTS[:1])
    assert node.stats.refused == 1
    assert "signature" in (node.stats.last_problem or "")
    assert node.stats.taken == 0
    assert counted(node) == TEXTS[:1]


async def test_a_vector_of_another_model_is_left_alone_not_refused(js: JetStreamContext, model: FastEmbedder) -> None:
    other_node = await a_node(js, model, "node-a")
    # What a node running another model would share for the same text: another key, another subject.
    await put(js, other_node._key, TEXTS[0], random_unit(8, 2), model_id="other/model")
    node = await a_node(js, model, "node-b")
    await node.embed(TEXTS[:1])
    assert (node.stats.taken, node.stats.refused) == (0, 0)
    assert counted(node) == TEXTS[:1]
    assert await stored(js, "other/model", TEXTS[0]) is not None  # theirs stays


async def test_a_node_whose_vectors_do_not_match_the_model_is_no_longer_trusted(
    js: JetStreamContext, model: FastEmbedder
) -> None:
    liar = await a_node(js, model, "node-liar")  # registered, signs correctly, shares vectors of nothing
    for seed, text in enumerate(TEXTS):
        await put(js, liar._key, text, random_unit(model.dimension, seed), model_id=model.model_id)
    node = await a_node(js, model, "node-b")
    vectors = await node.embed(TEXTS)
    own = await model.embed(TEXTS)
    assert all(close(a, b) for a, b in zip(vectors, own, strict=True))
    assert node.stats.taken == 0
    assert node.stats.refused >= 1
    assert "does not match" in (node.stats.last_problem or "")
    assert sorted(counted(node)) == sorted(TEXTS)  # every text of the liar was embedded here
    for text, vector in zip(TEXTS, own, strict=True):  # and the true vectors replaced the lies on the stream
        found = await stored(js, model.model_id, text)
        assert found is not None
        assert close(found, vector)


async def test_erase_removes_the_shared_vectors_and_reads_them_back(js: JetStreamContext, model: FastEmbedder) -> None:
    node = await a_node(js, model, "node-a")
    await node.embed(TEXTS)
    assert await node.erase(TEXTS[:2]) == 2
    assert await node.count_shared(TEXTS) == len(TEXTS) - 2
    assert [await stored(js, model.model_id, t) is None for t in TEXTS] == [True, True, False, False, False]
    assert await node.erase(TEXTS[:2]) == 0  # idempotent


class ErasedFirstByAnother:
    """A JetStream context on which another node erases each message just before this one does."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js

    def __getattr__(self, name: str) -> object:
        return getattr(self.js, name)

    async def delete_msg(self, stream_name: str, seq: int) -> bool:
        await self.js.delete_msg(stream_name, seq)
        return await self.js.delete_msg(stream_name, seq)


async def test_an_erase_another_node_finished_first_is_not_a_failure(js: JetStreamContext, model: FastEmbedder) -> None:
    node = await a_node(js, model, "node-a")
    await node.embed(TEXTS)
    other = ErasedFirstByAnother(js)
    racing = FleetEmbedder(
        model, lambda: cast(JetStreamContext, other), AgentKey.generate("node"), AgentRegistry(js).is_node_key
    )
    assert await racing.erase(TEXTS[:2]) == 2  # both found, both already gone when this node got there
    assert await node.count_shared(TEXTS) == len(TEXTS) - 2


async def test_a_stream_that_does_not_answer_costs_the_models_time_not_a_vector(
    nats_server: NatsServer, model: FastEmbedder, tmp_path: Path
) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await ensure_streams(js, replicas=1)
    node = await a_node(js, model, "node-a")
    await nc.close()  # every lookup and share now fails at once
    vectors = await node.embed(TEXTS[:2])
    assert all(close(a, b) for a, b in zip(vectors, await model.embed(TEXTS[:2]), strict=True))
    assert node.stats.read_failures >= 1
    assert node.stats.share_failures == 2
    assert node.stats.shared == 0
    await node.embed(TEXTS[2:3])  # paused after the failure: no lookup is tried, the model answers
    assert counted(node) == TEXTS[:3]
