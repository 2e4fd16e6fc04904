"""The worker's Prometheus metrics, fed from its heartbeat (the same numbers /ready and the API read)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from wire.messages import WorkerHeartbeat


class WorkerMetrics:
    """The worker's Prometheus metrics (vLLM's names, ``pagedserve:`` prefix)."""

    def __init__(self) -> None:
        self.running = Gauge("pagedserve:num_requests_running", "Requests in the running batch.")
        self.waiting = Gauge("pagedserve:num_requests_waiting", "Requests waiting in the engine.")
        self.kv_usage = Gauge("pagedserve:kv_cache_usage_perc", "KV-cache usage, 0..1.")
        self.jobs_active = Gauge("pagedserve:worker_jobs_active", "Jobs this worker is running.")
        self.totals = {
            name: Counter(f"pagedserve:{name}", doc)
            for name, doc in (
                ("prefix_cache_queries", "Prefix-cache queries (tokens)."),
                ("prefix_cache_hits", "Prefix-cache hits (tokens)."),
                ("num_preemptions", "Preemptions."),
                ("prompt_tokens", "Prefill tokens processed."),
                ("generation_tokens", "Generation tokens processed."),
            )
        }
        self._last = {name: 0 for name in self.totals}
        self.ttft = Histogram("pagedserve:time_to_first_token_seconds", "Enqueue to first token.")
        self.e2e = Histogram("pagedserve:e2e_request_latency_seconds", "Enqueue to finish.")
        self.queue_time = Histogram("pagedserve:request_queue_time_seconds", "Time waiting in the Redis queue.")
        self.jobs = Counter("pagedserve:worker_jobs", "Jobs by outcome.", ["outcome"])

    def update(self, beat: WorkerHeartbeat) -> None:
        self.running.set(beat.num_running)
        self.waiting.set(beat.num_waiting)
        self.kv_usage.set(beat.kv_cache_usage)
        self.jobs_active.set(beat.active_jobs)
        for name, counter in self.totals.items():
            total = int(getattr(beat, name if name.startswith(("prefix", "num")) else f"{name}_total"))
            counter.inc(max(0, total - self._last[name]))
            self._last[name] = total
