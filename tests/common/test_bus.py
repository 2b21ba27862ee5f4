"""The bus against a real nats-server: typed events, trace context, commands, JetStream replay."""

from __future__ import annotations

import asyncio
import json

import pytest
from nats.aio.msg import Msg

from libs.common import telemetry
from libs.common.bus import Bus, _typed, codec, ok_reply
from libs.common.errors import CommandTimeout, NotFound, RemoteError, Unavailable
from libs.common.events import (
    CommandEnvelope,
    EndpointAdded,
    EngineStopped,
    Envelope,
    FaultDetected,
    FaultKind,
    Freeze,
    FreezeReply,
    IncidentResolved,
    ListLeases,
    ListLeasesReply,
    TraceContext,
    command_subject,
    decode_event,
    decode_model,
    event_subject,
)

telemetry.setup("tests")


async def test_event_round_trip_carries_trace_context(bus: Bus) -> None:
    got: asyncio.Queue[tuple[Envelope, str | None]] = asyncio.Queue()

    async def handler(env: Envelope) -> None:
        from opentelemetry import trace

        span = trace.get_current_span().get_span_context()
        await got.put((env, f"{span.trace_id:032x}" if span.is_valid else None))

    await bus.subscribe("fault.detected", handler)
    with telemetry.tracer("test").start_as_current_span("incident") as span:
        sent = await bus.emit(FaultDetected(engine_id="e1", kind=FaultKind.KILLED, signal=9, pid=42))
        trace_id = f"{span.get_span_context().trace_id:032x}"
    env, seen_trace = await asyncio.wait_for(got.get(), 2)
    assert env.id == sent.id
    assert isinstance(env.data, FaultDetected) and env.data.signal == 9
    assert env.trace.traceparent and trace_id in env.trace.traceparent
    assert seen_trace == trace_id


async def test_a_wired_event_is_the_envelope_it_stands_for_and_arrives_as_one(bus: Bus) -> None:
    payloads = [
        IncidentResolved(incident_id="inc-1", engine_id="e1", successor_id="e1-s1", timings_ms={"freeze": 1.5},
                         total_ms=12.25),
        EndpointAdded(model="m\u00e9\"x\\", engine_id="e2", url="http://127.0.0.1:9/e2", predecessor_id="e1"),
        EngineStopped(engine_id="e3", exit_code=0),  # a core (not durable) event
    ]
    with telemetry.tracer("test").start_as_current_span("incident"):
        for i, payload in enumerate(payloads):
            for traceparent, incident in ((None, None), ("00-" + "ab" * 16 + "-" + "cd" * 8 + "-01", f"inc-{i}")):
                env = bus.envelope(payload, id=f"id-{i}", traceparent=traceparent, incident_id=incident)
                wired = bus.wired(payload, id=f"id-{i}", traceparent=traceparent, incident_id=incident)
                want, got = json.loads(codec.envelope_body(env)), json.loads(wired.body)  # one wire form for both
                assert abs(want.pop("time") - got.pop("time")) < 5 and list(got) == list(want) and got == want
                assert decode_event(wired.body).model_copy(update={"time": env.time}) == env
                subject, _, headers, _ = bus.events.out(env)
                assert (wired.subject, wired.headers, wired.durable, wired.id) == (subject, headers, payload.durable,
                                                                                   env.id)
    seen: asyncio.Queue[Envelope] = asyncio.Queue()

    async def handler(env: Envelope) -> None:
        await seen.put(env)

    await bus.subscribe("engine.stopped", handler)
    await bus.publish_all([bus.wired(payloads[0], id="w-resolved"), bus.wired(payloads[2], id="w-stopped")])
    await bus.publish(bus.wired(payloads[1], id="w-added"))
    assert [e.id for e in await bus.replay("incident.resolved")] == ["w-resolved"]
    assert [(e.id, e.data) for e in await bus.replay("router.endpoint.added")] == [("w-added", payloads[1])]
    core = await asyncio.wait_for(seen.get(), 2)
    assert core.id == "w-stopped" and core.data == payloads[2]


