"""The agent's engine socket is bounded (link_server.py rule 4): whatever one same-uid process does there (stall
frames, send fds, open connection after connection), it holds few of the agent's fds, and a replacement engine
still registers (probe of 2026-12, section 3: two stalled connections held all 20000 fds, and none could)."""

from __future__ import annotations

import array
import asyncio
import os
import select
import signal
import socket
import subprocess
import sys

from libs.common import wire
from libs.common.config import CommonSettings
from libs.common.store import Store
from services.agent import protocol
from tests.agent.conftest import ROOT, AgentProcess, Recorder, pattern_spec
from tests.agent.fake_link import FakeLink, null_fds, open_fds, raw_frame
from tests.support import wait_until

# Opens `n` connections, on each the start of a register frame with one fd (a dup of /dev/null), and stalls; then
# prints how many were answered (refused) at once and holds the rest.
HOARDER = """
import array, os, select, socket, sys, time
from libs.common import wire
path, n = sys.argv[1], int(sys.argv[2])
null = os.open("/dev/null", os.O_RDONLY)
data = b"".join(seg for seg, _ in wire.encode_frame({"op": "register", "engine_id": "h", "pid": os.getpid()}, [null]))
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    try:
        s.sendmsg([data[:-1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [null]).tobytes())])
    except OSError:
        pass  # refused and closed already
    socks.append(s)
time.sleep(1.0)
answered = [s for s in socks if select.select([s], [], [], 0)[0]]
codes = []
for s in answered:
    try:
        codes.append(wire.recv_frame(s)[0].get("code"))
    except Exception as e:
        codes.append(type(e).__name__)
print(len(answered), sorted(set(codes)), flush=True)
time.sleep(120)
"""


async def test_one_process_stalling_many_registrations_holds_few_fds_and_a_replacement_engine_registers(
        agent: AgentProcess, recorder: Recorder, settings: CommonSettings) -> None:
    agent.start([pattern_spec()], takeover_wait_s=0.5, register_timeout_s=120, max_links_per_pid=4)
    victim = (await recorder.wait("engine.ready")).engine
    assert agent.child is not None
    before = open_fds(agent.child.pid)
    hoarder = subprocess.Popen([sys.executable, "-c", HOARDER, str(settings.state_dir / "agent.sock"), "40"],
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE)
    try:
        assert hoarder.stdout is not None
        said = (await asyncio.wait_for(asyncio.to_thread(hoarder.stdout.readline), 30)).decode()
        assert said.strip() == "36 ['too_many_connections']"  # 4 held (its cap), the rest refused at once
        # its 4 connections and their 4 fds at most (the fds of the engines' processes may come and go besides)
        assert open_fds(agent.child.pid) <= before + 2 * 4 + 2
        os.kill(victim.pid, signal.SIGKILL)
        fresh = await recorder.wait("engine.ready", lambda e: e.engine.engine_id != victim.engine_id, within_s=30)
        assert fresh.engine.pid != victim.pid and hoarder.poll() is None  # registered while the hoard is held
    finally:
        hoarder.kill()
        hoarder.wait(10)


async def test_a_registration_not_whole_in_time_is_answered_timeout_and_its_fd_closed(
        agent: AgentProcess, store: Store, settings: CommonSettings) -> None:
    agent.start([], register_timeout_s=1, frame_timeout_s=1)
    await agent.wait_up(store)
    assert agent.child is not None
    before = null_fds(agent.child.pid)
    data = b"".join(seg for seg, _ in wire.encode_frame({"op": "register", "engine_id": "slow", "pid": 1}, [0]))
    null = os.open("/dev/null", os.O_RDONLY)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(settings.state_dir / "agent.sock"))
        s.sendmsg([data[:-1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [null]).tobytes())])
        s.settimeout(10)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        reply, _ = await asyncio.to_thread(wire.recv_frame, s)
        assert reply["code"] == "timeout" and loop.time() - t0 < 5
        assert await asyncio.to_thread(s.recv, 1) == b""  # then closed
    os.close(null)
    await wait_until(lambda: null_fds(agent.child.pid) <= before, what="the stalled frame's fd closed")


