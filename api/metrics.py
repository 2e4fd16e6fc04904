"""Prometheus metrics of the API tier (vLLM's names with the ``pagedserve:`` prefix where the meaning is the
same) plus the workers' engine gauges and counters summed from their heartbeats."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from wire.messages import WorkerHeartbeat

# buckets as vLLM's (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class _WorkerCollector(Collector):
    """Engine numbers of all live workers, read from the heartbeats the JobQueue last fetched."""

    def __init__(self, beats: Callable[[], list[WorkerHeartbeat]], queue_depth: Callable[[], int]) -> None:
        self._beats = beats
        self._queue_depth = queue_depth

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        beats = self._beats()
        gauges = {
            "num_requests_running": ("Requests in the engines' running batches.", sum(b.num_running for b in beats)),
            "num_requests_waiting": (
                "Requests waiting: in the engines' queues plus jobs in the Redis queue.",
                sum(b.num_waiting for b in beats) + self._queue_depth(),
            ),
            "kv_cache_usage_perc": (
                "KV-cache usage, 0..1 (highest of the workers).",
                max((b.kv_cache_usage for b in beats), default=0.0),
            ),
            "num_workers": ("Workers with a live heartbeat.", len(beats)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"pagedserve:{name}", doc, value=value)
        counters = {
            "prefix_cache_queries": ("Prefix-cache queries (tokens).", sum(b.prefix_cache_queries for b in beats)),
            "prefix_cache_hits": ("Prefix-cache hits (tokens).", sum(b.prefix_cache_hits for b in beats)),
            "num_preemptions": ("Preemptions.", sum(b.num_preemptions for b in beats)),
            "prompt_tokens": ("Prefill tokens processed.", sum(b.prompt_tokens_total for b in beats)),
            "generation_tokens": ("Generation tokens processed.", sum(b.generation_tokens_total for b in beats)),
        }
        for name, (doc, total) in counters.items():
            yield CounterMetricFamily(f"pagedserve:{name}", doc, value=total)


class ApiMetrics:
    """One registry per app (tests build several apps in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "pagedserve:time_to_first_token_seconds",
            "Time to first token, as the API sees it.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pagedserve:inter_token_latency_seconds", "Time between streamed deltas.", buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "pagedserve:e2e_request_latency_seconds",
            "Request latency, arrival to last byte.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "pagedserve:request_queue_time_seconds", "Time a job waited in the queue.", buckets=E2E_BUCKETS, registry=r
        )
        self.requests = Counter(
            "pagedserve:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.cache_hits = Counter(
            "pagedserve:response_cache_hits", "Requests served from the response cache.", registry=r
        )
        self.cache_misses = Counter(
            "pagedserve:response_cache_misses", "Cacheable requests not in the cache.", registry=r
        )
        self.rejected = Counter(
            "pagedserve:requests_rejected", "Requests answered 429, by reason.", ["reason"], registry=r
        )
        self.errors = Counter(
            "pagedserve:request_errors", "Requests that ended with an error, by HTTP status.", ["status"], registry=r
        )

    def watch_workers(self, beats: Callable[[], list[WorkerHeartbeat]], queue_depth: Callable[[], int]) -> None:
        self.registry.register(_WorkerCollector(beats, queue_depth))
