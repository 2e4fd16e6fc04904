"""Prometheus metrics of the API tier, under vLLM's names so that vLLM's Grafana dashboards work unchanged.

Names, labels (``model_name``) and bucket boundaries follow vLLM's ``vllm/v1/metrics/loggers.py``. Each ``vllm:``
name has one tier as its source, so a Prometheus that scrapes both (``deploy/prometheus.yml``) counts nothing
twice: the per-request numbers a client sees (latencies, request lengths, finish reasons) are the API's, as in
vLLM's frontend; the engine's state and token counters (running, waiting, KV usage, prompt/generation tokens,
prefix cache, preemptions) are the workers' (``worker/metrics.py``). The API's own view of those, summed from the
workers' heartbeats, stays under ``pagedserve:``, as does anything vLLM has no name for.

With several API processes (``pagedserve api --api-workers N``) ``multiprocess_dir`` gives them a shared
PROMETHEUS_MULTIPROC_DIR: each writes its values there and any one of them serves the sum on /metrics.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from wire.messages import JobResult, WorkerHeartbeat

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# vLLM's bucket boundaries (seconds)
TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
TTFT_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
ITL_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0)
REQUEST_LATENCY_BUCKETS += (50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # up to ~2 hours
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def token_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 buckets up to ``max_value``: 1, 2, 5, 10, 20, 50, ... (token counts)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@contextlib.contextmanager
def multiprocess_dir(num_processes: int) -> Iterator[str | None]:
    """Sets PROMETHEUS_MULTIPROC_DIR for ``num_processes`` > 1 API processes started inside the block (they read
    it when they import prometheus_client): a fresh temporary folder, removed afterwards. A folder the operator
    set already is used as it is, emptied of a previous run's files first (they would add to the new counts)."""
    if num_processes <= 1:
        yield os.environ.get(MULTIPROC_ENV)
        return
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        for stale in Path(given).glob("*.db"):
            stale.unlink()
        yield given
        return
    folder = tempfile.mkdtemp(prefix="pagedserve-metrics-")
    os.environ[MULTIPROC_ENV] = folder
    try:
        yield folder
    finally:
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


class _WorkerCollector(Collector):
    """The API's view of all live workers, summed from the heartbeats the JobQueue last fetched (read live at
    each scrape, so every API process serves the same values)."""

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
            "num_requests_swapped": (
                "Requests with their KV cache swapped out to CPU memory.",
                sum(b.num_swapped for b in beats),
            ),
            "cpu_cache_usage_perc": (
                "CPU swap-space KV-cache usage, 0..1 (highest of the workers).",
                max((b.cpu_kv_cache_usage for b in beats), default=0.0),
            ),
            "num_workers": ("Workers with a live heartbeat.", len(beats)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"pagedserve:{name}", doc, value=value)
        counters = {  # totals of the live workers: a worker that leaves takes its share with it
            "prefix_cache_queries": ("Prefix-cache queries (tokens).", sum(b.prefix_cache_queries for b in beats)),
            "prefix_cache_hits": ("Prefix-cache hits (tokens).", sum(b.prefix_cache_hits for b in beats)),
            "num_preemptions": ("Preemptions.", sum(b.num_preemptions for b in beats)),
            "prompt_tokens": ("Prefill tokens processed.", sum(b.prompt_tokens_total for b in beats)),
            "generation_tokens": ("Generation tokens processed.", sum(b.generation_tokens_total for b in beats)),
        }
        for name, (doc, total) in counters.items():
            yield CounterMetricFamily(f"pagedserve:{name}", doc, value=total)


class ApiMetrics:
    """The API's metrics. One registry per app (tests build several apps in one process); in multiprocess mode
    the values live in PROMETHEUS_MULTIPROC_DIR and ``exposition`` reads them all from there."""

    def __init__(self, model_name: str = "", max_model_len: int = 2048) -> None:
        self.registry = r = CollectorRegistry()
        self._workers: Collector | None = None

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(model_name)

        lengths = token_buckets(max_model_len)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token, as the API sees it.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between streamed deltas.", ITL_BUCKETS)
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds", "Per request: decode time / (tokens - 1).", ITL_BUCKETS
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "Request latency, arrival to last byte.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = hist(
            "vllm:request_queue_time_seconds", "Time a job waited in the queue.", REQUEST_LATENCY_BUCKETS
        )
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds", "Job start to first token.", REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = hist("vllm:request_decode_time_seconds", "First token to last.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = hist(
            "vllm:request_inference_time_seconds", "Job start to last token.", REQUEST_LATENCY_BUCKETS
        )
        self.prompt_len = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", lengths)
        self.generation_len = hist("vllm:request_generation_tokens", "Generated tokens per request.", lengths)
        self.max_generation_len = hist(
            "vllm:request_max_num_generation_tokens", "Generated tokens of a request's longest choice.", lengths
        )
        self.params_n = hist("vllm:request_params_n", "The n request parameter.", PARAMS_N_BUCKETS)
        self._success = Counter(
            "vllm:request_success", "Finished requests by finish reason.", ["model_name", "finished_reason"], registry=r
        )
        self._model_name = model_name
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

    def observe_final(self, result: JobResult, e2e_s: float, streamed: bool) -> None:
        """A finished job: its latencies (a stream's TTFT was observed at its first delta), lengths, reasons."""
        self.e2e.observe(e2e_s)
        self.queue_time.observe(max(0.0, result.queue_time_s))
        if result.ttft_s is not None:
            if not streamed:
                self.ttft.observe(result.ttft_s)
            self.prefill_time.observe(max(0.0, result.ttft_s - result.queue_time_s))
            self.decode_time.observe(max(0.0, result.e2e_s - result.ttft_s))
            longest = max((len(c.token_ids) for c in result.choices), default=0)
            if longest > 1:
                self.tpot.observe(max(0.0, result.e2e_s - result.ttft_s) / (longest - 1))
        self.inference_time.observe(max(0.0, result.e2e_s - result.queue_time_s))
        self.prompt_len.observe(result.prompt_tokens)
        self.generation_len.observe(result.completion_tokens)
        self.max_generation_len.observe(max((len(c.token_ids) for c in result.choices), default=0))
        self.params_n.observe(len(result.choices))
        for c in result.choices:
            self._success.labels(self._model_name, c.finish_reason).inc()

    def watch_workers(self, beats: Callable[[], list[WorkerHeartbeat]], queue_depth: Callable[[], int]) -> None:
        self._workers = _WorkerCollector(beats, queue_depth)
        self.registry.register(self._workers)

    def exposition(self) -> bytes:
        """The text /metrics serves: this process's registry, or in multiprocess mode every API process's values
        (summed: counters and histograms add up across processes) plus the live heartbeat view."""
        if not os.environ.get(MULTIPROC_ENV):
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        if self._workers is not None:
            registry.register(self._workers)
        return generate_latest(registry)
