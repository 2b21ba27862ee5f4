"""The event and command decoders under hypothesis: whatever arrives, the only failure is MalformedMessage."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.common.errors import MalformedMessage
from libs.common.events import (
    EVENT_TYPES,
    CommandEnvelope,
    Envelope,
    FaultDetected,
    FaultKind,
    Freeze,
    Reply,
    decode_event,
    decode_model,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_or_reject(raw: bytes) -> None:
    try:
        env = decode_event(raw)
    except MalformedMessage as e:
        assert e.message  # says what was wrong
        return
    assert env.type in EVENT_TYPES and env.type == env.data.type


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_are_rejected_or_decoded_never_crash(raw: bytes) -> None:
    _decode_or_reject(raw)


@FUZZ
@given(st.dictionaries(st.sampled_from(["id", "type", "version", "time", "source", "node", "incident_id", "trace", "data"]),
                       json_values, max_size=9),
       st.sampled_from(sorted(EVENT_TYPES)), json_values)
def test_envelopes_with_random_fields_are_rejected_or_decoded(fields: dict, etype: str, payload: object) -> None:
    doc = {**fields}
    if isinstance(payload, dict):
        doc["data"] = {"type": etype, **payload}
    _decode_or_reject(json.dumps(doc).encode())


@FUZZ
@given(st.sampled_from(list(FaultDetected.model_fields)), json_values)
def test_a_valid_event_with_one_field_corrupted_is_rejected_or_still_valid(field: str, value: object) -> None:
    env = Envelope(type="fault.detected", source="agent",
                   data=FaultDetected(engine_id="e1", kind=FaultKind.KILLED, signal=9))
    doc = json.loads(env.model_dump_json())
    doc["data"][field] = value
    _decode_or_reject(json.dumps(doc).encode())


@FUZZ
@given(json_values)
def test_commands_and_replies_reject_what_is_not_theirs(value: object) -> None:
    raw = json.dumps(value).encode()
    for model in (CommandEnvelope, Freeze, Reply):
        try:
            decode_model(model, raw)
        except MalformedMessage:
            pass


def test_an_event_with_an_oversized_string_is_malformed() -> None:
    """A schema-valid fault whose model name was 600 KB became an incident record etcd could not take (the batched
    write failed, and every later term's read of the records): every string is bounded (4 KiB), an identifier
    tighter (256)."""
    base = FaultDetected(engine_id="e1", kind=FaultKind.EXITED, node="node-1").model_dump(mode="json")
    for field, size in (("model", 257), ("engine_id", 257), ("node", 257), ("detail", 4097), ("model", 600_000)):
        raw = json.dumps({"id": "x", "type": "fault.detected", "source": "agent", "time": 1.0,
                          "data": {**base, field: "m" * size}}).encode()
        try:
            decode_event(raw)
        except MalformedMessage as e:
            assert field in e.message
        else:
            raise AssertionError(f"a {size}-character {field} was accepted")
    ok = json.dumps({"id": "x", "type": "fault.detected", "source": "agent", "time": 1.0,
                     "data": {**base, "model": "m" * 256, "detail": "d" * 4096}}).encode()
    assert decode_event(ok).data.model == "m" * 256


def test_a_command_that_never_expires_is_malformed() -> None:
    """`expires: NaN` compared false with every clock, so the command never expired; no number is NaN or infinite."""
    for bad in ("NaN", "Infinity", "-Infinity"):
        raw = '{"source": "dc_manager", "to": "node-1", "expires": ' + bad + ', "data": {"owner": "e1"}}'
        try:
            decode_model(CommandEnvelope, json.loads(raw))
        except MalformedMessage as e:
            assert "expires" in e.message
        else:
            raise AssertionError(f"expires {bad} was accepted")
