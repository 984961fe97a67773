"""Prometheus metrics (`GET /metrics`, names prefixed `rlserve_`), one registry per app.

Request counts and latencies are recorded by the middleware; the model-side figures (queues,
batches, tokens, policy version) are read from the model registry at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.engine.registry import ModelRegistry

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, replica: str | None = None) -> None:
        """`replica`: this server's name among replicas, the `replica` label of
        `target_info` (Prometheus' place for labels every series of a target shares)."""
        target = {"replica": replica} if replica is not None else None
        self.registry = CollectorRegistry(auto_describe=True, target_info=target)
        self.requests = Counter(
            "rlserve_requests",
            "HTTP requests by route template, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "rlserve_request_duration_seconds",
            "HTTP request latency by route template and method.",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.env_sessions = Gauge(
            "rlserve_env_sessions", "Live environment sessions.", registry=self.registry
        )

    def watch(self, models: ModelRegistry) -> None:
        self.registry.register(ModelCollector(models))


class ModelCollector(Collector):
    """Queue depth, batches, tokens and versions of the served models, read when scraped."""

    def __init__(self, models: ModelRegistry) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        version = GaugeMetricFamily(
            "rlserve_policy_version", "Weight version of each model.", labels=["model"]
        )
        queued = GaugeMetricFamily(
            "rlserve_queue_items", "Items waiting in a batcher.", labels=["model", "kind"]
        )
        batches = CounterMetricFamily(
            "rlserve_batches", "Model calls made by the batchers.", labels=["model", "kind"]
        )
        items = CounterMetricFamily(
            "rlserve_batch_items",
            "Items in those calls (over rlserve_batches_total: the mean batch size).",
            labels=["model", "kind"],
        )
        last = GaugeMetricFamily(
            "rlserve_last_batch_size", "Size of the latest model call.", labels=["model", "kind"]
        )
        generated = CounterMetricFamily(
            "rlserve_tokens_generated", "Tokens generated.", labels=["model"]
        )
        scored = CounterMetricFamily("rlserve_tokens_scored", "Tokens scored.", labels=["model"])
        gate = self.models.gate.state()
        paused = GaugeMetricFamily(
            "rlserve_serving_paused",
            "1 while serving is paused, by pause mode (wait, abort, keep).",
            labels=["mode"],
        )
        for mode in ("wait", "abort", "keep"):
            paused.add_metric([mode], 1.0 if gate.mode == mode else 0.0)
        yield paused
        yield GaugeMetricFamily(
            "rlserve_requests_held", "Requests waiting for a pause to end.", value=gate.waiting
        )
        lineage = GaugeMetricFamily(
            "rlserve_weight_lineage",
            "Each model's lineage: one more each time a trainer counts its versions again from "
            "below the served one (restarted from a checkpoint).",
            labels=["model"],
        )
        since = GaugeMetricFamily(
            "rlserve_weight_lineage_since_version",
            "The first version served in each model's current lineage.",
            labels=["model"],
        )
        digests = GaugeMetricFamily(
            "rlserve_weights_digest_info",
            "1 for each model's served weights, labelled with their version and digest (of "
            "their tensors' checksums; a model whose engine shows no weights is absent).",
            labels=["model", "version", "digest"],
        )
        for name in self.models.weighted():  # (the reward model's too)
            version.add_metric([name], self.models.versions.get(name, 0))
            if (digest := self.models.digests.of(name)) is not None:
                digests.add_metric([name, str(self.models.versions.get(name, 0)), digest], 1)
            current = self.models.gate.lineage(name)
            lineage.add_metric([name], current.number)
            since.add_metric([name], current.since)
        for name, served in self.models.models.items():
            generated.add_metric([name], served.num_tokens_generated)
            scored.add_metric([name], served.num_tokens_scored)
            for kind, batcher in (("score", served.scoring), ("generate", served.generation)):
                if batcher is None:
                    continue
                stats = batcher.stats()
                queued.add_metric([name, kind], stats.queued_items)
                batches.add_metric([name, kind], stats.num_calls)
                items.add_metric([name, kind], stats.num_items)
                last.add_metric([name, kind], (stats.last_batch_sizes or [0])[-1])
        yield from (version, digests, lineage, since, queued, batches, items, last)
        yield from (generated, scored)
        yield from self._prefix_caches()

    def _prefix_caches(self) -> Iterator[Metric]:
        """vLLM's prefix-cache counters (prompt tokens looked up, and of those found), and
        the cache's memory, for engines whose prefix cache rlserve keeps."""
        queries = CounterMetricFamily(
            "rlserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            labels=["model"],
        )
        hits = CounterMetricFamily(
            "rlserve_prefix_cache_hits",
            "Prompt tokens found in the prefix cache, not prefilled (over "
            "rlserve_prefix_cache_queries_total: the hit rate).",
            labels=["model"],
        )
        held = GaugeMetricFamily(
            "rlserve_prefix_cache_bytes", "Memory the prefix cache holds.", labels=["model"]
        )
        entries = GaugeMetricFamily(
            "rlserve_prefix_cache_entries", "Sequences in the prefix cache.", labels=["model"]
        )
        for name, served in self.models.models.items():
            if (stats := served.backend.prefix_cache()) is None:
                continue
            queries.add_metric([name], stats.queried_tokens)
            hits.add_metric([name], stats.hit_tokens)
            held.add_metric([name], stats.bytes)
            entries.add_metric([name], stats.entries)
        yield from (queries, hits, held, entries)
