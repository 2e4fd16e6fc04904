"""OpenTelemetry for both tiers: the API's per-request server spans (opentelemetry-instrumentation-fastapi),
Redis commands (opentelemetry-instrumentation-redis) and the worker's job span, one trace per request: the
API's context rides to the worker inside the job payload (``JobPayload.trace_context``).

Configured as the SDK documents it, so a collector set up for vLLM or any OTel service works unchanged:
``--otel-exporter`` (none | console | otlp) wins, else ``OTEL_TRACES_EXPORTER`` (a comma list), else ``otlp``
when an ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` is set (vLLM turns tracing on with an endpoint), else off.
``OTEL_SDK_DISABLED=true`` turns it off. The exporter reads its own ``OTEL_EXPORTER_OTLP_*`` variables
(endpoint, headers, protocol, timeout, compression), the resource ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES``, the batch processor ``OTEL_BSP_*``, and ``OTEL_TRACES_SAMPLER`` replaces the
default sampler. Off, nothing is installed and the no-op tracer costs next to nothing."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.propagate import inject
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind
from opentelemetry.util.types import Attributes

if TYPE_CHECKING:
    from fastapi import FastAPI
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

logger = logging.getLogger(__name__)
tracer = trace.get_tracer("pagedserve.api")

EXPORTERS = ("none", "console", "otlp")
# probes and scrapes every few seconds are not requests worth a trace (OTEL_PYTHON_FASTAPI_EXCLUDED_URLS wins)
UNTRACED_URLS = "/health,/ready,/metrics"


def exporter_names(flag: str, env: Mapping[str, str]) -> tuple[str, ...]:
    """The exporters to install, none for off: ``flag`` (the CLI's ``--otel-exporter``) if given, else the
    ``OTEL_*`` variables in ``env``."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    has_endpoint = any(env.get(k) for k in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"))
    raw = flag or env.get("OTEL_TRACES_EXPORTER", "") or ("otlp" if has_endpoint else "none")
    names = tuple(dict.fromkeys(n.strip().lower() for n in raw.split(",") if n.strip()))
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ValueError(f"unknown trace exporter {', '.join(unknown)} (from {raw!r}): use none, console or otlp")
    return () if "none" in names else names


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    protocol = protocol.strip() or "http/protobuf"
    try:
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter()  # endpoint, headers, timeout, compression: its OTEL_EXPORTER_OTLP_* variables
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            return GrpcExporter()
    except ImportError as exc:
        package = "opentelemetry-exporter-otlp-proto-" + ("grpc" if protocol == "grpc" else "http")
        raise ValueError(f"the OTLP {protocol} trace exporter needs `pip install {package}`") from exc
    raise ValueError(f"OTLP protocol {protocol!r} is not supported: use http/protobuf or grpc")


class SkipBackgroundRedis(Sampler):
    """Root spans only: a CLIENT span without a parent is a Redis command of a background loop (heartbeats,
    arq's polling, the reaper's sweep, every few hundred ms) and is dropped; one inside a request or a job is
    kept with its parent (``ParentBased``)."""

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: trace.TraceState | None = None,
    ) -> SamplingResult:
        decision = Decision.DROP if kind == SpanKind.CLIENT else Decision.RECORD_AND_SAMPLE
        return SamplingResult(decision, attributes if decision == Decision.RECORD_AND_SAMPLE else None)

    def get_description(self) -> str:
        return "SkipBackgroundRedis"


def default_sampler() -> Sampler:
    return ParentBased(root=SkipBackgroundRedis())


def setup_tracing(exporter: str, service_name: str, env: Mapping[str, str] | None = None) -> TracerProvider | None:
    """Install this process's tracer provider and the Redis instrumentation (see the module docstring for what
    configures it); None when tracing is off. ``service_name`` is the default of ``OTEL_SERVICE_NAME``."""
    env = os.environ if env is None else env
    names = exporter_names(exporter, env)
    if not names:
        return None
    from opentelemetry.instrumentation.redis import RedisInstrumentor
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    sampler = None if env.get("OTEL_TRACES_SAMPLER") else default_sampler()  # None: the SDK reads the variable
    provider = TracerProvider(resource=resource, sampler=sampler)
    for name in names:
        span_exporter = _otlp_exporter(env) if name == "otlp" else ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)
    RedisInstrumentor().instrument(tracer_provider=provider)
    logger.info("tracing to %s as %s", ",".join(names), resource.attributes.get(SERVICE_NAME))
    return provider


def setup_api_tracing(app: FastAPI, exporter: str) -> None:
    """Tracing for the API process: a server span per HTTP request (not per SSE chunk sent), Redis spans."""
    provider = setup_tracing(exporter, "pagedserve-api")
    if provider is None:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(
        app,
        tracer_provider=provider,
        excluded_urls=os.environ.get("OTEL_PYTHON_FASTAPI_EXCLUDED_URLS", UNTRACED_URLS),
        exclude_spans=["receive", "send"],
    )


def annotate_request(request_id: str, **attributes: int | bool) -> None:
    """The request's attributes on the current (server) span: ``pagedserve.request_id`` and ``pagedserve.<k>``."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("pagedserve.request_id", request_id)
        span.set_attributes({f"pagedserve.{k}": v for k, v in attributes.items()})


def current_context_carrier() -> dict[str, str]:
    """The active span's context as W3C headers, for the job payload."""
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier
