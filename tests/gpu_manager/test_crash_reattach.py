"""Memory outlives the engine and the manager: real processes, real SIGKILL, real memfd memory (host backend)."""

from __future__ import annotations

import errno
import json
import os
import stat
import time

import pytest

from libs.client.memory import MemoryClient
from libs.common.errors import HoldfastError
from tests.gpu_manager.harness import as_other_uid, holds_lease_memory, wait_for

N = 3 * 1024 * 1024 + 12345  # spans several 1 MiB chunks, last one partial



def test_engine_socket_is_created_owner_only(manager):
    assert stat.S_IMODE(os.stat(manager.socket).st_mode) == 0o600


def test_killed_engine_memory_is_reattached_by_a_new_process_with_identical_bytes(manager, engines):
    first = engines(manager, "eng-a")
    wrote = first.ask(f"write {N} 7")
    assert wrote["data"] == wrote["expected"]
    first.kill()

    second = engines(manager, "eng-a")
    assert second.ask("pending")["pending"] == [wrote["lease"]]
    got = second.ask("attach")
    assert got["leases"] == {wrote["lease"]: 2}  # claimed by a new process: epoch + 1
    assert got["data"] == wrote["expected"]
    assert got["layout"] == wrote["layout"]


def test_manager_killed_and_restarted_loses_nothing_and_engines_keep_working(manager, engines):
    live = engines(manager, "eng-live")
    live_wrote = live.ask(f"write {N} 1")
    crashed = engines(manager, "eng-crash")
    crash_wrote = crashed.ask(f"write {N} 2")
    keeper = manager.keeper_pid()

    manager.kill()
    crashed.kill()  # an engine dies while no manager runs
    assert live.ask("hash")["data"] == live_wrote["expected"]  # mapped memory is untouched
    manager.start()
    assert manager.keeper_pid() == keeper  # the same keeper handed the fds back

    assert live.ask("reconnect") == {"ok": True}
    again = live.ask("attach")
    assert again["leases"] == {live_wrote["lease"]: 1}  # still its own, same process: same epoch
    assert again["data"] == live_wrote["expected"]

    successor = engines(manager, "eng-crash")
    got = successor.ask("attach")
    assert got["leases"] == {crash_wrote["lease"]: 2}
    assert got["data"] == crash_wrote["expected"]


def test_a_stranger_engine_id_gets_nothing_and_cannot_touch_the_lease(manager, engines):
    owner = engines(manager, "eng-owner")
    wrote = owner.ask(f"write {N} 3")
    owner.kill()

    stranger = engines(manager, "eng-stranger")
    assert stranger.ask("pending")["pending"] == []
    assert stranger.ask("attach")["leases"] == {}
    meta = {"name": "x", "lease_id": wrote["lease"], "offset": 0, "shape": [1], "dtype": "uint8"}
    refused = stranger.ask("call register " + json.dumps({"epochs": {wrote["lease"]: 1}, "tensors": [meta]}))
    assert refused["code"] == "permission_denied"
    assert stranger.ask("call release " + json.dumps({"lease_id": wrote["lease"], "epoch": 1}))["code"] == "permission_denied"
    # nothing frozen to take (yet: its leases live, orphaned); a successor promoted during the freeze waits on this
    assert stranger.ask("takeover eng-owner guessed-token")["code"] == "not_frozen_yet"
    assert stranger.ask("takeover eng-nobody guessed-token")["code"] == "not_found"

    rightful = engines(manager, "eng-owner")
    assert rightful.ask("attach")["data"] == wrote["expected"]


def _attach_as(socket_path: str, engine_id: str) -> dict:
    try:
        with MemoryClient.connect(engine_id, socket_path=socket_path) as client:
            return {"leases": [lease.id for lease in client.attach().leases]}
    except HoldfastError as e:
        return {"code": e.code}
    except OSError as e:
        return {"code": "os_error", "errno": e.errno}


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a child under another uid")
def test_another_uid_gets_nothing_even_with_the_right_engine_id(manager_factory, engines, open_dir):
    sock = f"{open_dir}/gm.sock"
    manager = manager_factory(HF_SOCKET_MODE="438", HF_GPU_MANAGER_SOCKET=sock).start()  # 0o666: reachable
    owner = engines(manager, "eng-uid")
    wrote = owner.ask(f"write {N} 4")
    owner.kill()

    # as for an engine id never seen (gpu_manager scope.py): not refused, which would tell the id exists
    assert as_other_uid(65534, lambda: _attach_as(sock, "eng-uid")) == {"leases": []}
    rightful = engines(manager, "eng-uid")
    assert rightful.ask("attach")["data"] == wrote["expected"]


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a child under another uid")
def test_another_uid_cannot_even_connect_to_an_owner_only_socket(manager_factory, open_dir):
    sock = f"{open_dir}/gm.sock"
    manager_factory(HF_GPU_MANAGER_SOCKET=sock).start()
    assert as_other_uid(65534, lambda: _attach_as(sock, "eng-x")) == {"code": "os_error", "errno": errno.EACCES}


def test_orphan_is_reclaimed_after_its_deadline_and_its_memory_is_freed_everywhere(manager_factory, engines):
    manager = manager_factory(HF_GRACE_S="1.0").start()
    owner = engines(manager, "eng-gone")
    wrote = owner.ask(f"write {N} 5")
    keeper = manager.keeper_pid()
    assert keeper is not None
    assert holds_lease_memory(manager.pid, wrote["lease"]) and holds_lease_memory(keeper, wrote["lease"])
    owner.kill()

    wait_for(lambda: not holds_lease_memory(manager.pid, wrote["lease"]))
    wait_for(lambda: not holds_lease_memory(keeper, wrote["lease"]))
    late = engines(manager, "eng-gone")
    assert late.ask("pending")["pending"] == []
    assert late.ask("attach")["leases"] == {}


def test_a_claimed_lease_is_not_reclaimed_when_its_old_deadline_passes(manager_factory, engines):
    # The successor's process is started (and connected) before the kill: the grace then only has to outlast
    # one attach, not a Python start-up that takes seconds on a loaded 2-core machine.
    manager = manager_factory(HF_GRACE_S="5.0").start()
    first = engines(manager, "eng-claim")
    wrote = first.ask(f"write {N} 6")
    second = engines(manager, "eng-claim")
    assert second.ask("status")["connected"]
    first.kill()
    assert second.ask("attach")["data"] == wrote["expected"]

    time.sleep(5.5)  # past the old deadline (grace 5 s): many reconciler passes (every 0.1 s) run meanwhile
    assert holds_lease_memory(manager.pid, wrote["lease"])
    assert second.ask("hash")["data"] == wrote["expected"]
    assert second.ask("attach")["leases"] == {wrote["lease"]: 2}


def test_a_stale_epoch_is_refused(manager, engines):
    first = engines(manager, "eng-epoch")
    wrote = first.ask(f"write {N} 8")
    first.kill()
    second = engines(manager, "eng-epoch")
    assert second.ask("attach")["leases"] == {wrote["lease"]: 2}

    meta = {"name": "late", "lease_id": wrote["lease"], "offset": 0, "shape": [4], "dtype": "uint8"}
    stale = second.ask("call register " + json.dumps({"epochs": {wrote["lease"]: 1}, "tensors": [meta]}))
    assert stale["code"] == "stale_epoch"
    assert second.ask("call release " + json.dumps({"lease_id": wrote["lease"], "epoch": 1}))["code"] == "stale_epoch"
    current = second.ask("call register " + json.dumps({"epochs": {wrote["lease"]: 2}, "tensors": [meta]}))
    assert current == {"code": "ok"}
