"""A real OTLP/HTTP trace receiver for tests: POST /v1/traces with an ExportTraceServiceRequest protobuf (as
opentelemetry-exporter-otlp-proto-http sends it), decoded with opentelemetry-proto, spans kept in memory."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as a collector sees it: ids in hex, ``kind`` as OTLP's enum name (SPAN_KIND_SERVER, ...)."""

    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    kind: str
    service: str
    attributes: dict[str, Any]
    resource: dict[str, Any] = field(repr=False)


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    return getattr(v, which) if which in ("string_value", "bool_value", "int_value", "double_value") else str(v)


def decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.name,
                        s.SpanKind.Name(s.kind),
                        str(resource.get("service.name", "")),
                        {a.key: _value(a.value) for a in s.attributes},
                        resource,
                    )
                )
    return spans


class OtlpReceiver:
    """``ThreadingHTTPServer`` on 127.0.0.1 (a free port); ``endpoint`` is what OTEL_EXPORTER_OTLP_ENDPOINT takes."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                spans = decode(body)
                with receiver.lock:
                    receiver.spans.extend(spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def received(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def wait_for(self, found: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """The spans received once ``found(spans)`` holds (AssertionError with what came after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while not found(spans := self.received()):
            if time.monotonic() > deadline:
                raise AssertionError(f"spans not received in {timeout_s} s; got {[(s.service, s.name) for s in spans]}")
            time.sleep(0.05)
        return spans
