"""The fd keeper serves its gpu_manager alone (the process holding `<socket>.manager`), not every process of its uid
(every engine runs as that uid), and closes every fd a refused request brought (probe of 2026-12-06)."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from libs.common.errors import RemoteError, Unavailable
from libs.common.wire import recv_frame, send_frame
from services.gpu_manager.keeper_client import KeeperClient, keeper_pid
from tests.gpu_manager.harness import wait_for

N = 2 * 1024 * 1024 + 100


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def ask(path: str, req: dict, fds: list[int] | None = None) -> tuple[dict, list[int]]:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        try:
            send_frame(s, req, fds or [])
        except BrokenPipeError:  # a refused peer is answered at once and hung up on, maybe before it has sent
            pass  # all its frame: the answer is still there to read
        return recv_frame(s)


def test_a_process_of_the_keepers_uid_that_is_not_its_gpu_manager_gets_nothing_and_changes_nothing(manager, engines):
    victim = engines(manager, "eng-victim")
    wrote = victim.ask(f"write {N} 21")
    keeper = manager.keeper_pid()
    assert keeper is not None
    before = fd_count(keeper)
    mine = os.memfd_create("intruder")
    os.ftruncate(mine, N)
    try:
        for req, fds in (({"op": "list"}, []), ({"op": "drop", "key": wrote["lease"]}, []),
                         ({"op": "put", "key": wrote["lease"], "meta": {"gpu": 0}}, [mine, mine, mine])):
            reply, got = ask(manager.keeper_socket, req, fds)
            assert reply["ok"] is False and reply["error"]["code"] == "permission_denied", (req, reply)
            assert got == []  # not one of the leases' memfds
    finally:
        os.close(mine)
    wait_for(lambda: fd_count(keeper) == before, timeout=10)  # nothing kept, nothing dropped (refused connections
    # are closed by the keeper a moment after their answer)
    manager.kill()  # the keeper's copies are what a restarted manager adopts: still the victim's memory
    manager.start()
    victim.kill()
    successor = engines(manager, "eng-victim")
    assert successor.ask("attach")["data"] == wrote["expected"]


async def test_one_gpu_manager_per_keeper_and_a_refused_put_keeps_none_of_its_fds(tmp_path: Path) -> None:
    path = tmp_path / "k.sock"
    ours = KeeperClient(path)
    try:
        assert await ours.ping() > 0  # started the keeper, holding the manager's lock
        with pytest.raises(Unavailable, match="another gpu_manager"):
            await KeeperClient(path).ping()
        pid = keeper_pid(path)
        assert pid is not None
        before = fd_count(pid)
        fds = [os.memfd_create(f"m{i}") for i in range(20)]
        try:
            for _ in range(5):
                with pytest.raises(RemoteError) as bad:
                    await ours.call({"op": "put", "key": "k1", "meta": [1, 2, 3]}, fds)
                assert bad.value.remote_code == "malformed"
        finally:
            for fd in fds:
                os.close(fd)
        assert fd_count(pid) == before  # the same connection throughout: nothing to wait for
        await ours.put("k1", fds[:0])
        assert "k1" in await ours.listing()
    finally:
        ours.close()
        pid = keeper_pid(path)
        if pid is not None:  # the keeper this test started (its own session: our child until reaped)
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda: gone(pid), timeout=10)