async def test_malformed_message_is_rejected_and_subscriber_keeps_working(bus: Bus) -> None:
    got: asyncio.Queue[Envelope] = asyncio.Queue()

    async def handler(env: Envelope) -> None:
        await got.put(env)

    await bus.subscribe("fault.detected", handler)
    subject = event_subject(bus.prefix, FaultDetected, bus.settings.node)
    for junk in (b"not json", b"{}", b'{"type":"fault.detected","source":"x","data":{"type":"nope"}}',
                 b'{"type":"fault.detected","source":"x","data":{"type":"fault.detected","kind":"melted","engine_id":"e"}}'):
        await bus.nc.publish(subject, junk)
    await bus.emit(FaultDetected(engine_id="good", kind=FaultKind.EXITED, exit_code=3))
    env = await asyncio.wait_for(got.get(), 2)
    assert env.data.engine_id == "good"  # type: ignore[union-attr]
    assert bus.rejected == 4
    assert got.empty()


async def test_request_reply_with_typed_reply_and_typed_error(bus: Bus) -> None:
    async def freeze(cmd: Freeze) -> FreezeReply:
        if cmd.owner == "ghost":
            raise NotFound(f"no leases owned by {cmd.owner}")
        return FreezeReply(lease_ids=["l1"], epoch=2, transfer_token="tok")

    await bus.serve("node-1", Freeze, freeze)
    reply = await bus.request("node-1", Freeze(owner="e1"), FreezeReply)
    assert reply.lease_ids == ["l1"] and reply.epoch == 2
    with pytest.raises(RemoteError) as err:
        await bus.request("node-1", Freeze(owner="ghost"), FreezeReply)
    assert err.value.remote_code == "not_found"


async def test_a_command_goes_out_as_the_command_envelope_it_stands_for(bus: Bus) -> None:
    seen: list[bytes] = []

    async def answer(msg: Msg) -> None:
        seen.append(msg.data)
        await msg.respond(ok_reply(FreezeReply(lease_ids=["l1"], epoch=2, transfer_token="tok")))

    await bus.nc.subscribe(command_subject(bus.prefix, "node-raw", Freeze), cb=answer)
    cmd = Freeze(owner="e\u00e9\"1", incident_id="inc-1")
    tp = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    assert (await bus.request("node-raw", cmd, FreezeReply, traceparent=tp)).transfer_token == "tok"
    got = decode_model(_typed(CommandEnvelope, Freeze), seen[0])  # what `serve` validates it as
    want = CommandEnvelope(id=got.id, time=got.time, source=bus.source, trace=TraceContext(traceparent=tp),
                           to="node-raw", expires=got.expires, data=cmd.model_dump())
    assert got.data == cmd and got.model_dump() == want.model_dump()
    # when its caller stops waiting: the request's timeout after it was sent (a receiver later than that refuses it)
    assert got.expires is not None and abs(got.expires - got.time - bus.settings.request_timeout_s) < 1e-3


async def test_request_times_out_or_says_nobody_answers(bus: Bus) -> None:
    with pytest.raises(Unavailable):
        await bus.request("nowhere", ListLeases(), ListLeasesReply, timeout=0.3)

    async def slow(cmd: ListLeases) -> ListLeasesReply:
        await asyncio.sleep(2)
        return ListLeasesReply(leases=[])

    await bus.serve("slow-node", ListLeases, slow)
    with pytest.raises(CommandTimeout):
        await bus.request("slow-node", ListLeases(), ListLeasesReply, timeout=0.2)


async def test_concurrent_requests_each_get_their_own_reply_and_leave_nothing_waiting(bus: Bus) -> None:
    async def freeze(cmd: Freeze) -> FreezeReply:
        await asyncio.sleep(0.01 if cmd.owner.endswith("0") else 0)  # replies come back out of order
        return FreezeReply(lease_ids=[cmd.owner], epoch=1, transfer_token=f"tok-{cmd.owner}")

    await bus.serve("node-many", Freeze, freeze)
    replies = await asyncio.gather(*(bus.request("node-many", Freeze(owner=f"e{i}"), FreezeReply) for i in range(50)))
    assert [r.lease_ids for r in replies] == [[f"e{i}"] for i in range(50)]

    async def never(cmd: ListLeases) -> ListLeasesReply:
        await asyncio.sleep(30)
        return ListLeasesReply(leases=[])

    await bus.serve("stuck-node", ListLeases, never)
    pending = asyncio.create_task(bus.request("stuck-node", ListLeases(), ListLeasesReply, timeout=10))
    await asyncio.sleep(0.1)
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    assert not bus.nc._resp_map  # a cancelled or answered request leaves no waiter behind


