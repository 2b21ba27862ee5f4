"""One OpenTelemetry trace per incident: a root span while it is open (in the leader that opened it), and a
span per step placed at its recorded times. Without an exporter configured no span object is built at all:
the incident still gets a trace context (the fault's trace when it came with one), which the dc_manager and
the nodes propagate, so an exporter added later sees whole traces.
"""

from __future__ import annotations

import random

from opentelemetry import trace

from libs.common import telemetry
from libs.common.bus import spans_exported
from services.controller.incident import IncidentRecord


class IncidentTracer:
    def __init__(self) -> None:
        self.tracer = telemetry.tracer("controller")
        self.export_spans = spans_exported()
        self._spans: dict[str, trace.Span] = {}

    def open(self, rec: IncidentRecord) -> None:
        """Give the incident its trace context (`rec.trace_parent`), and its live root span when exporting."""
        if not self.export_spans:  # the fault's trace (the detector's span) when it came with one, else a new one
            # Ids as the OpenTelemetry SDK makes them (random.getrandbits, never zero): not a secret, and not an
            # os.urandom call each (two per incident).
            current = trace.get_current_span().get_span_context()
            trace_id = current.trace_id if current.is_valid else (random.getrandbits(128) or 1)
            rec.trace_parent = f"00-{trace_id:032x}-{random.getrandbits(64) or 1:016x}-01"
            return
        start = rec.died_at if rec.died_at is not None else rec.opened_at
        span = self.tracer.start_span(f"incident {rec.reason}", start_time=int(start * 1e9),
                                      attributes={"holdfast.incident": rec.id, "holdfast.engine": rec.engine_id})
        self._spans[rec.id] = span
        with trace.use_span(span, end_on_exit=False):
            rec.trace_parent = telemetry.inject_headers().get("traceparent")

    def steps(self, old: IncidentRecord, new: IncidentRecord) -> None:
        """A span for each step that ended in this write, placed at its recorded times."""
        if new.trace_parent is None or not self.export_spans:
            return
        ctx = None
        for step, s in new.steps.items():
            before = old.steps.get(step)
            if s.ended_at is None or (before is not None and before.ended_at is not None):
                continue
            if ctx is None:  # the live root span when this process opened it, else the recorded parent
                root = self._spans.get(new.id)
                ctx = trace.set_span_in_context(root) if root is not None else \
                    telemetry.context_from_traceparent(new.trace_parent)
            span = self.tracer.start_span(f"step {step}", context=ctx, start_time=int(s.started_at * 1e9),
                                          attributes={"holdfast.incident": new.id, "holdfast.step": str(step),
                                                      "holdfast.status": s.status})
            span.end(end_time=int(s.ended_at * 1e9))

    def close(self, rec: IncidentRecord) -> None:
        span = self._spans.pop(rec.id, None)
        if span is not None:
            span.set_attribute("holdfast.outcome", str(rec.state))
            span.end()
