"""The wire form (codec.py): what a reader fills in is not sent, what it needs stays, and the earlier form (every
field written out, the trace context in a header too) still reads the same. The last two against a real
nats-server: what goes on the wire, and the trace context that reaches a handler."""

from __future__ import annotations

import asyncio
import json

import pytest
from nats.aio.msg import Msg
from opentelemetry import trace

from libs.common import telemetry
from libs.common.bus import Bus, codec
from libs.common.errors import MalformedMessage
from libs.common.events import (
    CommandEnvelope,
    EngineInfo,
    EngineReattached,
    EngineRole,
    Envelope,
    FaultDetected,
    FaultKind,
    Freeze,
    FreezeReply,
    IntentResult,
    LeaseChanged,
    LeaseInfo,
    LeaseState,
    RecoverIntent,
    Reply,
    Tag,
    Takeover,
    TakeoverReply,
    TraceContext,
    command_subject,
    decode_event,
    decode_model,
    event_subject,
)

telemetry.setup("tests")

TP = "00-ed3b4f17d307403ec11649204e407cbd-03cd229149ecfa26-01"
INC = "inc-n0000-g0-e0-g0"


def _engine() -> EngineInfo:
    return EngineInfo(engine_id="n0000-g0-e0-s1", node="n0000", model="m", engine_class="sim",
                      role=EngineRole.ACTIVE, endpoint="http://127.0.0.1:9/n0000-g0-e0-s1")


# One incident's events as the benchmark's control plane sends them (docs/controlplane.md).
INCIDENT = [
    FaultDetected(engine_id="n0000-g0-e0", model="m", engine_class="sim", kind=FaultKind.KILLED, signal=9,
                  died_at=1796281331.6365201, node="n0000"),
    RecoverIntent(incident_id=INC, engine_id="n0000-g0-e0", model="m", engine_class="sim", kind=FaultKind.KILLED,
                  node="n0000"),
    IntentResult(incident_id=INC, step="reattach", ok=True, detail="standby", successor_id="n0000-g0-e0-s1",
                 endpoint="http://127.0.0.1:9/n0000-g0-e0-s1", timings_ms={"reattach": 28.9, "freeze": 23.2},
                 frozen_at=1796281331.7352383),
]


def _envelope(payload: object, trace_parent: str | None = TP, node: str = "n0000") -> Envelope:
    return Envelope(id=f"{INC}-x", type=payload.type, source="controller:c1", node=node,  # type: ignore[attr-defined]
                    incident_id=getattr(payload, "incident_id", None), trace=TraceContext(traceparent=trace_parent),
                    data=payload)  # type: ignore[arg-type]


@pytest.mark.parametrize("payload", INCIDENT, ids=lambda p: p.type)
def test_an_event_leaves_out_what_its_reader_fills_in_and_reads_as_the_earlier_form_does(payload: object) -> None:
    env = _envelope(payload)
    earlier = env.model_dump_json().encode()  # the form every writer sent before: each field, nulls and defaults
    now = codec.envelope_body(env)
    assert decode_event(now) == decode_event(earlier) == env
    body = json.loads(now)
    assert "tracestate" not in body["trace"]
    assert None not in body.values() and None not in body["data"].values()
    defaults = {name for name, f in type(payload).model_fields.items()
                if name != "type" and getattr(payload, name) == f.get_default(call_default_factory=True)}
    assert defaults and not defaults & set(body["data"])
    # A reader of the earlier form (the union of events by `type`) reads it too: the tag stays, and the header
    # that carried the trace context again is gone: at least 100 bytes fewer on the wire for each of them.
    assert body["data"]["type"] == payload.type  # type: ignore[attr-defined]
    assert len(now) <= len(earlier) + len(f"traceparent: {TP}\r\n") - 100


def test_fields_that_must_stay_present_stay_even_when_null() -> None:
    lease = LeaseInfo(id="l-1", node="n0000", gpu=0, size=1, chunk_size=1, tag=Tag.WEIGHTS, owner="e-1", epoch=1,
                      state=LeaseState.FROZEN, created_at=0.0, last_seen=0.0)
    for payload, required_null in ((EngineReattached(incident_id=None, predecessor_id="e-1", engine=_engine(),
                                                     used_standby=True), "incident_id"),
                                   (LeaseChanged(lease=lease, from_state=None), "from_state")):
        env = Envelope(type=payload.type, source="gpu_manager:n0000", node="n0000", data=payload)
        body = json.loads(codec.envelope_body(env))
        assert {"id", "type", "version", "time", "source", "data"} <= set(body) and "trace" not in body
        assert body["data"][required_null] is None  # required: no default for a reader to fill in
        assert decode_event(codec.envelope_body(env)) == env


