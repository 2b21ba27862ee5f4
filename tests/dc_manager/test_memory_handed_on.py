"""A shadow promoted while the freeze ran (it serves at once, owns the leases only once its predecessor is dead)
that dies before it owned them: its incident's freeze finds no weights of its own (nothing, or the KV cache it
leased as a shadow), so the dc_manager hands on its predecessor's leases, still frozen under their first token,
to the next successor (Takeover.memory_of)."""

from __future__ import annotations

from pathlib import Path

from libs.common.bus import Bus
from libs.common.errors import NotFound
from libs.common.events import (
    EngineInfo,
    EngineRole,
    Freeze,
    FreezeReply,
    LeaseInfo,
    LeaseState,
    RecoverIntent,
    Tag,
    Takeover,
    TakeoverReply,
    engine_record_key,
)
from libs.common.store import Store
from tests.controller.helpers import healthy, service_env, start, wait_for
from tests.support import intent_results, put_node

NODE = "n-handed-on"
TOKEN = "first-token-" + "x" * 20


class Node:
    """The node side: the first engine's leases frozen under TOKEN; its successor holds none."""

    def __init__(self, owner: str, kv_of: tuple[str, ...] = ()) -> None:
        self.owner, self.kv_of = owner, kv_of
        self.freezes: list[str] = []
        self.takeovers: list[Takeover] = []

    async def freeze(self, cmd: Freeze) -> FreezeReply:
        self.freezes.append(cmd.owner)
        if cmd.owner in self.kv_of:  # a KV cache only, frozen now under the token asked for
            kv = LeaseInfo(id=f"KV-{cmd.owner}", node=NODE, gpu=0, size=1 << 20, chunk_size=1 << 20,
                           tag=Tag.KV_CACHE, owner=cmd.owner, epoch=1, state=LeaseState.FROZEN, created_at=0.0,
                           last_seen=0.0)
            return FreezeReply(lease_ids=[kv.id], epoch=1, transfer_token=cmd.transfer_token or "t", leases=[kv])
        if cmd.owner != self.owner:
            raise NotFound(f"{cmd.owner} holds no live leases on {NODE}")
        return FreezeReply(lease_ids=[f"L-{cmd.owner}"], epoch=2, transfer_token=TOKEN)  # frozen already: its token

    async def takeover(self, cmd: Takeover) -> TakeoverReply:
        self.takeovers.append(cmd)
        succ = EngineInfo(engine_id="third", node=NODE, model="m", engine_class="c", role=EngineRole.ACTIVE,
                          state="ready", endpoint="http://127.0.0.1:9/third", successor_of=cmd.memory_of)
        return TakeoverReply(engine=succ, used_standby=True)


async def _cluster(store: Store, **engines: str | None) -> None:
    await put_node(store, NODE)
    for engine, successor_of in engines.items():
        await store.put(engine_record_key(NODE, engine), EngineInfo(engine_id=engine, node=NODE, model="m", engine_class="c",
                                                        role=EngineRole.ACTIVE, state="ready",
                                                        successor_of=successor_of))


async def test_a_successor_that_died_before_owning_its_memory_has_its_predecessors_frozen_leases_handed_on(
        bus: Bus, store: Store, settings_env: dict[str, str], tmp_path: Path) -> None:
    node = Node(owner="first", kv_of=("kv-only",))
    await bus.serve(NODE, Freeze, node.freeze)
    await bus.serve(NODE, Takeover, node.takeover)
    await _cluster(store, first=None, second="first", plain=None, **{"kv-only": "first"})
    dcm = start("services.dc_manager", service_env(settings_env), tmp_path / "dcm.log")
    try:
        # The condition the view needs: the manager answers health only after its setup, which waits for its
        # view's first snapshot, read after the records above were written (the process starts after them).
        await healthy(bus, "dc_manager", "dc-1")

        await bus.emit(RecoverIntent(incident_id="inc-second", engine_id="second", model="m", node=NODE))
        got = await wait_for(lambda: intent_results(bus, "inc-second"), what="the second incident's result")
        assert [(r.step, r.ok) for r in got] == [("reattach", True)] and got[0].successor_id == "third"
        assert node.freezes == ["second", "first"]
        (takeover,) = node.takeovers
        assert (takeover.engine_id, takeover.memory_of, takeover.transfer_token) == ("second", "first", TOKEN)

        # An engine that is no one's successor and holds nothing: its freeze fails as before (the fallback).
        await bus.emit(RecoverIntent(incident_id="inc-plain", engine_id="plain", model="m", node=NODE))
        got = await wait_for(lambda: intent_results(bus, "inc-plain"), what="the plain engine's result")
        assert [(r.step, r.ok) for r in got] == [("freeze", False)] and "not_found" in got[0].detail
        assert len(node.takeovers) == 1

        # One that leased a KV cache of its own as a shadow: the freeze finds that, and no weights.
        await bus.emit(RecoverIntent(incident_id="inc-kv-only", engine_id="kv-only", model="m", node=NODE))
        got = await wait_for(lambda: intent_results(bus, "inc-kv-only"), what="the KV-only successor's result")
        assert [(r.step, r.ok) for r in got] == [("reattach", True)]
        assert node.freezes[-2:] == ["kv-only", "first"]
        assert (node.takeovers[-1].memory_of, node.takeovers[-1].transfer_token) == ("first", TOKEN)
    finally:
        dcm.stop()
