"""OpenTelemetry end to end: ``pagedserve serve --otel-exporter otlp`` sends the API's and the worker's spans of
one request, as one trace, to a real OTLP/HTTP receiver (``otlp_receiver``); the OTEL_* variables alone
configure a tier; what configures tracing resolves as the SDK documents; background Redis commands are not
traced. The processes are real (serve: private Redis, uvicorn, a worker with the default model on the CPU)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from api.tracing import default_sampler, exporter_names
from deploy.redis_server import RedisServer, free_port
from tests.api.conftest import MODEL
from tests.api.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.modelfiles.test_api_without_torch import api_cache, api_venv  # noqa: F401 - the torch-free venv

ROOT = Path(__file__).resolve().parents[2]


# -- what configures tracing ------------------------------------------------------------------------------
def test_the_flag_wins_over_the_environment() -> None:
    assert exporter_names("console", {"OTEL_TRACES_EXPORTER": "otlp"}) == ("console",)
    assert exporter_names("none", {"OTEL_TRACES_EXPORTER": "otlp"}) == ()


def test_otel_variables_configure_it_without_the_flag() -> None:
    assert exporter_names("", {}) == ()  # off by default, as vLLM
    assert exporter_names("", {"OTEL_TRACES_EXPORTER": "otlp, console"}) == ("otlp", "console")
    assert exporter_names("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == ("otlp",)  # vLLM: an endpoint
    assert exporter_names("", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == ("otlp",)
    assert exporter_names("", {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}) == ()
    assert exporter_names("otlp", {"OTEL_SDK_DISABLED": "true"}) == ()


def test_an_unknown_exporter_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="zipkin"):
        exporter_names("", {"OTEL_TRACES_EXPORTER": "zipkin"})


def test_background_redis_commands_are_dropped_request_ones_kept() -> None:
    exported = InMemorySpanExporter()
    provider = TracerProvider(sampler=default_sampler())  # a local provider: the global one is left alone
    provider.add_span_processor(SimpleSpanProcessor(exported))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("heartbeat HSET", kind=SpanKind.CLIENT):
        pass
    with (
        tracer.start_as_current_span("POST /v1/completions", kind=SpanKind.SERVER),
        tracer.start_as_current_span("EVALSHA", kind=SpanKind.CLIENT),
    ):
        pass
    assert sorted(s.name for s in exported.get_finished_spans()) == ["EVALSHA", "POST /v1/completions"]


# -- real processes, a real receiver -------------------------------------------------------------------
@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def _env(receiver: OtlpReceiver, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)
    env["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # ms: spans reach the receiver while the test waits
    return {**env, **extra}


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, "the process exited at start"
        assert time.monotonic() < deadline, f"{url} not ready in {timeout_s} s"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    _, alive = psutil.wait_procs(children, timeout=10)
    for child in alive:
        child.kill()


def _one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
    return found[0]


@pytest.mark.slow
def test_serve_traces_one_request_across_api_and_worker(receiver: OtlpReceiver) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "deploy.cli", "serve", "--port", str(port), "--device", "cpu"]
    argv += ["--max-num-seqs", "4", "--otel-exporter", "otlp", "--log-level", "warning"]
    env = _env(receiver, OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test")
    proc = subprocess.Popen(argv, env=env, cwd=ROOT)
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}/ready")
        trace_id = secrets.token_hex(16)  # the client's own trace: W3C traceparent in, the same id everywhere
        headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert reply.status_code == 200, reply.text

        def has_both(spans: list[ReceivedSpan]) -> bool:
            names = {(s.service, s.name) for s in spans if s.trace_id == trace_id}
            return {("pagedserve-api", "POST /v1/chat/completions"), ("pagedserve-worker", "worker.job")} <= names

        spans = receiver.wait_for(has_both)
        mine = [s for s in spans if s.trace_id == trace_id]
        server = _one(mine, "pagedserve-api", "POST /v1/chat/completions")
        job = _one(mine, "pagedserve-worker", "worker.job")
        assert server.kind == "SPAN_KIND_SERVER" and job.kind == "SPAN_KIND_CONSUMER"
        assert job.parent_span_id == server.span_id  # the context the API put in the job payload
        assert _one(mine, "pagedserve-worker", "queue_wait").parent_span_id == job.span_id
        assert server.attributes["pagedserve.request_id"] == job.attributes["pagedserve.request_id"]
        assert any(s.service == "pagedserve-api" and s.name == "EVALSHA" for s in mine)  # admission, instrumented
        assert {s.resource.get("deployment.environment") for s in mine} == {"test"}  # OTEL_RESOURCE_ATTRIBUTES
        assert not [s for s in spans if s.kind == "SPAN_KIND_CLIENT" and not s.parent_span_id]  # heartbeats, polls
        assert not [s for s in spans if "/ready" in s.name]  # probes are not traced
    finally:
        _stop(proc)


@pytest.mark.slow
def test_otel_variables_alone_trace_an_api_node(
    receiver: OtlpReceiver,
    redis_server: RedisServer,
    api_venv: Path,  # noqa: F811
    api_cache: Path,  # noqa: F811
) -> None:
    """``pip install ".[api]"`` (no torch) has the OTLP exporter and the instrumentations: OTEL_* alone, no flag."""
    port = free_port()
    argv = [str(api_venv / "bin" / "pagedserve"), "api", "--redis-url", redis_server.url, "--port", str(port)]
    env = _env(receiver, OTEL_TRACES_EXPORTER="otlp", OTEL_SERVICE_NAME="edge-api", PAGEDSERVE_CACHE=str(api_cache))
    env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.Popen([*argv, "--log-level", "warning"], env=env, cwd=ROOT)
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}/ready/api")
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200
        spans = receiver.wait_for(lambda spans: any(s.name == "GET /v1/models" for s in spans))
        assert {s.service for s in spans} == {"edge-api"}
    finally:
        _stop(proc)