async def test_a_frame_over_the_links_limits_is_refused_from_its_header_with_its_fds_closed(
        agent: AgentProcess, store: Store, settings: CommonSettings) -> None:
    agent.start([])
    await agent.wait_up(store)
    assert agent.child is not None
    path = str(settings.state_dir / "agent.sock")
    before = null_fds(agent.child.pid)
    null = os.open("/dev/null", os.O_RDONLY)
    try:
        # 300 fds declared, 253 sent with the header (the transport's default let it bring 16384, all held)
        hoard = wire.HEADER.pack(10, 300)
        assert _refusal(path, hoard, [null] * 253) == "wrong_fd_count"
        big = wire.HEADER.pack(protocol.MAX_REGISTER_BYTES + 1, 0)  # a registration of more than it can be
        assert _refusal(path, big, []) == "frame_too_large"
    finally:
        os.close(null)
    await wait_until(lambda: null_fds(agent.child.pid) <= before, what="the refused frames' fds closed")
    # after registration, no fd is taken at all: a heartbeat that brings one is refused, and its link closed
    fake = FakeLink(path, {"engine_id": "fd-1", "role": "active", "model": "m"},
                    [{"raw": raw_frame({"op": "heartbeat"}, 1), "fds": 1}, {"op": "bye", "seq": 1}])
    try:
        registered, refused, after = await fake.replies()
        assert registered["op"] == "registered"
        assert refused["code"] == "wrong_fd_count" and "exc" in after
        await wait_until(lambda: null_fds(agent.child.pid) <= before, what="the heartbeat's fd closed")
    finally:
        fake.kill()


def _refusal(path: str, data: bytes, fds: list[int]) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else [])
        reply, got = wire.recv_frame(s)
        wire.close_fds(got)
        return str(reply["code"])


async def capped_at_two(agent: AgentProcess, store: Store, settings: CommonSettings,
                        n: int) -> tuple[str, list[socket.socket]]:
    """An agent whose engines' socket takes 2 connections, and `n` connections made to it (the caller closes them)."""
    agent.start([], max_links=2, register_timeout_s=60)
    await agent.wait_up(store)
    path = str(settings.state_dir / "agent.sock")
    socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n)]
    for s in socks:
        s.connect(path)
    return path, socks


async def test_connections_past_the_sockets_cap_are_refused_typed(
        agent: AgentProcess, store: Store, settings: CommonSettings) -> None:
    path, socks = await capped_at_two(agent, store, settings, 3)
    try:
        readable, _, _ = await asyncio.to_thread(select.select, socks, [], [], 5)
        assert readable == [socks[2]]
        reply, _ = wire.recv_frame(socks[2])
        assert reply["code"] == "too_many_connections"
        socks[0].close()  # a slot given back is taken again
        fake = FakeLink(path, {"engine_id": "capped-1", "role": "active", "model": "m"})
        try:
            assert (await fake.replies())[0]["op"] == "registered"
        finally:
            fake.kill()
    finally:
        for s in socks:
            s.close()


async def test_an_engine_registering_again_gives_its_old_connections_slot_back(
        agent: AgentProcess, store: Store, settings: CommonSettings) -> None:
    """A newer registration of the same engine hangs its older link up: the older connection's handler ends (a closed
    one's waited for ever), so an engine that reconnects again and again is not refused by its own old links."""
    agent.start([], max_links_per_pid=2)
    await agent.wait_up(store)
    path = str(settings.state_dir / "agent.sock")
    held = []
    try:
        for _ in range(6):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.append(s)
            s.settimeout(10)
            s.connect(path)
            wire.send_frame(s, {"op": "register", "engine_id": "again-1", "pid": os.getpid(), "model": "m"})
            reply, _ = await asyncio.to_thread(wire.recv_frame, s)
            assert reply["op"] == "registered", reply
            if len(held) > 1:
                assert await asyncio.to_thread(held[-2].recv, 1) == b""  # the older one hung up
    finally:
        for s in held:
            s.close()


async def test_an_engine_refused_by_a_full_socket_registers_once_a_slot_is_free(
        agent: AgentProcess, store: Store, settings: CommonSettings) -> None:
    """The engine's client (libs/client/agent_link.py) tries again while the socket is full, within its connect
    timeout, instead of exiting at the first `too_many_connections` (a replacement engine would have died so)."""
    from libs.client.agent_link import AgentLink

    path, socks = await capped_at_two(agent, store, settings, 2)
    try:
        connecting = asyncio.ensure_future(asyncio.to_thread(
            AgentLink.connect, "full-1", socket_path=path, role="active", model="m", timeout=20))
        await asyncio.sleep(1.0)
        assert not connecting.done()  # refused, and trying again
        socks[0].close()
        link = await asyncio.wait_for(connecting, 30)
        link.close()
    finally:
        for s in socks:
            s.close()
