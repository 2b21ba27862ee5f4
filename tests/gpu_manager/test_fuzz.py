"""Random bytes and random frames at the engine socket: every one gets an error reply or a closed connection,
and afterwards the manager still serves and the lease table is intact."""

from __future__ import annotations

import os
import random
import socket

import msgpack

from libs.client.memory import MemoryClient
from libs.client.protocol import OutOfOrder
from libs.common.wire import HEADER, PeerClosed, recv_frame, send_frame
from tests.gpu_manager.harness import Engine

OPS = ["hello", "allocate", "register", "commit", "pending", "attach", "takeover", "share", "resume", "heartbeat", "release",
       "nope", 7]
ITERATIONS = 300


def _random_value(rng: random.Random, depth: int = 0):  # noqa: ANN202
    kind = rng.randrange(8 if depth < 2 else 5)
    if kind == 0:
        return rng.randint(-(2**63), 2**64 - 1)
    if kind == 1:
        return rng.random() * 1e12
    if kind == 2:
        return os.urandom(rng.randrange(20)).hex()
    if kind == 3:
        return None
    if kind == 4:
        return rng.choice([True, False, "weights", "kv_cache", "", "lease-x"])
    if kind == 5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["engine_id", "size", "gpu", "tag", "lease_id", "epoch", "epochs", "tensors", "name", "shape", "dtype",
            "offset", "predecessor", "transfer_token", "owner", "share_token", "x"]
    return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randrange(5))}


def _random_request(rng: random.Random) -> dict:
    req = _random_value(rng, 1)
    req = req if isinstance(req, dict) else {}
    req["op"] = rng.choice(OPS)
    return req


def _one_attack(path: str, rng: random.Random) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(path)
    try:
        kind = rng.randrange(7)
        if kind == 0:
            s.sendall(os.urandom(rng.randrange(1, 200)))
        elif kind == 1:  # a header that promises more than arrives
            payload = msgpack.packb({"op": "hello", "engine_id": "x"})
            s.sendall(HEADER.pack(len(payload) + rng.randrange(1, 100), 0) + payload)
        elif kind == 2:  # oversized
            s.sendall(HEADER.pack(rng.randrange(1 << 25, 1 << 32), 0))
        elif kind == 3:  # unexpected fds
            fd = os.memfd_create("fuzz")
            try:
                send_frame(s, {"op": "heartbeat"}, [fd])
            finally:
                os.close(fd)
        elif kind == 4:  # a random payload under a valid header
            payload = os.urandom(rng.randrange(1, 300))
            s.sendall(HEADER.pack(len(payload), 0) + payload)
        elif kind == 5:  # header declaring fds that never come
            payload = msgpack.packb({"op": "pending"})
            s.sendall(HEADER.pack(len(payload), rng.randrange(1, 5)) + payload)
        else:  # well-framed random requests, possibly after a hello
            if rng.random() < 0.5:
                send_frame(s, {"op": "hello", "engine_id": f"fuzz-{rng.randrange(1000)}"})
                recv_frame(s)
            for _ in range(rng.randrange(1, 6)):
                send_frame(s, _random_request(rng))
                reply, fds = recv_frame(s)
                for fd in fds:
                    os.close(fd)
                assert isinstance(reply.get("ok"), bool)
                if not reply["ok"]:
                    assert set(reply["error"]) == {"code", "message"}
        s.shutdown(socket.SHUT_WR)  # whatever was left half-sent is now truncated
        while True:  # drain: an error reply then close, or just close
            reply, fds = recv_frame(s)
            for fd in fds:
                os.close(fd)
            assert reply.get("ok") is False, reply
    except (TimeoutError, PeerClosed, ConnectionError):
        pass
    except OSError:
        pass
    finally:
        s.close()


def test_random_bytes_and_frames_leave_the_manager_serving_and_the_table_intact(manager):
    owner = Engine(manager.socket, "eng-precious")
    try:
        wrote = owner.ask(f"write {1 << 20} 21")
        rng = random.Random(1234)
        for _ in range(ITERATIONS):
            _one_attack(manager.socket, rng)

        assert manager.child is not None and manager.child.alive()
        assert owner.ask("hash")["data"] == wrote["expected"]
        assert owner.ask("reconnect") == {"ok": True}
        assert owner.ask("attach") == {"leases": {wrote["lease"]: 1}, "layout": wrote["layout"], "data": wrote["expected"]}
        with MemoryClient.connect("eng-after-fuzz", socket_path=manager.socket) as client:
            lease = client.allocate(4096, name="after")
            lease.numpy("uint8", (4096,))[:] = 9
            assert client.pending() == []
    finally:
        owner.close()


def test_a_request_before_hello_is_out_of_order_and_the_connection_still_works(manager):
    s = socket.socket(socket.AF_UNIX)
    s.connect(manager.socket)
    try:
        send_frame(s, {"op": "pending"})
        reply, _ = recv_frame(s)
        assert reply == {"ok": False, "error": {"code": OutOfOrder.code, "message": "'pending' before hello"}}
        send_frame(s, {"op": "hello", "engine_id": "late"})
        assert recv_frame(s)[0]["ok"] is True
        send_frame(s, {"op": "hello", "engine_id": "again"})
        assert recv_frame(s)[0]["error"]["code"] == OutOfOrder.code
        send_frame(s, {"op": "pending"})
        assert recv_frame(s)[0] == {"ok": True, "leases": []}
    finally:
        s.close()


def test_a_frame_carrying_fds_to_the_manager_is_refused_and_the_fds_are_not_kept(manager):
    s = socket.socket(socket.AF_UNIX)
    s.connect(manager.socket)
    fd = os.memfd_create("hf-intruder-fd")
    try:
        send_frame(s, {"op": "hello", "engine_id": "fds"}, [fd])
        reply, _ = recv_frame(s)
        assert reply["error"]["code"] == "malformed"
        send_frame(s, {"op": "hello", "engine_id": "fds"})
        assert recv_frame(s)[0]["ok"] is True
        targets = [os.readlink(f"/proc/{manager.pid}/fd/{n}") for n in os.listdir(f"/proc/{manager.pid}/fd")]
        assert not any("hf-intruder-fd" in t for t in targets)
    finally:
        os.close(fd)
        s.close()


