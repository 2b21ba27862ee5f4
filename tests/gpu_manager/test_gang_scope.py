"""Another user's gang is unknown to an engine (issue 20, gangs.py invariant 7): `gang_takeover` of another uid's gang
and `gang_register` naming a rank whose leases are another uid's are answered exactly as for a gang or a rank nobody
has, and the manager logs why. Before: the takeover got `permission_denied` (the gang's checks ran) against an unknown
gang's `not_found`, and the registration `permission_denied` ("a rank's leases belong to another user") against an
unknown rank's `partial_gang`: any user of the node could tell which gangs and rank engine ids exist."""

from __future__ import annotations

import contextlib
import json
import os
import socket

import pytest

from libs.client.memory import MemoryClient
from libs.common.wire import recv_frame, send_frame
from tests.gpu_manager.harness import as_other_uid
from tests.gpu_manager.test_gang_socket import RANKS, ranks_with_leases

GANG = "gang-private"  # RANKS' gang, the test uid's


def _ask_as(socket_path: str, engine_id: str, req: dict) -> dict:
    with contextlib.closing(socket.socket(socket.AF_UNIX)) as s:
        s.settimeout(10)
        s.connect(socket_path)
        send_frame(s, {"op": "hello", "engine_id": engine_id})
        assert recv_frame(s)[0]["ok"]
        send_frame(s, req)
        reply, fds = recv_frame(s)
        for fd in fds:
            os.close(fd)
        return reply


def _probe_as(socket_path: str) -> dict:
    """As rank 0 of a group of its own (committed weights: a registration is judged on its other ranks), every gang
    request once naming the other user's gang or rank and once one nobody has; the replies with the name as <id>.
    A registration names its own group's ranks only (gangs.py invariant 8): group `x`'s rank 1 is the other user's
    engine `x-r1`, group `y`'s nobody's."""
    out: dict[str, list] = {}
    with contextlib.ExitStack() as stack:
        for me in ("x", "y"):
            mine = stack.enter_context(MemoryClient.connect(me, socket_path=socket_path))
            lease = mine.allocate(4096, tag="weights", name="weights")
            lease.numpy("uint8", (4096,))[:] = 7
            mine.register([lease.meta("weights", "uint8", (4096,))])
            mine.commit()
        for (me, named), req in (
                *[((g, f"{g}-r1"), {"op": "gang_register", "gang_id": "gx", "owners": [g, f"{g}-r1"]}) for g in "xy"],
                *[(("x", gang), {"op": "gang_takeover", "gang_id": gang, "rank": 0, "successors": ["x", "x-r1"],
                                 "generation": 1, "transfer_token": "t" * 32, "wait_s": 1})
                  for gang in (GANG, "gang-nobody")]):
            reply = _ask_as(socket_path, me, req)
            out.setdefault(req["op"], []).append(json.loads(json.dumps(reply).replace(named, "<id>")))
    return out


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a child under another uid")
def test_another_users_gang_and_ranks_are_answered_as_unknown_ones_and_the_manager_logs_why(
        manager_factory, engines, open_dir):  # noqa: ANN001
    sock = f"{open_dir}/gm.sock"
    manager = manager_factory(HF_SOCKET_MODE="438", HF_GPU_MANAGER_SOCKET=sock).start()  # 0o666: reachable
    group = ranks_with_leases(engines, manager)
    assert group[0].ask(f"call gang_register {json.dumps({'gang_id': GANG, 'owners': RANKS})}") == {"code": "ok"}
    assert "lease" in engines(manager, "x-r1").ask("write 4096 3 weights")  # this uid's engine, as group x's rank 1

    replies = as_other_uid(65534, lambda: _probe_as(sock))
    assert "code" not in replies, replies
    for op, (theirs, unknown) in replies.items():
        assert theirs == unknown, (op, theirs, unknown)
    assert replies["gang_register"][0]["error"]["code"] == "partial_gang"
    assert replies["gang_takeover"][0]["error"]["code"] == "not_found"
    log = (manager.state_dir.parent / f"gpu_manager.{manager.starts}.log").read_text()
    uid = os.getuid()
    assert f"engine id x-r1's leases belongs to uid {uid}: answered as unknown to x (uid 65534" in log
    assert f"gang {GANG} belongs to uid {uid}: answered as unknown to x (uid 65534" in log
    # the gang as it was: its own ranks register it again
    assert group[0].ask(f"call gang_register {json.dumps({'gang_id': GANG, 'owners': RANKS})}") == {"code": "ok"}
