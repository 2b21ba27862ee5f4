"""The agent's node key says it is up: whoever sees `nodes/<node>` (the dc_manager placing work, a test's
`wait_up`) may send it commands at once, so the key is written only once every command is served."""

from __future__ import annotations

import asyncio

import pytest

from libs.common.bus import Bus
from libs.common.errors import RemoteError
from libs.common.events import ListEngines, ListEnginesReply, Takeover, TakeoverReply
from libs.common.store import Store
from tests.agent.conftest import AgentProcess
from tests.support import wait_until

NODE_KEY = "nodes/node-1"
MARK = "nodes/node-1-watch-is-open"  # under the watched prefix; no agent reads it


async def _until_node_key(store: Store, open_: asyncio.Event) -> None:
    async for ev in store.watch_prefix(NODE_KEY):
        if ev.key == MARK:
            open_.set()
        elif ev.kind == "put" and ev.key == NODE_KEY:
            return


async def test_commands_are_answered_the_moment_the_node_key_appears(agent: AgentProcess, bus: Bus,
                                                                     store: Store) -> None:
    open_ = asyncio.Event()
    watching = asyncio.create_task(_until_node_key(store, open_))

    async def watch_open() -> bool:
        await store.put(MARK, {"open": True})
        await asyncio.sleep(0.05)
        return open_.is_set()

    await wait_until(watch_open, what="the watch on the node key")
    agent.start([])
    await asyncio.wait_for(watching, 60)
    # right away: not "no responders" for the commands the agent registers last
    listed = await bus.request("node-1", ListEngines(), ListEnginesReply, timeout=10)
    assert listed.engines == []
    with pytest.raises(RemoteError) as err:
        await bus.request("node-1", Takeover(incident_id="inc-x", engine_id="no-such", transfer_token="t"),
                          TakeoverReply, timeout=10)
    assert err.value.remote_code == "not_found"
