"""The wire form of envelopes and replies, encoded by msgspec (compiled) around the payload's own JSON.

An outgoing envelope is a msgspec `Struct` whose `data` is the payload's JSON as pydantic (Rust) writes it
(`msgspec.Raw`): no `Envelope` model is built to send an event or a command. The bytes are those of the
pydantic `Envelope`/`CommandEnvelope`/`Reply` with the same values, field for field and in the same order
(tests/common/test_bus.py), so receivers validate them with the pydantic models in libs/common/events.py.
Measured: docs/bus.md.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import msgspec
from pydantic import BaseModel, create_model

from libs.common.events import SCHEMA_VERSION, Command, Event, Reply
from libs.common.ids import new_id

_encode = msgspec.json.Encoder().encode


class TraceOut(msgspec.Struct):
    traceparent: str | None
    tracestate: str | None


class EnvelopeOut(msgspec.Struct):
    """`events.Envelope` as sent."""

    id: str
    type: str
    version: int
    time: float
    source: str
    node: str | None
    incident_id: str | None
    trace: TraceOut
    data: msgspec.Raw


class CommandOut(msgspec.Struct):
    """`events.CommandEnvelope` as sent."""

    id: str
    version: int
    time: float
    source: str
    trace: TraceOut
    to: str | None
    data: msgspec.Raw


class ErrorOut(msgspec.Struct):
    code: str
    message: str


class ReplyOut(msgspec.Struct):
    """`events.Reply` as sent."""

    ok: bool
    data: msgspec.Raw | None
    error: ErrorOut | None


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


def event_body(payload: Event, *, id: str, source: str, node: str | None, incident_id: str | None,
               traceparent: str | None, tracestate: str | None) -> bytes:
    return _encode(EnvelopeOut(id, payload.type, SCHEMA_VERSION, time.time(), source, node,  # type: ignore[attr-defined]
                               incident_id, TraceOut(traceparent, tracestate), msgspec.Raw(payload.model_dump_json())))


def command_body(command: Command, *, source: str, to: str, traceparent: str | None, tracestate: str | None) -> bytes:
    return _encode(CommandOut(new_id(), SCHEMA_VERSION, time.time(), source, TraceOut(traceparent, tracestate), to,
                              msgspec.Raw(command.model_dump_json())))


def ok_reply(result: BaseModel) -> bytes:
    """`Reply(ok=True, data=result)` as sent."""
    return _encode(ReplyOut(True, msgspec.Raw(result.model_dump_json()), None))


def error_reply(code: str, message: str) -> bytes:
    return _encode(ReplyOut(False, None, ErrorOut(code, message)))


@functools.cache
def typed(base: type[BaseModel], data: type[BaseModel], *, optional: bool = False) -> type[Any]:
    """`base` (CommandEnvelope, Reply) with `data` typed as the given model: envelope and payload validated in
    one pass (no dict in between). It reads the same JSON as the untyped envelope."""
    field: Any = (data | None, None) if optional else (data, ...)
    return create_model(f"{data.__name__}{base.__name__}", __base__=base, data=field)  # type: ignore[no-any-return]


def typed_reply(reply_model: type[BaseModel]) -> type[Reply]:
    return typed(Reply, reply_model, optional=True)  # type: ignore[no-any-return]
