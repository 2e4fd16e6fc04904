"""OpenTelemetry for the API: a span per request, its context carried to the worker inside the job payload.
Off by default (the API's no-op tracer then costs next to nothing)."""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.propagate import inject

logger = logging.getLogger(__name__)
tracer = trace.get_tracer("pagedserve.api")


def setup_tracing(exporter: str, service_name: str) -> None:
    """Install a tracer provider exporting to ``console`` or ``otlp`` (needs opentelemetry-exporter-otlp)."""
    if exporter == "none":
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    span_exporter: SpanExporter
    if exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise ValueError("otel exporter 'otlp' needs `pip install opentelemetry-exporter-otlp`") from exc
        span_exporter = OTLPSpanExporter()  # endpoint from OTEL_EXPORTER_OTLP_ENDPOINT
    else:
        span_exporter = ConsoleSpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)
    logger.info("tracing to %s", exporter)


def current_context_carrier() -> dict[str, str]:
    """The active span's context as W3C headers, for the job payload."""
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier
