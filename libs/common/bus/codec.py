"""The wire form of envelopes and replies, encoded by msgspec (compiled); the payload dumped by pydantic.

An outgoing envelope is a msgspec `Struct` (no `Envelope` model is built to send an event or a command). What a
reader's pydantic model fills in by itself is left out (docs/bus.md, "Wire format"): an envelope's or a trace's
fields that are null, and a payload's fields at their defaults, except an event's `type` (the discriminator that
names its model). The trace context travels in the envelope only, not again in a NATS header. Receivers validate
with the pydantic models in libs/common/events.py, which read this form and the earlier one (every field written
out, the trace in a header too) alike (tests/common/test_bus_wire.py).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import msgspec
from pydantic import BaseModel, create_model

from libs.common.events import SCHEMA_VERSION, Command, Envelope, Event, Reply, TraceContext
from libs.common.ids import new_id

_encode = msgspec.json.Encoder().encode


class TraceOut(msgspec.Struct, omit_defaults=True):
    traceparent: str | None = None
    tracestate: str | None = None


class EnvelopeOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`events.Envelope` as sent."""

    id: str
    type: str
    version: int
    time: float
    source: str
    node: str | None = None
    incident_id: str | None = None
    trace: TraceOut | None = None
    data: dict[str, Any]


class CommandOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`events.CommandEnvelope` as sent."""

    id: str
    version: int
    time: float
    source: str
    trace: TraceOut | None = None
    to: str | None = None
    expires: float | None = None
    data: msgspec.Raw


class ErrorOut(msgspec.Struct):
    code: str
    message: str


class ReplyOut(msgspec.Struct, omit_defaults=True):
    """`events.Reply` as sent."""

    ok: bool
    data: msgspec.Raw | None = None
    error: ErrorOut | None = None


_FIELDS: dict[type, frozenset[str]] = {}


def field(model: BaseModel, name: str) -> Any:
    """`getattr(model, name, None)` without pydantic's slow miss (its `__getattr__` raises and the caller catches
    AttributeError: ~5 us, against ~0.1 for a field that exists); each class's fields are read once."""
    cls = type(model)
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = frozenset(cls.model_fields)
    return getattr(model, name) if name in names else None


_RECORD_FIELDS = ("engine", "lease")
_CARRIES: dict[type, tuple[str, ...]] = {}


def carried_nodes(payload: BaseModel) -> list[str]:
    """The nodes of the records an event carries (an engine's, a lease's): the nodes it describes besides its own
    `node` field. Publishing sends an event as that node; receiving refuses one whose subject is another node's.
    Which record fields a class has is read once per class: most events carry none, and then this is one lookup
    (it runs for every event published and every node's event received)."""
    cls = type(payload)
    names = _CARRIES.get(cls)
    if names is None:
        names = _CARRIES[cls] = tuple(n for n in _RECORD_FIELDS if n in cls.model_fields)
    if not names:
        return []
    records = [getattr(payload, n) for n in names]
    return [r.node for r in records if r is not None]


def trace_out(traceparent: str | None, tracestate: str | None) -> TraceOut | None:
    return TraceOut(traceparent, tracestate) if traceparent or tracestate else None


def payload_fields(payload: Event) -> dict[str, Any]:
    """The payload's JSON fields without those at their defaults (its model fills them in), `type` kept: the
    envelope's union of events tells them apart by it (and a reader of the earlier form requires it)."""
    return {"type": payload.type, **payload.model_dump(mode="json", exclude_defaults=True)}  # type: ignore[attr-defined]


def event_body(payload: Event, *, id: str, source: str, node: str | None, incident_id: str | None,
               traceparent: str | None, tracestate: str | None) -> bytes:
    return _encode(EnvelopeOut(id=id, type=payload.type, version=SCHEMA_VERSION,  # type: ignore[attr-defined]
                               time=time.time(), source=source, node=node,
                               incident_id=incident_id, trace=trace_out(traceparent, tracestate),
                               data=payload_fields(payload)))


def envelope_body(env: Envelope) -> bytes:
    """An `Envelope` model in the same wire form as `event_body`."""
    return _encode(EnvelopeOut(id=env.id, type=env.type, version=env.version, time=env.time, source=env.source,
                               node=env.node, incident_id=env.incident_id,
                               trace=trace_out(env.trace.traceparent, env.trace.tracestate),
                               data=payload_fields(env.data)))


def command_body(command: Command, *, source: str, to: str, traceparent: str | None, tracestate: str | None,
                 timeout_s: float | None = None) -> bytes:
    """`timeout_s`: how long the caller waits for the answer (the envelope's `expires`, from now)."""
    # A command's `op` may be left out with its other defaults: it is read as the model its subject names.
    now = time.time()
    return _encode(CommandOut(id=new_id(), version=SCHEMA_VERSION, time=now, source=source,
                              trace=trace_out(traceparent, tracestate), to=to,
                              expires=None if timeout_s is None else now + timeout_s,
                              data=msgspec.Raw(command.model_dump_json(exclude_defaults=True))))


def ok_reply(result: BaseModel) -> bytes:
    """`Reply(ok=True, data=result)` as sent."""
    return _encode(ReplyOut(True, msgspec.Raw(result.model_dump_json(exclude_defaults=True))))


def error_reply(code: str, message: str) -> bytes:
    return _encode(ReplyOut(False, None, ErrorOut(code, message)))


def trace_headers(trace: TraceContext) -> dict[str, str]:
    """The W3C carrier of an envelope's trace context (empty: none), for the propagator."""
    carrier = {"traceparent": trace.traceparent} if trace.traceparent else {}
    if trace.tracestate:
        carrier["tracestate"] = trace.tracestate
    return carrier


@functools.cache
def typed(base: type[BaseModel], data: type[BaseModel], *, optional: bool = False) -> type[Any]:
    """`base` (CommandEnvelope, Reply) with `data` typed as the given model: envelope and payload validated in
    one pass (no dict in between). It reads the same JSON as the untyped envelope."""
    field: Any = (data | None, None) if optional else (data, ...)
    return create_model(f"{data.__name__}{base.__name__}", __base__=base, data=field)  # type: ignore[no-any-return]


def typed_reply(reply_model: type[BaseModel]) -> type[Reply]:
    return typed(Reply, reply_model, optional=True)  # type: ignore[no-any-return]
