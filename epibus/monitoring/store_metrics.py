"""The metric families of a node's stores and what feeds them: the embedder (model, cache, fleet-shared
vectors), the disk and the mirror's shards, standing watches, recall. `epibus.monitoring.metrics` gathers them
with the rest at each scrape."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from epibus.monitoring.health import sealing
from observers.mirror.embed import FastEmbedder
from observers.mirror.fleet_vectors import FleetEmbedder

if TYPE_CHECKING:
    from epibus.node.view import NodeView


def watch_families(node: NodeView) -> list[Metric]:
    """Standing questions: how many this node holds, what its registrations and matching did and cost."""
    held = GaugeMetricFamily("epibus_watches", "Watches this node matches claims against (expired ones included).")
    registered = CounterMetricFamily(
        "epibus_watch_registrations",
        "Registrations this node answered: registered, stopped, over_limit (refused: the agent held its limit).",
        labels=["outcome"],
    )
    notices = CounterMetricFamily(
        "epibus_watch_notices",
        "Notices by what became of them: pushed (stored), duplicate (another node pushed it first), follow_up "
        "(no longer trusted), erased (a forgotten claim's), withheld (the project's review policy holds the claim).",
        labels=["outcome"],
    )
    matched = CounterMetricFamily("epibus_watch_claims_matched", "Claims matched against the watches, and matches.",
                                  labels=["what"])  # fmt: skip
    seconds = CounterMetricFamily("epibus_watch_match_seconds", "Seconds spent matching claims against the watches.")
    found: list[Metric] = [held, registered, notices, matched, seconds]
    if node.watches is None:
        return found
    registry, pusher = node.watches
    held.add_metric([], len(registry.book))
    counts, stats = registry.counts, pusher.stats
    for outcome, n in (
        ("registered", counts.registered),
        ("stopped", counts.stopped),
        ("over_limit", counts.over_limit),
    ):
        registered.add_metric([outcome], n)
    for outcome, n in (("pushed", stats.pushed), ("duplicate", stats.duplicates), ("follow_up", stats.follow_ups),
                       ("erased", stats.erased), ("withheld", stats.withheld)):  # fmt: skip
        notices.add_metric([outcome], n)
    matched.add_metric(["claims"], stats.claims)
    matched.add_metric(["matches"], stats.matched)
    seconds.add_metric([], stats.match_s)
    return found


def recall_families(node: NodeView) -> list[Metric]:
    """Recalls this node answered and where their time went (embedding the query, searching, in all)."""
    answered = CounterMetricFamily("epibus_recalls", "Recalls this node's mirror answered (safe and audit doors).")
    seconds = CounterMetricFamily(
        "epibus_recall_seconds",
        "Seconds recalls spent: embed (the query), search (the store), total.",
        labels=["phase"],
    )
    services = node.mirror_services
    if services is not None:
        answered.add_metric([], services.recalls)
        for phase in ("embed", "search", "total"):
            seconds.add_metric([phase], services.recall_seconds.get(phase, 0.0))
    return [answered, seconds]


def embed_families(node: NodeView) -> list[Metric]:
    texts = CounterMetricFamily("epibus_embed_texts", "Texts the embedding model embedded (cache misses).")
    spent = CounterMetricFamily("epibus_embed_seconds", "Seconds the embedding model spent embedding.")
    hits = CounterMetricFamily("epibus_embed_cache_hits", "Texts the embedding cache answered.")
    evicted = CounterMetricFamily(
        "epibus_embed_cache_evicted", "Vectors the embedding cache dropped, oldest first, to stay within its bound."
    )
    shared = CounterMetricFamily(
        "epibus_shared_vectors",
        "The fleet's shared vectors, by what this node did: shared (put on the stream), taken (instead of "
        "embedding), refused (forged, malformed or failing a check), checked (embedded again to compare), "
        "share_failed, read_failed.",
        labels=["outcome"],
    )
    found: list[Metric] = [texts, spent, hits, evicted, shared]
    cached = node.embedder
    if cached is None:
        return found
    hits.add_metric([], cached.hits)
    evicted.add_metric([], cached.evicted)
    fleet = cached.inner if isinstance(cached.inner, FleetEmbedder) else None
    model = fleet.model if fleet is not None else cached.inner
    if isinstance(model, FastEmbedder):
        texts.add_metric([], model.texts_embedded)
        spent.add_metric([], model.seconds_embedding)
    if fleet is not None:
        stats = fleet.stats
        for outcome, count in (
            ("shared", stats.shared), ("taken", stats.taken), ("refused", stats.refused), ("checked", stats.checked),
            ("share_failed", stats.share_failures), ("read_failed", stats.read_failures),
        ):  # fmt: skip
            shared.add_metric([outcome], count)
    return found


def storage_families(node: NodeView) -> list[Metric]:
    """Free disk space per filesystem the node writes to, and each store's last check."""
    free = GaugeMetricFamily("epibus_disk_free_bytes", "Free space where the node writes, by role.", labels=["role"])
    reserve = GaugeMetricFamily("epibus_disk_reserve_bytes", "Free space the node never writes into.")
    full = GaugeMetricFamily("epibus_disk_full", "1 while free space is below the reserve.", labels=["role"])
    damaged = GaugeMetricFamily(
        "epibus_store_damaged", "1 when the last check found the store damaged.", labels=["store"]
    )
    upkeep = node.upkeep
    if upkeep is None:
        return [free, reserve, full, damaged]
    for role, space in upkeep.disk.items():
        free.add_metric([role], space.free_bytes)
        full.add_metric([role], float(space.full))
    if upkeep.disk:
        reserve.add_metric([], next(iter(upkeep.disk.values())).reserve_bytes)
    for name, check in upkeep.checks.items():
        damaged.add_metric([name], float(check.damaged))
    return [free, reserve, full, damaged, *_shard_families(node)]


def _shard_families(node: NodeView) -> list[Metric]:
    """The edge mirror's shards by state, and the seals its worker processes made and failed."""
    shards = GaugeMetricFamily("epibus_mirror_shards", "The edge mirror's shards by state.", labels=["state"])
    seals = CounterMetricFamily("epibus_mirror_seals", "Full hot shards sealed by a worker process.")
    failed = CounterMetricFamily("epibus_mirror_seal_failures", "Seals whose worker failed (tried again later).")
    restarts = CounterMetricFamily(
        "epibus_mirror_engine_restarts", "Times the mirror's engine process ended and was started again."
    )
    held = CounterMetricFamily(
        "epibus_mirror_writes_held_seconds", "Seconds the mirror's writes waited for its seals to catch up."
    )
    found = sealing(node)
    if found is None:
        return []
    states, made = found
    for state, n in states.items():
        shards.add_metric([state], n)
    seals.add_metric([], made.sealed)
    failed.add_metric([], made.failures)
    restarts.add_metric([], getattr(node.store, "restarts", 0))
    held.add_metric([], made.writes_held_s)
    return [shards, seals, failed, restarts, held]
