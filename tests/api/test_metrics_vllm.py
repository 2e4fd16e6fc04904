"""/metrics under vLLM's names: the API's per-request metrics (with the scripted worker), summed across the
processes of ``pagedserve api --api-workers 2`` (prometheus-client's multiprocess mode), and a real worker with
``--enable-prefix-caching``: a repeated prompt reports its cached tokens in ``usage`` and in the worker's
``vllm:prefix_cache_hits``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from deploy.redis_server import RedisServer, free_port
from tests.api.conftest import MODEL, ScriptedWorker, ServerThread, start_api
from wire.messages import WorkerHeartbeat
from worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
# vLLM's boundaries (vllm/v1/metrics/loggers.py), written out here so that a change on our side shows
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0]
VLLM_TTFT += [40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0]
VLLM_LATENCY += [480.0, 960.0, 1920.0, 7680.0]


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value of a Prometheus text exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples(text).items() if n == name and want <= ls)


def buckets(text: str, name: str) -> list[float]:
    return sorted(float(dict(ls)["le"]) for (n, ls), _ in samples(text).items() if n == f"{name}_bucket")[:-1]


async def _one_request(url: str, worker: ScriptedWorker, stream: bool) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": stream}
    async with httpx.AsyncClient(timeout=20) as client:  # a new connection: any API process may take it
        reply, _ = await asyncio.gather(client.post(url + "/v1/completions", json=body), worker.serve(1))
    assert reply.status_code == 200, reply.text


async def test_api_exports_vllm_names_labels_and_buckets(redis_url: str, redis_server: RedisServer) -> None:
    api = start_api(redis_server, response_cache=False)
    try:
        worker = ScriptedWorker(redis_url)
        for stream in (True, False):
            await _one_request(api.url, worker, stream)
        text = httpx.get(api.url + "/metrics").text
    finally:
        api.stop()
    assert value(text, "vllm:request_success_total", model_name=MODEL, finished_reason="stop") == 2
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens"):
        assert value(text, f"vllm:{name}_count", model_name=MODEL) == 2, name
    # the stream's first delta (a non-streamed request's comes from the worker's ttft_s: the scripted one has none)
    assert value(text, "vllm:time_to_first_token_seconds_count", model_name=MODEL) == 1
    # between the stream's deltas: 4 written, fewer seen when the relay merges those that arrive together
    assert value(text, "vllm:inter_token_latency_seconds_count", model_name=MODEL) <= 3
    assert value(text, "vllm:request_generation_tokens_sum", model_name=MODEL) == 8
    assert buckets(text, "vllm:time_to_first_token_seconds") == VLLM_TTFT
    assert buckets(text, "vllm:inter_token_latency_seconds") == VLLM_ITL
    assert buckets(text, "vllm:e2e_request_latency_seconds") == VLLM_LATENCY
    assert buckets(text, "vllm:request_prompt_tokens")[:4] == [1, 2, 5, 10]  # vLLM's 1-2-5 up to max_model_len
    assert not any(n.startswith("vllm:num_requests") for n, _ in samples(text))  # the engine's: the workers'


def test_worker_exports_the_engines_vllm_names() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(MODEL, "w1", registry=registry)
    beat = WorkerHeartbeat("w1", MODEL, 8, 2048, num_running=3, kv_cache_usage=0.5, prompt_tokens_total=100)
    metrics.update(beat)
    beat.prompt_tokens_total, beat.prefix_cache_hits, beat.prefix_cache_queries = 150, 32, 64
    metrics.update(beat)
    text = generate_latest(registry).decode()
    labels = {"model_name": MODEL, "engine": "w1"}
    assert value(text, "vllm:num_requests_running", **labels) == 3
    assert value(text, "vllm:kv_cache_usage_perc", **labels) == 0.5
    assert value(text, "vllm:prompt_tokens_total", **labels) == 150  # the heartbeats' totals, as increments
    assert value(text, "vllm:prefix_cache_hits_total", **labels) == 32
    assert value(text, "vllm:prefix_cache_queries_total", **labels) == 64
    assert buckets(text, "pagedserve:worker_time_to_first_token_seconds") == VLLM_TTFT


@pytest.fixture
def two_process_api(redis_url: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    argv = [sys.executable, "-m", "deploy.cli", "api", "--api-workers", "2", "--port", str(port)]
    argv += ["--redis-url", redis_url, "--queue-without-workers-s", "inf", "--no-response-cache"]
    argv += ["--log-level", "warning"]
    proc = subprocess.Popen(argv, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "pagedserve api exited at start"
            assert time.monotonic() < deadline, "pagedserve api did not start"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _successes_by_pid(folder: str) -> dict[int, float]:
    """Each API process's own count of finished requests, from its file in the multiprocess folder."""
    counts: dict[int, float] = {}
    for path in Path(folder).glob("counter_*.db"):
        pid = int(path.stem.split("_")[1])
        metrics = MultiProcessCollector.merge([str(path)])
        counts[pid] = sum(s.value for m in metrics if m.name == "vllm:request_success" for s in m.samples)
    return counts


