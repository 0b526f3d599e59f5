"""OpenTelemetry spans of a request's journey, one per service: the gateway's (the HTTP request, a child of
the client's `traceparent`), the scheduler's (its wait in the queue) and the worker's (its generation), all
in one trace: the gateway passes its span on in the Submit's `traceparent`. Off unless an OTLP endpoint is
set (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, the SDK's own variables, as are the
exporter's others) and the `otel` extra is installed; off, every call here returns at once."""

from __future__ import annotations

import logging
import os
from typing import Any

from common.settings import SettingsError

ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
log = logging.getLogger("tracing")


class Tracing:
    def __init__(self, service: str, environ: dict[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.enabled = any(environ.get(name) for name in ENDPOINTS)
        self.tracer: Any = None
        if not self.enabled:
            return
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            name = next(n for n in ENDPOINTS if environ.get(n))
            raise SettingsError(f"{name} is set, but OpenTelemetry is not installed: pip install 'llmserve[otel]'") \
                from None
        provider = TracerProvider(resource=Resource.create({"service.name": f"llmserve-{service}"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.provider = provider
        self.tracer = provider.get_tracer("llmserve")
        self.trace = trace

    def start(self, name: str, parent: str = "", start_ns: int | None = None, server: bool = False,
              **attributes: str | int | float) -> Any:
        """A span begun (at `start_ns`, epoch nanoseconds, or now) under the W3C `parent`; None when off."""
        if not self.enabled:
            return None
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = TraceContextTextMapPropagator().extract({"traceparent": parent}) if parent else None
        kind = SpanKind.SERVER if server else SpanKind.INTERNAL
        return self.tracer.start_span(name, context=context, kind=kind, start_time=start_ns, attributes=attributes)

    def end(self, span: Any, end_ns: int | None = None, error: str = "", **attributes: str | int | float) -> None:
        if span is None:
            return
        span.set_attributes(attributes)
        if error:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end_ns)

    def event(self, span: Any, name: str, **attributes: str | int | float) -> None:
        if span is not None:
            span.add_event(name, attributes)

    @staticmethod
    def header(span: Any) -> str:
        """The span's W3C traceparent, for the next hop; '' for none."""
        if span is None:
            return ""
        context = span.get_span_context()
        return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"

    def flush(self) -> None:
        if self.enabled:
            self.provider.force_flush()