async def test_an_inline_responder_answers_every_command_with_its_own_reply(bus: Bus) -> None:
    seen: list[str] = []

    async def freeze(cmd: Freeze) -> FreezeReply:
        if cmd.owner == "ghost":
            raise NotFound("no leases owned by ghost")
        seen.append(cmd.owner)
        return FreezeReply(lease_ids=[cmd.owner], epoch=1, transfer_token=f"tok-{cmd.owner}")

    await bus.serve("node-inline", Freeze, freeze, inline=True, attach_trace=False)
    replies = await asyncio.gather(*(bus.request("node-inline", Freeze(owner=f"e{i}"), FreezeReply) for i in range(20)))
    assert [r.transfer_token for r in replies] == [f"tok-e{i}" for i in range(20)]
    assert sorted(seen) == sorted(f"e{i}" for i in range(20))
    with pytest.raises(RemoteError) as err:  # a failure is still a typed error reply
        await bus.request("node-inline", Freeze(owner="ghost"), FreezeReply)
    assert err.value.remote_code == "not_found"


async def test_malformed_command_gets_an_error_reply(bus: Bus) -> None:
    async def freeze(cmd: Freeze) -> FreezeReply:
        return FreezeReply(lease_ids=[], epoch=1, transfer_token="t")

    await bus.serve("node-1", Freeze, freeze)
    msg = await bus.nc.request(f"{bus.prefix}.node.node-1.gpu_manager.freeze", b'{"source":"x","data":{"op":"freeze"}}', timeout=1)
    assert b'"ok":false' in msg.data and b"malformed" in msg.data
    assert (await bus.request("node-1", Freeze(owner="e"), FreezeReply)).transfer_token == "t"


async def test_durable_consumer_replays_what_it_missed_after_a_restart(settings) -> None:  # type: ignore[no-untyped-def]
    producer = await Bus.connect(settings, "producer")
    seen: list[str] = []

    async def handler(env: Envelope) -> None:
        seen.append(env.data.engine_id)  # type: ignore[union-attr]

    consumer = await Bus.connect(settings, "consumer")
    await consumer.durable("fault.>", "controller", handler)
    await producer.emit(FaultDetected(engine_id="a", kind=FaultKind.KILLED))
    for _ in range(50):
        if seen:
            break
        await asyncio.sleep(0.05)
    await consumer.close()  # the subscriber "dies"

    await producer.emit(FaultDetected(engine_id="b", kind=FaultKind.KILLED))
    await producer.emit(FaultDetected(engine_id="c", kind=FaultKind.HUNG))

    consumer = await Bus.connect(settings, "consumer")
    await consumer.durable("fault.>", "controller", handler)
    for _ in range(100):
        if len(seen) >= 3:
            break
        await asyncio.sleep(0.05)
    assert seen == ["a", "b", "c"]
    await consumer.close()
    await producer.close()