def test_a_payload_without_its_type_or_a_required_field_is_refused_with_a_typed_error() -> None:
    body = json.loads(codec.envelope_body(_envelope(INCIDENT[0])))
    for data in ({k: v for k, v in body["data"].items() if k != "type"},
                 {k: v for k, v in body["data"].items() if k != "kind"}):
        with pytest.raises(MalformedMessage, match="invalid event"):
            decode_event(json.dumps({**body, "data": data}).encode())


def test_commands_and_replies_leave_out_their_defaults_and_read_as_the_earlier_form_does() -> None:
    cmd = Takeover(incident_id=INC, engine_id="n0000-g0-e0", transfer_token="tok-n0000-g0-e0-2")
    now = codec.command_body(cmd, source="dc_manager:dc-1", to="n0000", traceparent=TP, tracestate=None)
    got = json.loads(now)
    earlier = CommandEnvelope(id=got["id"], time=got["time"], source="dc_manager:dc-1",
                              trace=TraceContext(traceparent=TP), to="n0000", data=cmd.model_dump())
    typed = codec.typed(CommandEnvelope, Takeover)
    assert decode_model(typed, now) == decode_model(typed, earlier.model_dump_json())
    assert decode_model(typed, now).data == cmd and set(got["data"]) == {"incident_id", "engine_id", "transfer_token"}

    reply = TakeoverReply(engine=_engine(), used_standby=True)
    now = codec.ok_reply(reply)
    earlier_reply = Reply(ok=True, data=reply.model_dump()).model_dump_json()
    assert "error" not in json.loads(now) and "pid" not in json.loads(now)["data"]["engine"]
    assert decode_model(codec.typed_reply(TakeoverReply), now) == decode_model(codec.typed_reply(TakeoverReply),
                                                                               earlier_reply)
    assert json.loads(codec.error_reply("not_found", "gone")) == {"ok": False,
                                                                  "error": {"code": "not_found", "message": "gone"}}


async def test_an_event_carries_its_trace_in_its_envelope_only_and_its_handler_runs_under_it(bus: Bus) -> None:
    raw: asyncio.Queue[Msg] = asyncio.Queue()
    seen: asyncio.Queue[str | None] = asyncio.Queue()

    async def handler(env: Envelope) -> None:
        span = trace.get_current_span().get_span_context()
        await seen.put(f"{span.trace_id:032x}" if span.is_valid else None)

    await bus.nc.subscribe(event_subject(bus.prefix, FaultDetected, bus.settings.node), cb=raw.put)
    await bus.subscribe("fault.detected", handler)
    with telemetry.tracer("test").start_as_current_span("incident") as span:
        sent = await bus.emit(FaultDetected(engine_id="e1", kind=FaultKind.KILLED, signal=9))
        trace_id = f"{span.get_span_context().trace_id:032x}"
    msg = await asyncio.wait_for(raw.get(), 2)
    assert msg.headers == {"Nats-Msg-Id": sent.id}  # the stream's deduplication key, nothing else
    assert trace_id in json.loads(msg.data)["trace"]["traceparent"]
    assert await asyncio.wait_for(seen.get(), 2) == trace_id
    # The earlier form (the trace context in a header as well) still runs its handler under it.
    old = _envelope(FaultDetected(engine_id="e2", kind=FaultKind.KILLED), TP, bus.settings.node)
    await bus.nc.publish(event_subject(bus.prefix, FaultDetected, bus.settings.node), old.model_dump_json().encode(),
                         headers={"traceparent": TP})
    assert await asyncio.wait_for(seen.get(), 2) == TP.split("-")[1]


async def test_a_command_carries_no_header_and_its_handler_runs_under_its_trace(bus: Bus) -> None:
    raw: asyncio.Queue[Msg] = asyncio.Queue()
    seen: list[str | None] = []

    async def freeze(cmd: Freeze) -> FreezeReply:
        span = trace.get_current_span().get_span_context()
        seen.append(f"{span.trace_id:032x}" if span.is_valid else None)
        return FreezeReply(lease_ids=["l1"], epoch=2, transfer_token="t" * 16)

    await bus.nc.subscribe(command_subject(bus.prefix, "node-1", Freeze), cb=raw.put)
    await bus.serve("node-1", Freeze, freeze)
    reply = await bus.request("node-1", Freeze(owner="e1"), FreezeReply, traceparent=TP)
    assert reply.epoch == 2 and seen == [TP.split("-")[1]]
    replies = [r async for r in bus.request_all([("node-1", Freeze(owner="e2"), TP)], FreezeReply)]
    assert [[type(got) for _, got in batch] for batch in replies] == [[FreezeReply]] and len(seen) == 2
    for _ in range(2):
        msg = await asyncio.wait_for(raw.get(), 2)
        assert msg.headers is None and json.loads(msg.data)["trace"] == {"traceparent": TP}
