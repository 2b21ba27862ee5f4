"""Every frame an engine sends is validated before it touches its record (services/agent/protocol.py): a bad one is
answered `malformed` and changes nothing, and the engine and everyone else are served on (probe of 2026-12,
section 5: a ready's endpoint given as a map was stored, every later save of the record raised, the link was dropped
with no reply and, when the engine died, its standby's promotion never ran)."""

from __future__ import annotations

import os
import socket

import pytest

from libs.common import wire
from libs.common.config import CommonSettings
from libs.common.errors import MalformedMessage
from libs.common.events import FaultKind
from libs.common.store import Store
from services.agent.protocol import parse_message, parse_register
from tests.agent.conftest import AgentProcess, Recorder, engine_records
from tests.agent.fake_link import FakeLink
from tests.support import wait_until

BAD = [
    {"op": "ready", "seq": 1, "endpoint": {"x": 1}, "state": "ready"},
    {"op": "shadowing", "seq": 2, "owner": {"a": 1}},
    {"op": "fatal", "seq": 3, "kind": "bogus", "detail": "x"},
    {"op": "asleep", "seq": 4, "sleeping": [1]},
    {"op": "ready", "seq": 5, "endpoint": "http://127.0.0.1:1/\n", "state": "ready"},  # a forged log line
    {"op": "nope", "seq": 6},
]


async def test_a_malformed_message_is_answered_malformed_leaves_the_record_as_it_was_and_the_link_serves_on(
        agent: AgentProcess, recorder: Recorder, store: Store, settings: CommonSettings) -> None:
    agent.start([])
    await agent.wait_up(store)
    ready = {"op": "ready", "seq": 7, "endpoint": "http://127.0.0.1:1", "state": "ready"}
    fake = FakeLink(str(settings.state_dir / "agent.sock"), {"engine_id": "odd-1", "role": "active", "model": "m"},
                    [*BAD, ready])
    try:
        registered, *refused, acked = await fake.replies()
        assert registered["op"] == "registered"
        assert [r.get("code") for r in refused] == ["malformed"] * len(BAD), refused
        assert acked == {"op": "ack", "seq": 7}  # the same link, served on
        event = await recorder.wait("engine.ready", lambda e: e.engine.engine_id == "odd-1")
        assert event.engine.endpoint == "http://127.0.0.1:1" and event.engine.shadows is None
        assert not recorder.of("fault.detected", lambda f: f.engine_id == "odd-1")  # the bogus fatal did nothing
        fake.kill()
        # its record saves as before: the death is its one fault, and the record says failed
        fault = await recorder.wait("fault.detected", lambda f: f.engine_id == "odd-1")
        assert fault.kind is FaultKind.KILLED
        await wait_until(lambda: _state(store, "odd-1", "failed"), what="the failed engine's record")
    finally:
        fake.kill()
    log = (agent.log_dir / "agent.log").read_text(errors="replace")
    assert "Task exception was never retrieved" not in log and "exit callback" not in log


async def _state(store: Store, engine_id: str, state: str) -> bool:
    rec = (await engine_records(store)).get(engine_id)
    return rec is not None and rec.state == state


@pytest.mark.parametrize("field", [{"pid": [0]}, {"engine_id": "a\nb"}, {"role": "leader"}, {"gpu": "zero"},
                                   {"followers": {"1": 2}}, {"endpoint": {"x": 1}}, {"model": "m" * 300}])
async def test_a_malformed_registration_is_answered_malformed_and_adopts_nothing(
        field: dict, agent: AgentProcess, store: Store, settings: CommonSettings) -> None:
    agent.start([])
    await agent.wait_up(store)
    path = str(settings.state_dir / "agent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        wire.send_frame(s, {"op": "register", "engine_id": "bad-1", "pid": os.getpid(), "model": "m", **field})
        reply, _ = wire.recv_frame(s)
    assert reply["op"] == "error" and reply["code"] == "malformed", reply
    assert not [k for k in await engine_records(store) if k.startswith(("bad-", "a\n"))]
    fake = FakeLink(path, {"engine_id": "good-1", "role": "active", "model": "m"})  # the agent serves on
    try:
        assert (await fake.replies())[0]["op"] == "registered"
    finally:
        fake.kill()


def test_what_an_engine_sends_parses_and_what_it_never_sends_is_malformed() -> None:
    reg = parse_register({"op": "register", "protocol": 1, "engine_id": "e", "pid": 3, "role": "standby",
                          "model": "m", "engine_class": "c", "gpu": 1, "version": "2", "state": "standby",
                          "endpoint": None, "heartbeats": True, "can_shadow": True, "shadows": None, "fences": False,
                          "followers": [{"rank": 1, "pid": 4, "pid_start": 9}], "spare": True, "death_mark": True,
                          "newer": "ignored"})
    assert reg.role == "standby" and reg.followers[0].pid == 4 and reg.death_mark
    fatal = parse_message({"op": "fatal", "kind": "cuda_error", "detail": "d" * 5000, "seq": 1})
    assert fatal.kind is FaultKind.CUDA_ERROR and len(fatal.detail) == 2000  # kept as the client would send it
    for bad in BAD:
        with pytest.raises(MalformedMessage):
            parse_message(bad)
    with pytest.raises(MalformedMessage, match="first frame must be register"):
        parse_register({"op": "ready"})