async def test_events_delivered_together_reach_a_batch_handler_together_and_only_the_failed_one_comes_again(
        bus: Bus) -> None:
    ids = [f"e{i}" for i in range(20)]
    await bus.publish_all([bus.wired(FaultDetected(engine_id=e, kind=FaultKind.KILLED), id=f"f-{e}") for e in ids])
    await bus.js.publish(event_subject(bus.prefix, FaultDetected, "node-1"), b"not an envelope")  # stored, then terminated
    batches: list[list[str]] = []
    every = asyncio.Event()

    async def handler(envs: list[Envelope]) -> list[BaseException | None]:
        got = [env.data.engine_id for env in envs]  # type: ignore[union-attr]
        batches.append(got)
        if sum(len(b) for b in batches) == len(ids) + 1:
            every.set()
        first_e3 = sum(b.count("e3") for b in batches) == 1
        return [RuntimeError("e3 fails once") if e == "e3" and first_e3 else None for e in got]

    await bus.durable_batches("fault.>", "batched", handler, concurrency=64, ack_wait=1.0)
    await asyncio.wait_for(every.wait(), 10)
    await asyncio.sleep(1.5)  # past ack_wait: an event handled but not acked would be delivered again by now
    seen = [e for b in batches for e in b]
    assert sorted(seen) == sorted([*ids, "e3"])  # the failed one twice (nak'd), every other one once (acked)
    assert max(len(b) for b in batches) > 1  # stored events delivered at once are handled together
    assert bus.rejected == 1


