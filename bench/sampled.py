"""The scale bench's embedding model: the real model embeds one text in SAMPLE_EVERY (chosen by the text's hash,
so the same text always gets the same kind of vector), and every other text gets a deterministic clustered unit
vector. Embedding a million texts with the model takes about half an hour on 2 cores; the model's own rate is
measured separately, and the bench's table says which vectors were the model's."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from observers.mirror.embed import DEFAULT_DIMENSION, FastEmbedder

SAMPLE_EVERY = int(os.environ.get("EPIBUS_BENCH_SAMPLE_EVERY", "100"))
CLUSTERS = 256
_CENTERS = np.random.default_rng(7).normal(size=(CLUSTERS, DEFAULT_DIMENSION))


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def model_embeds(text: str) -> bool:
    return _seed(text) % SAMPLE_EVERY == 0


def unit_vector(text: str) -> list[float]:
    seed = _seed(text)
    rng = np.random.default_rng(seed)
    raw = _CENTERS[seed % CLUSTERS] + 0.35 * rng.normal(size=DEFAULT_DIMENSION)
    return [float(x) for x in raw / np.linalg.norm(raw)]


class SampledEmbedder(FastEmbedder):
    """FastEmbedder whose model sees only the sampled texts; `model_texts` counts them."""

    def __init__(self, home: Path, model_name: str | None = None, *, batch_size: int = 64) -> None:
        super().__init__(home, model_name, batch_size=batch_size)
        self.model_texts = 0

    def _embed(self, texts: list[str]) -> list[list[float]]:
        sampled = [t for t in texts if model_embeds(t)]
        real = iter(super()._embed(sampled) if sampled else [])
        self.model_texts += len(sampled)
        return [next(real) if model_embeds(t) else unit_vector(t) for t in texts]
