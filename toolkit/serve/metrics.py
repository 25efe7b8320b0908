"""Prometheus metrics of one server, in a registry of its own (two servers in one process, as in tests, never
share counters). The scheduler thread and the HTTP handlers both write here; prometheus_client is thread-safe."""

import collections
import threading
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# Latency buckets from 5 ms to 30 s: ITL on a loaded CPU sits in tens to hundreds of ms, TTFT up to seconds.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self, window_s: float = 10.0):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specquant_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("specquant_sequences_finished", "sequences finished, by reason "
                                "(stop, length, cancelled, error)", ["reason"], registry=r)
        self.generated = Counter("specquant_generated_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter("specquant_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.ttft = Histogram("specquant_ttft_seconds", "time from arrival to the first token", buckets=_BUCKETS,
                              registry=r)
        self.itl = Histogram("specquant_itl_seconds", "time between consecutive tokens of a sequence",
                             buckets=_BUCKETS, registry=r)
        self.tokens_per_s = Gauge("specquant_tokens_per_second", f"tokens generated per second over the last "
                                  f"{window_s:g} s", registry=r)
        self.kv_bytes = Gauge("specquant_kv_bytes_in_use", "bytes of the KV blocks live sequences reference",
                              registry=r)
        self.kv_allocated = Gauge("specquant_kv_bytes_allocated", "bytes of the KV block pool (allocated at start)",
                                  registry=r)
        self.kv_tokens = Gauge("specquant_kv_tokens", "tokens whose keys/values live sequences hold", registry=r)
        self.kv_blocks_total = Gauge("specquant_kv_blocks_total", "blocks in the KV pool", registry=r)
        self.kv_blocks_used = Gauge("specquant_kv_blocks_used", "KV blocks referenced by live sequences", registry=r)
        self.kv_blocks_free = Gauge("specquant_kv_blocks_free", "KV blocks an allocation can get: free, or cached "
                                    "prefixes it may evict", registry=r)
        self.kv_blocks_cached = Gauge("specquant_kv_blocks_cached", "unreferenced KV blocks kept for their prefix "
                                      "(part of the free ones)", registry=r)
        self.prefix_queries = Counter("specquant_prefix_cache_queries", "full prompt blocks looked up in the prefix "
                                      "cache", registry=r)
        self.prefix_hits = Counter("specquant_prefix_cache_hits", "prompt blocks found in the prefix cache (not "
                                   "prefilled)", registry=r)
        self.prefix_hit_rate = Gauge("specquant_prefix_cache_hit_rate", "prefix cache hits / queries since start",
                                     registry=r)
        self.evictions = Counter("specquant_kv_evictions", "cached prefix blocks evicted to make room", registry=r)
        self.cow_copies = Counter("specquant_kv_cow_copies", "shared KV blocks copied before a write", registry=r)
        self.preemptions = Counter("specquant_preemptions", "sequences preempted (blocks freed, recomputed later) "
                                   "because the KV pool ran out", registry=r)
        self.queue = Gauge("specquant_queue_length", "requests waiting to be admitted (preempted ones included)",
                           registry=r)
        self.batch = Gauge("specquant_batch_size", "sequences in the running batch", registry=r)
        self.acceptance = Gauge("specquant_spec_acceptance_rate", "share of drafted tokens the target kept, "
                                "over every request since start (NaN: nothing drafted yet, or spec=none)", registry=r)
        self.acceptance.set(float("nan"))
        self._window_s = window_s
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        self._pool_totals: dict = {}

    def count_tokens(self, n: int) -> None:
        now = time.perf_counter()
        self.generated.inc(n)
        with self._lock:
            self._recent.append((now, n))
            while self._recent and self._recent[0][0] < now - self._window_s:
                self._recent.popleft()
            self.tokens_per_s.set(sum(c for _, c in self._recent) / self._window_s)

    def publish_pool(self, pool) -> None:
        """Mirror a BlockPool's counts (the scheduler thread calls this after every turn)."""
        self.kv_blocks_used.set(pool.used)
        self.kv_blocks_free.set(pool.available)
        self.kv_blocks_cached.set(len(pool.cached))
        stats = pool.stats
        self.prefix_hit_rate.set(stats.hit_rate)
        # the pool keeps running totals; counters only go up by increments
        for counter, total in ((self.prefix_queries, stats.prefix_queries), (self.prefix_hits, stats.prefix_hits),
                               (self.evictions, stats.evictions), (self.cow_copies, stats.cow_copies)):
            counter.inc(total - self._pool_totals.get(counter, 0))
            self._pool_totals[counter] = total

    def render(self) -> bytes:
        # refresh the throughput gauge so an idle server reads 0 rather than its last busy value
        self.count_tokens(0)
        return generate_latest(self.registry)
