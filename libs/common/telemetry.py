"""Telemetry in one call: OpenTelemetry traces and metrics (OTLP/HTTP when an endpoint is configured,
otherwise kept in-process), W3C trace context in and out of message headers, and structured logs."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_configured = False


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            out["trace_id"] = f"{span.trace_id:032x}"
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str = "INFO", json_lines: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("nats", "aetcd", "grpc", "httpx", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def setup(service: str, *, instance: str = "", otel_endpoint: str | None = None, log_level: str = "INFO",
          log_json: bool = False, span_exporter: SpanExporter | None = None) -> None:
    """Configure logs, traces and metrics for this process. Idempotent."""
    global _configured
    setup_logging(log_level, log_json)
    if _configured:
        return
    resource = Resource.create({"service.name": f"holdfast.{service}", "service.instance.id": instance or service})
    provider = TracerProvider(resource=resource)
    readers = []
    if otel_endpoint:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{otel_endpoint}/v1/traces")))
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=f"{otel_endpoint}/v1/metrics")))
    if span_exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(span_exporter, schedule_delay_millis=100))
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
    _configured = True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(f"holdfast.{name}")


def meter(name: str) -> metrics.Meter:
    return metrics.get_meter(f"holdfast.{name}")


def inject_headers() -> dict[str, str]:
    """The current trace context as W3C headers (empty when there is no active span)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier


@contextlib.contextmanager
def attach_headers(headers: Mapping[str, str]) -> Iterator[None]:
    """Make the trace context carried by `headers` current for the block."""
    ctx = _propagator.extract(dict(headers))
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def context_from_traceparent(traceparent: str | None) -> otel_context.Context:
    return _propagator.extract({"traceparent": traceparent} if traceparent else {})


def now_ms() -> float:
    return time.time() * 1000.0