async def test_a_stored_backlog_larger_than_one_socket_read_reaches_a_batch_handler_as_one_batch(
        bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    # 240 events of ~2 KB: the answer to the first pull request is ~0.5 MB, more than one socket read (256 KiB),
    # so it lands over several loop passes; it is still one batch, and a lone later event is not held back.
    # The hold's cap (50 ms) is raised: on 2 loaded cores (CI) the rest of the answer took longer than 50 ms to
    # land once, and the mechanism, not the machine's speed, is what is tested here.
    from libs.common.bus import durable

    monkeypatch.setattr(durable, "HOLD_S", 5.0)
    n = 240
    await bus.publish_all([bus.wired(FaultDetected(engine_id=f"e{i}", kind=FaultKind.KILLED, detail="m" * 2000),
                                     id=f"f-{i}") for i in range(n)])
    batches: list[int] = []
    every, late = asyncio.Event(), asyncio.Event()

    async def handler(envs: list[Envelope]) -> list[BaseException | None]:
        batches.append(len(envs))
        if sum(batches) == n:
            every.set()
        if any(env.data.engine_id == "late" for env in envs):  # type: ignore[union-attr]
            late.set()
        return [None] * len(envs)

    await bus.durable_batches("fault.>", "backlog", handler, concurrency=256)
    await asyncio.wait_for(every.wait(), 10)
    assert batches == [n]
    sent = asyncio.get_running_loop().time()
    await bus.publish_all([bus.wired(FaultDetected(engine_id="late", kind=FaultKind.KILLED), id="f-late")])
    await asyncio.wait_for(late.wait(), 2)
    assert asyncio.get_running_loop().time() - sent < 1.0  # handed over as it came: nothing more was pending


async def test_batch_handlers_read_each_events_delivery_count_and_a_failed_one_comes_again_counted_twice(
        bus: Bus) -> None:
    from libs.common.bus import delivery_attempts

    ids = [f"e{i}" for i in range(6)]
    await bus.publish_all([bus.wired(FaultDetected(engine_id=e, kind=FaultKind.KILLED), id=f"f-{e}") for e in ids])
    seen: list[tuple[str, int]] = []
    both = asyncio.Event()

    async def handler(envs: list[Envelope]) -> list[BaseException | None]:
        attempts = delivery_attempts.get()
        got = [env.data.engine_id for env in envs]  # type: ignore[union-attr]
        seen.extend(zip(got, attempts, strict=True))
        if ("e2", 2) in seen:
            both.set()
        return [RuntimeError("e2 fails once") if (e, n) == ("e2", 1) else None for e, n in zip(got, attempts, strict=True)]

    await bus.durable_batches("fault.>", "counted", handler, concurrency=16, ack_wait=1.0)
    await asyncio.wait_for(both.wait(), 10)
    assert sorted(seen) == sorted([(e, 1) for e in ids] + [("e2", 2)])
    assert delivery_attempts.get() == ()  # outside a batch handler: nothing


async def test_a_durable_consumer_runs_at_most_its_concurrency_and_asks_again_after_a_request_expires(
        bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    from libs.common.bus import durable

    monkeypatch.setattr(durable, "FETCH_WAIT_S", 0.3)  # each pull request expires (a 408) after 0.3 s
    running, most, seen = [0], [0], []
    every = asyncio.Event()

    async def handler(env: Envelope) -> None:
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.05)
        running[0] -= 1
        seen.append(env.data.engine_id)  # type: ignore[union-attr]
        if len(seen) == 12:
            every.set()

    await bus.publish_all([bus.wired(FaultDetected(engine_id=f"a{i}", kind=FaultKind.KILLED), id=f"f-a{i}")
                           for i in range(6)])
    await bus.durable("fault.>", "bounded", handler, concurrency=3, ack_wait=5.0)
    await asyncio.sleep(1.0)  # the stored six handled; several requests expire with nothing to bring
    await bus.publish_all([bus.wired(FaultDetected(engine_id=f"b{i}", kind=FaultKind.KILLED), id=f"f-b{i}")
                           for i in range(6)])
    await asyncio.wait_for(every.wait(), 10)
    assert sorted(seen) == sorted([f"a{i}" for i in range(6)] + [f"b{i}" for i in range(6)])
    assert most[0] == 3  # the three slots filled, never more


async def test_commands_sent_together_answer_each_in_its_place_with_typed_errors_and_timeouts(
        bus: Bus) -> None:
    async def freeze(cmd: Freeze) -> FreezeReply:
        if cmd.owner == "gone":
            raise NotFound("no leases owned by gone")
        return FreezeReply(lease_ids=[f"L-{cmd.owner}"], epoch=2, transfer_token=f"tok-{cmd.owner}")

    await bus.serve("n1", Freeze, freeze)
    async def silent(msg: Msg) -> None:
        pass  # takes the command, never answers

    await bus.nc.subscribe(command_subject(bus.prefix, "mute", Freeze), cb=silent)
    calls = [("n1", Freeze(owner="a", incident_id="i1"), None), ("n1", Freeze(owner="gone", incident_id="i2"), None),
             ("nobody", Freeze(owner="b", incident_id="i3"), None), ("mute", Freeze(owner="c", incident_id="i4"), None),
             ("n1", Freeze(owner="d", incident_id="i5"), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]
    got: dict[int, object] = {}
    passes = 0
    async for arrived in bus.request_all(calls, FreezeReply, timeout=1.0):
        passes += 1
        for i, value in arrived:
            assert i not in got  # each call's outcome once
            got[i] = value
    assert sorted(got) == [0, 1, 2, 3, 4] and passes < 5  # replies of one loop pass come together
    assert isinstance(got[0], FreezeReply) and got[0].transfer_token == "tok-a"
    assert isinstance(got[4], FreezeReply) and got[4].transfer_token == "tok-d"
    assert isinstance(got[1], RemoteError) and got[1].remote_code == "not_found"
    assert isinstance(got[2], Unavailable)
    assert isinstance(got[3], CommandTimeout)
    assert not bus.nc._resp_map and not bus.link.inbox.waiting  # nothing left waiting for a reply


async def test_an_inline_subscription_takes_its_messages_in_order_and_outlives_a_failing_handler(bus: Bus) -> None:
    # The link's reply inbox and pull consumers' inboxes are handled as each message is parsed (connection.py,
    # `Connection`), not through a queue and a task: the same messages, in the order the server sent them.
    link = bus.link
    got: list[bytes] = []
    every = asyncio.Event()

    def handler(msg: Msg) -> None:
        if msg.data == b"bad":
            raise RuntimeError("a handler's bug")
        got.append(msg.data)
        if len(got) == 50:
            every.set()

    sub = await link.subscribe_inline("inline.test", handler)
    assert sub._id in link.nc.inline  # type: ignore[attr-defined]
    for i in range(50):
        await bus.nc.publish("inline.test", b"bad" if i == 10 else str(i).encode())
        if i == 10:
            await bus.nc.publish("inline.test", b"10")
    await asyncio.wait_for(every.wait(), 5)
    assert got == [str(i).encode() for i in range(50)]
    assert bus.nc.is_connected  # the raise was logged; the read loop went on
    await link.unsubscribe(sub)
    assert sub._id not in link.nc.inline  # type: ignore[attr-defined]
