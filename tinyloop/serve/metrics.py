"""The server's Prometheus metrics, in a CollectorRegistry of its own (one per app).

Two kinds: what the request handlers observe (latency histograms, admitted prompt tokens,
requests by finish reason) and what the engine counts, read from `EngineLoop.stats` at scrape
time (requests running and waiting, tokens computed, generated, drafted and accepted,
prefix-cache queries and hits, KV blocks, decode passes by the loops they ran).
docs/serving.md lists every name.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                   HistogramMetricFamily, Metric)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0)
FINISH_REASONS = ("stop", "length", "cancelled", "error")

# (name, help, engine stats key): engine gauges, then engine counters ("cache." = the model's
# prefix-cache counters, Model.cache_stats()).
ENGINE_GAUGES = (
    ("tinyloop_requests_running", "Requests the scheduler is running (prefilling or decoding)",
     "running"),
    ("tinyloop_requests_waiting", "Requests waiting to be scheduled", "waiting"),
    ("tinyloop_kv_blocks", "KV blocks the running requests hold", "kv_blocks"),
    ("tinyloop_kv_bytes", "KV bytes the running requests hold privately", "kv_bytes"),
    ("tinyloop_prefix_cache_disk_bytes", "Bytes of the prefix cache's block files on disk",
     "cache.disk_bytes"),
    ("tinyloop_prefix_cache_disk_budget_bytes", "Budget of those files (0: no limit)",
     "cache.disk_budget_bytes"),
)
ENGINE_COUNTERS = (
    ("tinyloop_prefill_tokens", "Prompt positions computed by prefill (recomputation after a "
     "preemption included)", "prompt_tokens"),
    ("tinyloop_cached_prompt_tokens", "Prompt positions taken from the prefix cache",
     "cached_tokens"),
    ("tinyloop_generation_tokens", "Tokens generated", "generated_tokens"),
    ("tinyloop_preemptions", "Requests preempted to stay within the KV budget", "preemptions"),
    ("tinyloop_scheduler_steps", "Scheduler steps run", "steps"),
    ("tinyloop_draft_tokens", "Tokens drafted by self-speculative decoding (draft_loops, n_draft)",
     "drafted_tokens"),
    ("tinyloop_draft_accepted_tokens", "Drafted tokens the full-depth verifier emitted too",
     "accepted_tokens"),
    ("tinyloop_decode_passes", "Decode passes run (one per generated token but a request's first)",
     "decode_passes"),
    ("tinyloop_decode_loops", "Core iterations the decode passes ran: over tinyloop_decode_passes, "
     "the mean loops per token that adaptive depth (exit_rule) leaves", "decode_loops"),
    ("tinyloop_mixed_passes", "Scheduler steps whose decodes and prompt chunks ran as one pass "
     "(each weight read once)", "mixed_passes"),
    ("tinyloop_prefix_cache_queries", "Prefix-cache lookups", "cache.lookups"),
    ("tinyloop_prefix_cache_hit_tokens", "Prompt tokens served by the prefix cache",
     "cache.hit_tokens"),
    ("tinyloop_prefix_cache_spilled_blocks", "Prefix-cache blocks written to the disk tier",
     "cache.spilled_blocks"),
    ("tinyloop_prefix_cache_disk_hit_blocks", "Prefix-cache blocks read back from the disk tier",
     "cache.disk_hit_blocks"),
    ("tinyloop_prefix_cache_disk_write_failures", "Spills whose block file could not be written "
     "(a full disk, an I/O error): the cache goes on in memory", "cache.disk_write_failures"),
)


class _EngineCollector:
    """Reads the engine's stats snapshot when Prometheus scrapes (nothing before it runs)."""

    def __init__(self, stats: Callable[[], Optional[dict[str, Any]]]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return

        def value(key: str) -> float:
            group, _, name = key.rpartition(".")
            return float((stats[group] if group else stats)[name])

        for name, text, key in ENGINE_GAUGES:
            yield GaugeMetricFamily(name, text, value=value(key))
        for name, text, key in ENGINE_COUNTERS:
            yield CounterMetricFamily(name, text, value=value(key))
        yield _depth_histogram(stats["depths"], stats["decode_loops"])


def _depth_histogram(counts: list[int], loops: int) -> Metric:
    """The decode passes by the core iterations they ran (adaptive depth's exits,
    Scheduler.depth_counts): a bucket per depth up to the deepest seen, summing to the loops."""
    running, buckets = 0, []
    for depth, count in enumerate(counts, 1):
        running += count
        buckets.append((str(float(depth)), running))
    return HistogramMetricFamily(
        "tinyloop_decode_loops_per_token", "Decode passes by the core iterations they ran "
        "(every token but a request's first; fewer than the request's loops where exit_rule "
        "stopped it early)", buckets=buckets + [("+Inf", running)], sum_value=loops)


class ServerMetrics:
    """The metrics of one app; `stats()` returns the engine's stats snapshot, or None while
    the model loads."""

    def __init__(self, stats: Callable[[], Optional[dict[str, Any]]]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        self.time_to_first_token = Histogram(
            "tinyloop_time_to_first_token_seconds", "From a request's arrival to its first token",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            "tinyloop_inter_token_latency_seconds", "Between two tokens of a request",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("tinyloop_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=self.registry)
        self.requests = Counter("tinyloop_requests", "Requests ended, by finish reason "
                                "(cancelled: the client went away; error: the engine failed)",
                                ["finish_reason"], registry=self.registry)
        for reason in FINISH_REASONS:            # every series exists from the start
            self.requests.labels(reason)
        self.rejected = Counter("tinyloop_requests_rejected", "Requests answered 429: the engine "
                                "held max_batch + max_queue requests already",
                                registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
