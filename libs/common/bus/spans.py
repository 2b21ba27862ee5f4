"""Whether spans are exported: hot paths skip optional spans when none is (docs/bus.md has the cost)."""

from __future__ import annotations


def spans_exported() -> bool:
    """Whether a finished span goes anywhere (a span processor, i.e. an exporter, is configured). Without one the
    SDK still builds each span and drops it; the trace context itself still travels in the headers."""
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    processors = getattr(getattr(provider, "_active_span_processor", None), "_span_processors", None)
    return processors is None or bool(processors)  # a provider we do not know: assume it exports
