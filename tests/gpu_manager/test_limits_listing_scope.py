"""Listings answer for the caller only (issue 18, part 5): `pending` returns the calling principal's own
leases (its engine id and its uid from SO_PEERCRED), never another user's lease metadata, even when the
other user names the same engine id."""

from __future__ import annotations

import os

import pytest

from libs.client.memory import MemoryClient
from libs.common.errors import HoldfastError
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
