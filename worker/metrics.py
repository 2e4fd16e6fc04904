"""The worker's Prometheus metrics (its ``--metrics-port``), fed from its heartbeat (the same numbers /ready and
the API read).

The engine's state and token counters carry vLLM's names and labels (``model_name``, ``engine``: here the worker
id), as vLLM's engine reports them (``vllm/v1/metrics/loggers.py``); the swap space's, which v1 dropped, carry
v0's names where v0 had one (``vllm:num_requests_swapped``, ``vllm:cpu_cache_usage_perc``; ``vllm:num_preemptions``
counts both kinds) and ``pagedserve:`` ones where it had none. The per-request latencies under ``vllm:``
are the API's (``api/metrics.py``: what the client sees); the worker's own, measured from the enqueue, stay
under ``pagedserve:worker_*`` so that a Prometheus scraping both tiers counts no request twice.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from api.metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from wire.messages import WorkerHeartbeat

# vLLM's counter name -> the heartbeat's running total it follows
_TOTALS = {
    "vllm:prefix_cache_queries": (
        "prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "vllm:prefix_cache_hits": ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    "vllm:num_preemptions": ("num_preemptions", "Cumulative number of preemptions from the engine."),
    "vllm:prompt_tokens": ("prompt_tokens_total", "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("generation_tokens_total", "Number of generation tokens processed."),
    "pagedserve:kv_blocks_swapped_out": (
        "num_blocks_swapped_out",
        "KV-cache blocks copied from GPU to CPU memory by swap preemptions.",
    ),
    "pagedserve:kv_blocks_swapped_in": (
        "num_blocks_swapped_in",
        "KV-cache blocks copied from CPU memory back to the GPU (swapped requests resuming, host prefix hits).",
    ),
}
# pagedserve:num_preemptions_by_kind's ``kind`` -> the heartbeat's running total it follows. Not named
# pagedserve:num_preemptions: that is the API's sum over the workers (api/metrics.py).
_PREEMPTION_KINDS = {"swap": "num_swap_preemptions", "recompute": "num_recompute_preemptions"}


class WorkerMetrics:
    """The worker's metrics, in ``registry`` (the process's default one, which ``start_http_server`` serves)."""

    def __init__(self, model_name: str = "", engine: str = "0", registry: CollectorRegistry = REGISTRY) -> None:
        labels, values = ("model_name", "engine"), (model_name, engine)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry, multiprocess_mode="mostrecent").labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.swapped = gauge("vllm:num_requests_swapped", "Number of requests whose KV cache is swapped out to CPU.")
        self.cpu_kv_usage = gauge(
            "vllm:cpu_cache_usage_perc", "KV-cache usage of the CPU swap space. 1 means 100 percent usage."
        )
        self.jobs_active = Gauge(
            "pagedserve:worker_jobs_active", "Jobs this worker is running.", registry=registry, multiprocess_mode="max"
        )
        self.totals = {
            field: Counter(name, doc, labels, registry=registry).labels(*values)
            for name, (field, doc) in _TOTALS.items()
        }
        by_kind = Counter(
            "pagedserve:num_preemptions_by_kind",
            "Preemptions by kind: swap (KV cache moved to CPU memory) or recompute (freed, prefilled again).",
            [*labels, "kind"],
            registry=registry,
        )
        self.totals.update({field: by_kind.labels(*values, kind) for kind, field in _PREEMPTION_KINDS.items()})
        self._last = {field: 0 for field in self.totals}
        self.ttft = Histogram(
            "pagedserve:worker_time_to_first_token_seconds",
            "Enqueue to first token, at the worker.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "pagedserve:worker_e2e_request_latency_seconds",
            "Enqueue to finish, at the worker.",
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_time = Histogram(
            "pagedserve:worker_queue_time_seconds",
            "Time a job waited in the Redis queue.",
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=registry,
        )
        self.jobs = Counter("pagedserve:worker_jobs", "Jobs by outcome.", ["outcome"], registry=registry)

    def update(self, beat: WorkerHeartbeat) -> None:
        self.running.set(beat.num_running)
        self.waiting.set(beat.num_waiting)
        self.kv_usage.set(beat.kv_cache_usage)
        self.swapped.set(beat.num_swapped)
        self.cpu_kv_usage.set(beat.cpu_kv_cache_usage)
        self.jobs_active.set(beat.active_jobs)
        for field, counter in self.totals.items():
            total = int(getattr(beat, field))
            counter.inc(max(0, total - self._last[field]))
            self._last[field] = total
