"""A buggy or hostile client on the engine socket, one defect each (issue 18's next round): every request it makes
gets a typed reply, the connection, the lease table and every other client stay as they were.

- A chunk size that rounds past 64 bits made a lease whose reply could not be encoded: the connection dropped, and
  every later grant of that engine id's leases dropped too (its own attach, a successor's takeover).
- A lease name of megabytes was taken: its row could not be mirrored to etcd or NATS (over their message limits),
  so the control plane never saw the lease.
- A reply over the frame limit (a grant of thousands of registered tensors) dropped the connection without a reply;
  and such a set could be committed, so a successor's takeover moved the leases and then could not be sent them.
- A frame declaring thousands of fds had the manager take every batch of them before refusing it: two such clients
  filled its fd table for the frame deadline.
- A client that sent requests and never read the replies kept its connection (and its uid's connection slot) for
  good: the manager's send waited forever, under no deadline.
- A first frame of 16 MiB was read whole before hello (up to the hello deadline), though a hello is a few hundred
  bytes.
- A request of a million unknown keys (or bad epochs) had pydantic build an error for each: seconds of the
  manager's event loop, every other client waiting, and a gigabyte of memory, per 9 MB frame.
- Any engine could register a gang naming other engines' leases (rank 0 was not checked): their plain takeover was
  then refused (`partial_gang`), their failover broken.
- A transfer token with a non-ASCII character made `secrets.compare_digest` raise TypeError: the takeover got no
  reply, its connection was dropped with an unhandled exception.
- One process leaking connections took every connection slot of its uid (512), and engines run as one uid: every
  other engine of the node was refused (no allocate, no takeover) until the leak's idle deadline (an hour).
- An engine id (or class, or lease name) could hold control characters: a newline in it forged a line of the
  manager's log, an escape sequence reached an operator's terminal through `holdfast status`.
- An engine's answer to an ask (its reason for refusing a sleep) had no size limit: a long one made the manager's
  reply to the control plane pass NATS's payload limit, and the command timed out instead of failing with it.
- Every process that said hello kept a pidfd in the manager until it exited, lease or not: a hundred idle
  processes, a hundred fds.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket

import msgpack
import pytest

from libs.client.protocol import MAX_ERROR_MESSAGE, MAX_LEASE_BYTES, MAX_LEASE_NAME, ReplyTooLarge
from libs.common.errors import Conflict, RemoteError
from libs.common.events import (
    Freeze,
    FreezeReply,
    LeaseState,
    ListLeases,
    ListLeasesReply,
    SleepEngine,
    SleepEngineReply,
)
from libs.common.wire import HEADER, MAX_FDS_PER_MESSAGE, PeerClosed, recv_frame, send_frame
from services.gpu_manager.mirror import allocation_key
from tests.gpu_manager.harness import until, wait_for
from tests.gpu_manager.test_sleep import engine as sleepy_engine


def _hello(path: str, engine_id: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(path)
    send_frame(s, {"op": "hello", "engine_id": engine_id})
    assert recv_frame(s)[0]["ok"]
    return s


def _ask(s: socket.socket, req: dict) -> dict:
    send_frame(s, req)
    reply, fds = recv_frame(s)
    for fd in fds:
        os.close(fd)
    return reply


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_chunk_size_past_64_bits_is_refused_and_the_engines_leases_stay_grantable(manager):
    with contextlib.closing(_hello(manager.socket, "eng-overflow")) as s:
        reply = _ask(s, {"op": "allocate", "size": 4096, "chunk_size": 2**64 - 1})
        assert reply["ok"] is False and reply["error"]["code"] == "malformed", reply
        assert "chunk_size" in reply["error"]["message"]
        assert _ask(s, {"op": "attach"}) == {"ok": True, "leases": [], "gang": None, "source": None, "restore": None,
                                             "peer": None, "passed": [], "fence": [], "manager_ms": {}}
        reply = _ask(s, {"op": "allocate", "size": MAX_LEASE_BYTES + 1})
        assert reply["error"]["code"] == "malformed", reply
        good = _ask(s, {"op": "allocate", "size": 4096, "chunk_size": 8192})
        assert good["ok"] and good["leases"][0]["lease"]["chunk_size"] == 8192
    with contextlib.closing(_hello(manager.socket, "eng-overflow")) as s:  # this process, a new connection
        granted = _ask(s, {"op": "attach"})
        assert [g["lease"]["id"] for g in granted["leases"]] == [good["leases"][0]["lease"]["id"]]


async def test_a_lease_name_too_long_to_mirror_is_refused_and_one_at_the_limit_reaches_etcd(manager, store):
    with contextlib.closing(_hello(manager.socket, "eng-names")) as s:
        reply = _ask(s, {"op": "allocate", "size": 4096, "name": "n" * (2 << 20)})
        assert reply["ok"] is False and reply["error"]["code"] == "malformed", str(reply)[:300]
        assert "name" in reply["error"]["message"]
        hello = {"op": "hello", "engine_id": "eng-class", "engine_class": "c" * 300}
        with contextlib.closing(socket.socket(socket.AF_UNIX)) as c:
            c.settimeout(10)
            c.connect(manager.socket)
            assert _ask(c, hello)["error"]["code"] == "malformed"
        assert _ask(s, {"op": "pending"}) == {"ok": True, "leases": []}
        ok = _ask(s, {"op": "allocate", "size": 4096, "name": "é" * MAX_LEASE_NAME})
        lease = ok["leases"][0]["lease"]
        assert lease["name"] == "é" * MAX_LEASE_NAME
    key = allocation_key(lease["node"], lease["id"])
    assert await until(lambda: store.get(key))  # mirrored: the control plane sees it


def test_a_reply_over_the_frame_limit_is_a_typed_error_and_the_connection_stays_usable(manager_factory):
    manager = manager_factory(HF_MAX_FRAME_BYTES=str(64 << 10)).start()
    with contextlib.closing(_hello(manager.socket, "eng-tensors")) as s:
        lease = _ask(s, {"op": "allocate", "size": 1 << 20})["leases"][0]["lease"]
        for batch in range(3):  # each register fits in a frame; the grant of all of them does not
            tensors = [{"name": f"layer.{batch}.{i}." + "w" * 64, "lease_id": lease["id"], "offset": i,
                        "shape": [1], "dtype": "uint8"} for i in range(250)]
            reply = _ask(s, {"op": "register", "epochs": {lease["id"]: lease["epoch"]}, "tensors": tensors})
            assert reply == {"ok": True}, reply
        reply = _ask(s, {"op": "attach"})
        assert reply["ok"] is False and reply["error"]["code"] == ReplyTooLarge.code, reply
        assert _ask(s, {"op": "heartbeat"}) == {"ok": True, "ask": None}
        # nor is such a set committed: a successor's takeover would move the leases, then fail to send them
        reply = _ask(s, {"op": "commit"})
        assert reply["ok"] is False and reply["error"]["code"] == ReplyTooLarge.code, reply
        assert _ask(s, {"op": "pending"})["ok"]
        assert _ask(s, {"op": "release", "lease_id": lease["id"], "epoch": lease["epoch"]}) == {"ok": True}
        assert _ask(s, {"op": "attach"})["leases"] == []


def test_a_frame_declaring_thousands_of_fds_is_refused_from_its_header_and_none_are_kept(manager):
    before = _open_fds(manager.pid)
    memfd = os.memfd_create("hf-hoard")
    socks = []
    try:
        payload = msgpack.packb({"op": "hello", "engine_id": "hoarder"})
        batch = array.array("i", [memfd] * MAX_FDS_PER_MESSAGE).tobytes()
        declared = 40 * MAX_FDS_PER_MESSAGE
        for _ in range(2):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            s.connect(manager.socket)
            socks.append(s)
            sent = 0
            with contextlib.suppress(OSError):  # the manager may refuse (and close) after the first batch
                s.sendmsg([HEADER.pack(len(payload), declared) + payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, batch)])
                for _ in range(38):  # all but the last batch: the frame stays unfinished
                    s.sendmsg([b"\x00"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, batch)])
                    sent += 1
        for s in socks:  # refused from the header: a typed reply, then the connection closes
            reply, fds = recv_frame(s)
            assert not fds and reply["error"]["code"] == "wrong_fd_count", reply
            with contextlib.suppress(PeerClosed, ConnectionError):
                while True:
                    recv_frame(s)
        held = _open_fds(manager.pid) - before
        assert held < MAX_FDS_PER_MESSAGE, f"the manager holds {held} more fds"
        with contextlib.closing(_hello(manager.socket, "eng-after-hoard")) as s:
            assert _ask(s, {"op": "allocate", "size": 4096})["ok"]
    finally:
        os.close(memfd)
        for s in socks:
            s.close()


def _refused_or_served(path: str) -> bool:
    """Whether a new connection is served (hello answered ok) rather than refused as one too many."""
    with contextlib.closing(socket.socket(socket.AF_UNIX)) as s:
        s.settimeout(10)
        s.connect(path)
        with contextlib.suppress(BrokenPipeError):  # a refused one is answered and closed at once
            send_frame(s, {"op": "hello", "engine_id": "eng-legit"})
        reply = recv_frame(s)[0]
        assert reply["ok"] or reply["error"]["code"] == "too_many_connections", reply
        return reply["ok"]


def test_a_client_that_never_reads_its_replies_loses_its_connection_not_its_slots_forever(manager_factory):
    manager = manager_factory(HF_MAX_CONNECTIONS_PER_UID="2", HF_FRAME_TIMEOUT_S="0.5").start()
    heartbeat = msgpack.packb({"op": "heartbeat"})
    burst = (HEADER.pack(len(heartbeat), 0) + heartbeat) * 40_000
    hogs = []
    try:
        for i in range(2):  # this uid's every slot, each stuck on replies its client never reads
            s = _hello(manager.socket, f"eng-deaf-{i}")
            s.setblocking(False)
            view = memoryview(burst)
            with contextlib.suppress(BlockingIOError):
                while view:
                    view = view[s.send(view):]
            assert view, "the manager read everything: nothing is stuck"
            hogs.append(s)
        assert not _refused_or_served(manager.socket)  # both slots are held now
        wait_for(lambda: _refused_or_served(manager.socket))  # a send that cannot finish ends its connection
        assert manager.child is not None and manager.child.alive()
    finally:
        for s in hogs:
            s.close()


def test_a_large_frame_before_hello_is_refused_from_its_header_and_a_hello_still_works(manager):
    with contextlib.closing(socket.socket(socket.AF_UNIX)) as s:
        s.settimeout(5)  # the hello deadline is 10 s: a refusal comes from the header, not from the deadline
        s.connect(manager.socket)
        s.sendall(HEADER.pack(8 << 20, 0) + b"\x81")  # 8 MiB promised; a hello is a few hundred bytes
        reply, _ = recv_frame(s)
        assert reply["error"]["code"] == "frame_too_large", reply
    with contextlib.closing(socket.socket(socket.AF_UNIX)) as s:  # a hello at the id limits is still taken
        s.settimeout(5)
        s.connect(manager.socket)
        assert _ask(s, {"op": "hello", "engine_id": "é" * 256, "engine_class": "ü" * 256})["ok"]
        big = _ask(s, {"op": "register", "epochs": {}, "tensors": [{"name": "t" * 500, "lease_id": "x", "offset": 0,
                                                                    "shape": [1], "dtype": "uint8"}] * 50})
        assert big["error"]["code"] == "malformed", big  # after hello, large frames are read as before


def test_processes_that_said_hello_and_hung_up_leave_no_pidfd_behind(manager):
    before = _open_fds(manager.pid)
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    children = []
    try:
        for i in range(100):  # live processes that hold no lease and no connection any more
            pid = os.fork()
            if pid == 0:  # child: never return into pytest
                code = 0
                try:
                    os.close(hold_w)
                    with contextlib.closing(_hello(manager.socket, f"eng-gone-{i}")):
                        pass
                    os.write(ready_w, b"x")
                    os.read(hold_r, 1)  # until the parent closes its end
                except BaseException:  # noqa: BLE001
                    code = 1
                os._exit(code)
            children.append(pid)
        got = b""
        while len(got) < len(children):
            got += os.read(ready_r, len(children))
        with contextlib.closing(_hello(manager.socket, "eng-probe")) as s:  # the manager has seen every close
            assert _ask(s, {"op": "pending"})["ok"]
        wait_for(lambda: _open_fds(manager.pid) - before < 10)  # a pidfd each, before: 100 more fds for good
    finally:
        os.close(hold_w)
        for pid in children:
            os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, hold_r):
            os.close(fd)


def test_a_request_with_a_million_entries_is_refused_and_the_manager_serves_on(manager):
    """A 9 MB frame of a million keys (or a map of a million bad epochs) is refused by the decoder's bound on entries
    (libs/common/wire.py; its connection then closed, as after any frame it cannot decode), a request of more fields
    than any has by their count (the connection kept); a new connection is served."""
    for i, wide in enumerate(({"op": "heartbeat", **{f"k{i}": 0 for i in range(1_000_000)}},
                              {"op": "resume", "epochs": {f"lease-{i}": "x" for i in range(1_000_000)}})):
        with contextlib.closing(_hello(manager.socket, f"eng-wide-{i}")) as s:
            s.settimeout(30)
            reply = _ask(s, wide)
            assert reply["error"]["code"] == "malformed" and "max_" in reply["error"]["message"], reply
    with contextlib.closing(_hello(manager.socket, "eng-fields")) as s:
        s.settimeout(30)
        reply = _ask(s, {"op": "heartbeat", **{f"k{i}": 0 for i in range(100)}})
        assert reply["error"]["code"] == "malformed" and "fields" in reply["error"]["message"], reply
        assert _ask(s, {"op": "heartbeat"}) == {"ok": True, "ask": None}


def test_only_its_rank_0_registers_a_gang_so_no_other_engine_can_bind_anothers_leases(manager):
    with contextlib.closing(_hello(manager.socket, "eng-victim")) as victim, \
            contextlib.closing(_hello(manager.socket, "eng-intruder")) as intruder:
        assert _ask(victim, {"op": "allocate", "size": 4096})["ok"]
        assert _ask(victim, {"op": "commit"})["ok"]
        reply = _ask(intruder, {"op": "gang_register", "gang_id": "g-stolen", "owners": ["eng-victim"]})
        assert reply["ok"] is False and reply["error"]["code"] == "permission_denied", reply
        # (a gang holding the victim's leases would refuse its plain takeover: partial_gang, a failover broken)
        reply = _ask(victim, {"op": "gang_register", "gang_id": "g-own", "owners": ["eng-victim"]})
        assert reply["ok"] and reply["gang_id"] == "g-own", reply


async def test_a_non_ascii_transfer_token_is_refused_as_wrong_not_a_dropped_connection(manager, engines, bus):
    old = engines(manager, "eng-frozen")
    old.ask(f"write {1 << 20} 5")
    frozen = await bus.request("node-1", Freeze(owner="eng-frozen"), FreezeReply)
    with contextlib.closing(_hello(manager.socket, "eng-guesser")) as s:
        for op in ({"op": "takeover", "predecessor": "eng-frozen", "transfer_token": "é" * 32},
                   {"op": "gang_takeover", "gang_id": "g-none", "rank": 0, "successors": ["eng-guesser"],
                    "generation": 1, "transfer_token": "é" * 32, "wait_s": 1}):
            reply = _ask(s, op)
            assert reply["ok"] is False and reply["error"]["code"] in ("permission_denied", "not_found"), reply
        assert _ask(s, {"op": "heartbeat"}) == {"ok": True, "ask": None}
    listed = await bus.request("node-1", ListLeases(owner="eng-frozen"), ListLeasesReply)
    assert [(i.id, i.state, i.epoch) for i in listed.leases] == [(frozen.lease_ids[0], LeaseState.FROZEN, 1)]


def _connect_refused_or_served(path: str, engine_id: str) -> tuple[socket.socket, bool]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(path)
    with contextlib.suppress(BrokenPipeError):  # a refused one is answered and closed at once
        send_frame(s, {"op": "hello", "engine_id": engine_id})
    reply = recv_frame(s)[0]
    assert reply["ok"] or reply["error"]["code"] == "too_many_connections", reply
    return s, reply["ok"]


def test_a_process_leaking_connections_hits_its_own_cap_and_its_uids_other_engines_still_connect(manager_factory):
    manager = manager_factory(HF_MAX_CONNECTIONS_PER_PID="3").start()
    held = []
    try:
        for i in range(3):
            s, served = _connect_refused_or_served(manager.socket, f"eng-leaky-{i}")
            held.append(s)
            assert served
        s, served = _connect_refused_or_served(manager.socket, "eng-leaky-more")
        s.close()
        assert not served  # this process's fourth: refused, typed
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # another process of the same uid: served, its allocate too
            ok = False
            with contextlib.suppress(BaseException):
                with contextlib.closing(_hello(manager.socket, "eng-neighbour")) as c:
                    ok = _ask(c, {"op": "allocate", "size": 4096})["ok"]
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            assert f.read() == b"1"
        os.waitpid(pid, 0)
    finally:
        for s in held:
            s.close()


def test_ids_and_names_with_control_characters_are_refused_so_no_log_line_is_forged(manager):
    forged = "eng-x\n2026-12-04 12:00:00,000 WARNING holdfast.gpu_manager: lease book wiped"
    for hello in ({"op": "hello", "engine_id": forged}, {"op": "hello", "engine_id": "eng-\x1b]0;owned\x07"},
                  {"op": "hello", "engine_id": "eng-ok", "engine_class": "c\r\n"}):
        with contextlib.closing(socket.socket(socket.AF_UNIX)) as s:
            s.settimeout(10)
            s.connect(manager.socket)
            reply = _ask(s, hello)
            assert reply["ok"] is False and reply["error"]["code"] == "malformed", reply
    with contextlib.closing(_hello(manager.socket, "eng-named ünïcode [ok]")) as s:
        assert _ask(s, {"op": "allocate", "size": 4096, "name": "w\nx"})["error"]["code"] == "malformed"
        assert _ask(s, {"op": "allocate", "size": 4096, "name": "layer 0 / wq"})["ok"]
    assert "lease book wiped" not in manager.log()


async def test_an_engine_refusing_an_ask_at_length_still_fails_the_command_with_its_reason(manager, bus):
    c, _, _ = await asyncio.to_thread(sleepy_engine, manager, "eng-loud")
    c.on_ask = lambda ask: c.answer(ask.id, Conflict("sequences in flight: " + "x" * (2 << 20)))
    c.start_heartbeats(0.05)
    try:
        with pytest.raises(RemoteError) as refused:  # was: the reply passed NATS's payload limit, a timeout here
            await bus.request("node-1", SleepEngine(engine_id="eng-loud", timeout_s=5), SleepEngineReply, timeout=10)
        assert refused.value.remote_code == "conflict", refused.value
        assert refused.value.message.startswith("sequences in flight") and len(refused.value.message) <= MAX_ERROR_MESSAGE
    finally:
        c.close()
    with contextlib.closing(_hello(manager.socket, "eng-raw")) as s:  # a client without the SDK's cut: refused
        reply = _ask(s, {"op": "answer", "ask": "a1", "error": {"code": "conflict", "message": "m" * (2 << 20)}})
        assert reply["error"]["code"] == "malformed", str(reply)[:200]
