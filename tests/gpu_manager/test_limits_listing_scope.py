"""Listings answer for the caller only (issue 18, part 5): `pending` returns the calling principal's own
leases (its engine id and its uid from SO_PEERCRED), never another user's lease metadata, even when the
other user names the same engine id."""

from __future__ import annotations

import contextlib
import json
import os
import socket

import pytest

from libs.client.memory import MemoryClient
from libs.common.errors import HoldfastError
from libs.common.wire import recv_frame, send_frame
from tests.gpu_manager.harness import as_other_uid


def _pending_as(socket_path: str, engine_id: str) -> dict:
    try:
        with MemoryClient.connect(engine_id, socket_path=socket_path) as client:
            return {"pending": [info.model_dump(mode="json") for info in client.pending()]}
    except HoldfastError as e:
        return {"code": e.code}


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a child under another uid")
def test_pending_never_shows_another_users_leases_even_under_their_engine_id(manager_factory, engines, open_dir):
    sock = f"{open_dir}/gm.sock"
    manager = manager_factory(HF_SOCKET_MODE="438", HF_GPU_MANAGER_SOCKET=sock).start()  # 0o666: reachable
    owner = engines(manager, "eng-private")
    wrote = owner.ask("write 4096 3")
    owner.kill()  # its lease waits, ORPHANED, for a process of its engine id and uid

    assert as_other_uid(65534, lambda: _pending_as(sock, "eng-private")) == {"pending": []}
    rightful = engines(manager, "eng-private")  # the owner's uid still sees it
    assert rightful.ask("pending")["pending"] == [wrote["lease"]]


def _probe_as(socket_path: str, owner: str, lease_id: str) -> dict:
    """Every request that names a lease or an engine id, once with `lease_id` and once with an id nobody has; the
    replies with the id written as <id>, so they can be compared."""
    out: dict[str, list] = {}
    with contextlib.closing(socket.socket(socket.AF_UNIX)) as s:
        s.settimeout(10)
        s.connect(socket_path)
        send_frame(s, {"op": "hello", "engine_id": owner})  # its engine id too
        assert recv_frame(s)[0]["ok"]
        for named in (lease_id, "lease-nobody-has"):
            meta = {"name": "t", "lease_id": named, "offset": 0, "shape": [1], "dtype": "uint8"}
            for req in ({"op": "release", "lease_id": named, "epoch": 1},
                        {"op": "register", "epochs": {named: 1}, "tensors": [meta]},
                        {"op": "resume", "epochs": {named: 1}},
                        {"op": "sleep", "epochs": {named: 1}},
                        {"op": "wake", "epochs": {named: 1}}):
                send_frame(s, req)
                reply, fds = recv_frame(s)
                for fd in fds:
                    os.close(fd)
                out.setdefault(req["op"], []).append(json.loads(json.dumps(reply).replace(named, "<id>")))
        for who in (owner, "eng-nobody-is"):
            for req in ({"op": "attach"}, {"op": "takeover", "predecessor": who, "transfer_token": "t" * 32}):
                send_frame(s, req)
                reply, _ = recv_frame(s)
                out.setdefault(req["op"], []).append(json.loads(json.dumps(reply).replace(who, "<id>")))
    return out


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a child under another uid")
def test_another_users_lease_is_answered_as_an_unknown_one_and_the_manager_logs_why(manager_factory, engines, open_dir):
    """Before (issue 20): `release` of another uid's lease was `permission_denied`, of an unknown id `not_found`
    (and `resume` said `owned by another engine` against `reclaimed`; `attach` and `takeover` of its engine id told
    apart as well): any user of the node could tell which lease ids and engine ids exist."""
    sock = f"{open_dir}/gm.sock"
    manager = manager_factory(HF_SOCKET_MODE="438", HF_GPU_MANAGER_SOCKET=sock).start()  # 0o666: reachable
    owner = engines(manager, "eng-hidden")
    wrote = owner.ask("write 4096 3")  # a live lease, ACTIVE: its owner runs
    replies = as_other_uid(65534, lambda: _probe_as(sock, "eng-hidden", wrote["lease"]))
    assert "code" not in replies, replies
    for op, (theirs, unknown) in replies.items():
        assert theirs == unknown, (op, theirs, unknown)
    assert replies["release"][0]["error"]["code"] == "not_found"
    assert replies["resume"][0]["lost"] == {"<id>": "reclaimed"}
    assert replies["attach"][0]["leases"] == []
    assert replies["takeover"][0]["error"]["code"] == "not_found"
    log = (manager.state_dir.parent / f"gpu_manager.{manager.starts}.log").read_text()
    assert f"lease {wrote['lease']} belongs to uid {os.getuid()}: answered as unknown to eng-hidden (uid 65534" in log
    assert owner.ask("status")["leases"] == {wrote["lease"]: wrote["epoch"]}  # the owner's lease as it was
