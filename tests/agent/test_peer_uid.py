"""The agent's socket serves only allowed uids (SO_PEERCRED), whatever its mode (issue 18, part 5): another user
reachable through a looser `socket_mode` cannot register an engine (whose endpoint the router would use)."""

from __future__ import annotations

import os

import pytest

from libs.client.agent_link import AgentLink
from libs.common.errors import HoldfastError
from libs.common.store import Store
from services.agent.link_server import uid_refusal
from tests.agent.conftest import AgentProcess, engine_records
from tests.gpu_manager.harness import as_other_uid

NOBODY = 65534
root_only = pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a child under another uid")


def _register_as(socket_path: str, engine_id: str) -> dict:
    try:
        link = AgentLink.connect(engine_id, socket_path=socket_path, role="active", model="pattern-m", timeout=3.0)
    except HoldfastError as e:
        return {"code": getattr(e, "remote_code", e.code), "message": e.message}
    link.close()
    return {"code": "registered"}


@root_only
async def test_another_uid_is_refused_with_a_typed_error_even_through_a_world_writable_socket(
        agent: AgentProcess, store: Store, open_dir: str) -> None:
    sock = f"{open_dir}/agent.sock"
    agent.start([], agent_socket=sock, socket_mode=0o666)
    await agent.wait_up(store)
    assert oct(os.stat(sock).st_mode & 0o777) == oct(0o666)

    got = as_other_uid(NOBODY, lambda: _register_as(sock, "intruder-1"))
    assert got["code"] == "permission_denied" and f"uid {NOBODY}" in got["message"]
    assert "intruder-1" not in await engine_records(store)  # nothing adopted, nothing announced
    assert "refused a connection" in (agent.log_dir / "agent.log").read_text()
    # the agent's own uid is served as before
    assert _register_as(sock, "own-1") == {"code": "registered"}


@root_only
async def test_a_uid_in_the_allow_list_may_register(agent: AgentProcess, store: Store, open_dir: str) -> None:
    sock = f"{open_dir}/agent.sock"
    agent.start([], agent_socket=sock, socket_mode=0o666, allowed_uids=f"[0, {NOBODY}]")
    await agent.wait_up(store)
    assert as_other_uid(NOBODY, lambda: _register_as(sock, "guest-1")) == {"code": "registered"}


def test_the_uid_rule_allows_only_the_listed_uids():
    assert uid_refusal(1000, frozenset({1000})) is None
    assert "uid 1001" in (uid_refusal(1001, frozenset({1000})) or "")