@pytest.mark.slow  # two API processes start (~15 s on 2 shared cores)
async def test_two_api_processes_serve_the_sum(
    redis_url: str, two_process_api: tuple[str, subprocess.Popen[bytes]]
) -> None:
    url, proc = two_process_api
    children = psutil.Process(proc.pid).children(recursive=True)
    folders = {
        c.environ().get("PROMETHEUS_MULTIPROC_DIR") for c in children if "multiprocessing" in " ".join(c.cmdline())
    }
    folder = folders.pop()
    assert folder and not folders, "every API process shares one multiprocess folder"
    worker = ScriptedWorker(redis_url)
    sent = 0
    while sent < 40 and len([n for n in _successes_by_pid(folder).values() if n]) < 2:
        await _one_request(url, worker, stream=False)  # until both processes have served some
        sent += 1
    per_process = _successes_by_pid(folder)
    assert len([n for n in per_process.values() if n]) == 2, f"one process served all {sent}: {per_process}"
    for _ in range(6):  # each scrape lands on either process; every one reports the sum
        text = httpx.get(url + "/metrics", timeout=5).text
        assert value(text, "vllm:request_success_total", model_name=MODEL) == sent
        assert value(text, "vllm:e2e_request_latency_seconds_count", model_name=MODEL) == sent
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    assert not Path(folder).exists(), "the multiprocess folder is removed when the API stops"


@pytest.fixture(scope="module")
def caching_worker(redis_server: RedisServer) -> Iterator[tuple[ServerThread, str]]:
    """A real worker (default model, CPU) with the prefix cache on and its metrics port, and an API."""
    redis.Redis.from_url(redis_server.url).flushall()
    metrics_port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "deploy.cli", "worker", "--redis-url", redis_server.url, "--device", "cpu"]
    argv += ["--enable-prefix-caching", "--max-num-seqs", "4", "--worker-id", "pc-worker"]
    argv += ["--metrics-port", str(metrics_port), "--log-level", "warning"]
    worker = subprocess.Popen(argv, env=env, cwd=ROOT)
    api = start_api(redis_server, response_cache=False)
    try:
        deadline = time.monotonic() + 180
        while httpx.get(api.url + "/ready").status_code != 200:
            assert worker.poll() is None, "the worker died at start"
            assert time.monotonic() < deadline, "the worker did not become ready"
            time.sleep(0.3)
        yield api, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        api.stop()
        worker.terminate()
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


@pytest.mark.slow  # a real worker loads the model
def test_repeated_prompt_reports_cached_tokens(caching_worker: tuple[ServerThread, str]) -> None:
    api, worker_metrics = caching_worker
    client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0, timeout=120)
    prompt = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(40))
    usages = []
    for _ in range(2):
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0)
        assert reply.usage is not None and reply.usage.prompt_tokens > 200
        usages.append(reply.usage)
    first, second = (u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None for u in usages)
    assert first == 0
    assert second is not None and 0 < second < usages[1].prompt_tokens  # whole blocks, the last token recomputed
    labels = {"model_name": MODEL, "engine": "pc-worker"}
    deadline = time.monotonic() + 10  # the worker's metrics follow its heartbeat, which may come mid-request
    while (
        value(text := httpx.get(worker_metrics).text, "vllm:prefix_cache_hits_total", **labels) < second
        or value(text, "vllm:generation_tokens_total", **labels) < 4
    ):
        assert time.monotonic() < deadline, text
        time.sleep(0.2)
    assert value(text, "vllm:prefix_cache_queries_total", **labels) >= 2 * usages[0].prompt_tokens - second
    assert value(text, "vllm:prompt_tokens_total", **labels) > 0
    assert value(text, "vllm:generation_tokens_total", **labels) >= 4
    api_text = httpx.get(api.url + "/metrics").text
    assert value(api_text, "vllm:request_success_total", model_name=MODEL, finished_reason="length") == 2
    assert value(api_text, "vllm:time_to_first_token_seconds_count", model_name=MODEL) == 2  # from ttft_s
